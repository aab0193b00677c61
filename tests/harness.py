"""The cluster harness: real specfleet services in real processes, reached over real gRPC on loopback.

tests/conftest.py turns it into fixtures; end-to-end tests (tests/e2e/) import what they need from here."""

from __future__ import annotations

import collections
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import time

import grpc
import yaml

from specfleet.serving import CHANNEL_OPTIONS

REPO = pathlib.Path(__file__).resolve().parent.parent

# The verifier and drafters refuse calls without the internal token (specfleet/security.py). Every
# cluster and process a test starts inherits this one, so tests may call them directly.
INTERNAL_TOKEN = os.environ.setdefault("SPECFLEET_INTERNAL_TOKEN", secrets.token_hex(16))


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    pass


class WithToken(
    grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor, grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor
):
    """Adds `authorization: Bearer token` to every call of a channel."""

    def __init__(self, token: str):
        self.token = token

    def _details(self, d):
        metadata = [*(d.metadata or ()), ("authorization", f"Bearer {self.token}")]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._details(details), requests)


_GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    """A port free now and not handed out before in this process: the kernel may give a port it just gave again once
    the probing socket is closed, and one config's two services then collide on it."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


class Cluster:
    """`specfleet serve` with a given config, as a user would run it.

    cwd: the tree whose code runs (its packages shadow the installed ones), e.g. a mutated
    copy from tests/mutation.py; the repository by default."""

    def __init__(self, config: dict, workdir: pathlib.Path, name: str, cwd: pathlib.Path = REPO, env: dict | None = None):
        self.config = config
        # env: variables added to the test's own; None removes one.
        merged = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env = {k: v for k, v in merged.items() if v is not None}
        self.cwd = pathlib.Path(cwd)
        self.config_path = workdir / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.router = f"127.0.0.1:{config['router']['port']}"
        self.verifier = config["verifier"]["address"]
        self.drafter = config["drafters"][0]["address"] if config.get("drafters") else None
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 180.0, sigint_ignored: bool = False) -> "Cluster":
        """sigint_ignored: start as a shell's background job would, with SIGINT ignored."""
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specfleet.cli", "serve", "--config", str(self.config_path)],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=self.cwd,
            env=self.env,
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "specfleet is ready" in line:
                return self
            if not line and self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"cluster did not start; log:\n{self.log_path.read_text()[-4000:]}")

    def channel(self, address: str | None = None, own_connection: bool = False) -> grpc.Channel:
        """A channel carrying the router's API key when it has one, else the internal token (which the router ignores).
        own_connection: a connection no other channel of this process shares (gRPC shares them by default)."""
        address = address or self.router
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)] if own_connection else CHANNEL_OPTIONS
        channel = grpc.insecure_channel(address, options=options)
        if address == self.router and self.env.get("SPECFLEET_API_KEY"):
            return grpc.intercept_channel(channel, WithToken(self.env["SPECFLEET_API_KEY"]))
        return grpc.intercept_channel(channel, WithToken(self.env.get("SPECFLEET_INTERNAL_TOKEN", INTERNAL_TOKEN)))

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if hasattr(self, "_log"):
            self._log.close()


# A cost model pinned to steps and tree rows that cost next to nothing: with adaptive speculation, every draft token
# and every helper a request may have pays (router/speculation.py, router/drafter_choice.py `cooperate`), whatever the
# machine running the tests measures; without it, whether a cluster drafts at all is that machine's to say.
DRAFTING_PAYS = {"pin_cost_model": True, "verify_per_token_ms": 0.001, "draft_per_token_ms": 0.001}


def cluster_config(family, drafter: str = "drafter-noisy", **overrides) -> dict:
    # The HTTP API and metrics endpoints are off unless a test asks for them (with a free port): their
    # defaults (8000, 9460-) are a user's, and test clusters running side by side would race for them.
    config = {
        "verifier": {"model": str(family["target"]), "address": f"127.0.0.1:{free_port()}", "metrics_port": 0},
        "drafters": [
            {
                "name": "drafters",
                "address": f"127.0.0.1:{free_port()}",
                "models": [{"name": drafter, "path": str(family[drafter])}],
                "metrics_port": 0,
            }
        ],
        # Two lanes, as on a fleet of several machines: the router would choose one on this machine's two
        # cores (router.pipeline_depth 0), and the tests cover the pipelined path.
        # remeasure_every 0 and the cost model pinned where drafting pays (`DRAFTING_PAYS`): drafting as k asks, never
        # falling back to plain decoding; whether drafting pays on the machine running the tests would otherwise decide
        # what they see (tests/router tests the plan and the fallback; the demo clusters profile their cost model).
        "router": {
            "port": free_port(),
            "default_drafter": drafter,
            "http_port": 0,
            "metrics_port": 0,
            "pipeline_depth": 2,
            "remeasure_every": 0,
            **DRAFTING_PAYS,
        },
    }
    for section, values in overrides.items():
        if section == "drafter_service":
            config["drafters"][0].update(values)
        else:
            config[section].update(values)
    return config


# The model-free n-gram drafter's name, where a test adds it to a drafter service beside draft models.
NGRAM = "ngram"


def with_ngram(config: dict, family, service: int = 0) -> dict:
    """The n-gram drafter (`kind: ngram`, the target's tokenizer) joins the config's drafter service `service`."""
    config["drafters"][service]["models"].append({"name": NGRAM, "kind": "ngram", "path": str(family["target"])})
    return config


def split_drafters(config: dict, family, first: list[str], second: list[str]) -> dict:
    """The first drafter service hosts the draft models `first`, a second one ("chains", a service of its own)
    `second`: cooperating drafters then span two services, whose chains the router merges into one tree."""
    service = config["drafters"][0]
    service["models"] = [{"name": d, "path": str(family[d])} for d in first]
    models = [{"name": d, "path": str(family[d])} for d in second]
    config["drafters"].append({**service, "name": "chains", "address": f"127.0.0.1:{free_port()}", "models": models})
    return config
