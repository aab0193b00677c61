"""Helpers for the operational tests: the processes of a running cluster, what its servers hold, its metrics.

Pausing a service with SIGSTOP holds a request at a known point (a stopped
verifier cannot finish a round), so that a test never depends on how fast the
machine generates.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import re
import time
import urllib.request

from specfleet.v1 import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc

# The router runs as `router`, or as `specfleet.colocated` with the verifier and drafter services in its process
# (verifier.colocate, drafters[].colocate, the defaults): a test that pauses or kills one of them alone sets its colocate false.
SERVICE_MODULES = {"verifier": ("verifier_service",), "drafter": ("drafter_service",), "router": ("router", "specfleet.colocated")}


def children(pid: int) -> list[int]:
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # the field after the state is the parent's pid
            found.append(int(stat.parent.name))
    return found


def service_pid(cluster, service: str, also: str = "") -> int:
    """The pid of one service `specfleet serve` started: verifier, drafter or router (whose command
    line also holds `also`, e.g. "--name beta" for one of several drafter services)."""
    wanted = [f"-m {module} " for module in SERVICE_MODULES[service]]
    for pid in children(cluster.proc.pid):
        try:
            command = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if any(w in command for w in wanted) and also in command:
            return pid
    raise LookupError(f"no {service} process under specfleet serve (pid {cluster.proc.pid})")


def host_pid(cluster, service: str) -> int:
    """The pid of the process `service` runs in: the router's for a verifier or drafter service in the router's process."""
    try:
        return service_pid(cluster, service)
    except LookupError:
        if service == "router":
            raise
        return service_pid(cluster, "router")


@contextlib.contextmanager
def paused(pid: int):
    """SIGSTOP a process for the block; it always gets SIGCONT."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed meanwhile: the test's own assertion says why
            os.kill(pid, signal.SIGCONT)


def held_sessions(cluster) -> dict[str, set[str]]:
    """The session ids the verifier and the (first) drafter service hold now."""
    info = common_pb2.InfoRequest()
    with cluster.channel(cluster.verifier) as vch, cluster.channel(cluster.drafter) as dch:
        verifier = set(verifier_pb2_grpc.VerifierStub(vch).GetStats(info, timeout=30).session_ids)
        drafter = set(drafter_pb2_grpc.DrafterStub(dch).GetStats(info, timeout=30).session_ids)
    return {"verifier": verifier, "drafter": drafter}


def wait_released(cluster, session_id: str, timeout_s: float = 30.0) -> dict[str, set[str]]:
    """Poll until neither server holds session_id (the router releases in the background); returns the last view."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = held_sessions(cluster)
        if not any(session_id in ids for ids in held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def without_model_name(text: str) -> str:
    """Prometheus text with the router's `model_name` label (on every series, tests/e2e/test_prometheus.py) left out,
    so that tests name a sample by its own labels."""

    def labels(match: re.Match) -> str:
        kept = [f'{name}="{value}"' for name, value in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(1)) if name != "model_name"]
        return "{" + ",".join(kept) + "}" if kept else ""

    return "\n".join(line if line.startswith("#") else re.sub(r"\{([^}]*)\}", labels, line) for line in text.split("\n"))


def metrics(port: int) -> dict[str, float]:
    """The router's Prometheus text as {sample name with labels (but model_name): value}."""
    text = without_model_name(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode())
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def wait_for_metric(port: int, name: str, value: float, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (seen := metrics(port).get(name)) != value:
        assert time.monotonic() < deadline, f"{name} stayed {seen}, expected {value}"
        time.sleep(0.1)


def session_of(cluster, request_id: str) -> str:
    """The session id the router made for a request (request_id is only a label): from its start-up log line."""
    import re

    found = re.search(rf"request {re.escape(request_id)} \(session (\w+),", cluster.log_path.read_text())
    if not found:
        raise LookupError(f"the router's log does not mention request {request_id}")
    return found.group(1)
