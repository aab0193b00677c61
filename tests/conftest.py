"""Fixtures that start real specfleet services: real processes, real gRPC over loopback, real models."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
import yaml

from specfleet.random_models import ensure_random_family
from specfleet.serving import CHANNEL_OPTIONS

REPO = pathlib.Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def random_family(tmp_path_factory) -> dict[str, pathlib.Path]:
    return ensure_random_family(tmp_path_factory.mktemp("random-models"))


class Cluster:
    """`specfleet serve` with a given config, as a user would run it.

    cwd: the tree whose code runs (its packages shadow the installed ones), e.g. a mutated
    copy from tests/mutation.py; the repository by default."""

    def __init__(self, config: dict, workdir: pathlib.Path, name: str, cwd: pathlib.Path = REPO):
        self.config = config
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
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
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

    def channel(self, address: str | None = None) -> grpc.Channel:
        return grpc.insecure_channel(address or self.router, options=CHANNEL_OPTIONS)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if hasattr(self, "_log"):
            self._log.close()


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
        "router": {"port": free_port(), "default_drafter": drafter, "http_port": 0, "metrics_port": 0},
    }
    for section, values in overrides.items():
        if section == "drafter_service":
            config["drafters"][0].update(values)
        else:
            config[section].update(values)
    return config


@pytest.fixture(scope="session")
def cluster(random_family, tmp_path_factory):
    """The default cluster: random target, a drafter that agrees with it part of the time."""
    c = Cluster(cluster_config(random_family), tmp_path_factory.mktemp("cluster"), "default").start()
    yield c
    c.stop()
