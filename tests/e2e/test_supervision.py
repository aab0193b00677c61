"""A crashed process costs no request: `specfleet serve` restarts it, and the router carries its requests
through (without drafts while a drafter is away; waiting for, or moving off, a verifier, which then
rebuilds their KV from the token ids the router holds). Real processes, real kill -9."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from specfleet.v1 import generation_pb2_grpc
from tests.harness import Cluster, cluster_config, free_port
from tests.helpers import PROMPTS, greedy_request, target_greedy
from tests.operations import metrics, paused, service_pid


class Streams:
    """Greedy streams held mid-generation: each client reads its first chunk, then waits at a barrier
    until all have one, so that every request is in flight (with hundreds of tokens to go) when the
    test breaks something."""

    def __init__(self, addresses: list[str], prompts: list[str], max_tokens: int):
        self.jobs = [(addresses[i % len(addresses)], prompt) for i, prompt in enumerate(prompts)]
        self.max_tokens = max_tokens
        self.tokens = [[] for _ in self.jobs]
        self.errors: list[str] = []
        self.started = threading.Barrier(len(self.jobs) + 1)
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(len(self.jobs))]

    def _client(self, i: int) -> None:
        import grpc

        address, prompt = self.jobs[i]
        request = greedy_request(prompt, self.max_tokens, 4, stop_at_eos=False)
        try:
            with grpc.insecure_channel(address) as channel:
                for n, chunk in enumerate(generation_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=600)):
                    self.tokens[i] += chunk.token_ids
                    if n == 0:
                        self.started.wait(timeout=300)
        except Exception as err:  # the test reports every failed stream
            self.errors.append(f"{prompt!r} via {address}: {err}")
            self.started.abort()

    def start(self) -> None:
        for t in self.threads:
            t.start()
        self.started.wait(timeout=300)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=600)

    def check(self, target: str) -> None:
        assert not self.errors, self.errors
        for (_, prompt), tokens in zip(self.jobs, self.tokens):
            assert tokens == target_greedy(target, prompt, self.max_tokens), prompt


def wait_restarted(cluster: Cluster, service: str, old_pid: int, also: str = "", timeout_s: float = 120) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = service_pid(cluster, service, also=also)
        except LookupError:
            pid = None
        if pid is not None and pid != old_pid:
            return pid
        time.sleep(0.2)
    raise AssertionError(f"{service} {also} was not restarted within {timeout_s:.0f}s; serve's log:\n{cluster.log_path.read_text()[-3000:]}")


def test_killed_drafter_and_verifier_lose_no_request(random_family, tmp_path):
    """kill -9 the drafter service, then the verifier, under `specfleet serve` with 16 streams in flight:
    serve restarts both, every stream finishes with the target's own greedy output, and the restarted
    drafter drafts again. (The verifier is stopped first, so the requests are surely mid-generation.)"""
    target = str(random_family["target"])
    cluster = Cluster(cluster_config(random_family, verifier={"colocate": False}), tmp_path, "supervised").start()  # kills the verifier alone
    try:
        streams = Streams([cluster.router], [PROMPTS[i % len(PROMPTS)] for i in range(16)], max_tokens=300)
        streams.start()
        verifier = service_pid(cluster, "verifier")
        drafter = service_pid(cluster, "drafter")
        with paused(verifier):
            os.kill(drafter, signal.SIGKILL)
            wait_restarted(cluster, "drafter", drafter)
            os.kill(verifier, signal.SIGKILL)
        wait_restarted(cluster, "verifier", verifier)
        streams.join()
        streams.check(target)
        log = cluster.log_path.read_text()
        assert "restarting verifier" in log and "restarting drafter drafters" in log
        # The restarted drafter drafts again once the router's breaker probes it (at most 8 s apart).
        deadline = time.monotonic() + 30
        import grpc

        with grpc.insecure_channel(cluster.router) as channel:
            while True:
                reply = generation_pb2_grpc.GenerationStub(channel).Generate(greedy_request(PROMPTS[0], 16, 4), timeout=120)
                assert list(reply.token_ids) == target_greedy(target, PROMPTS[0], 16)
                if reply.speculation.draft_tokens > 0:
                    break
                assert time.monotonic() < deadline, "the restarted drafter service is not drafting"
                time.sleep(0.5)
    finally:
        cluster.stop()


def test_serve_gives_up_on_a_service_that_keeps_crashing(random_family, tmp_path):
    """--max-restarts bounds the restarts: a drafter killed more often than that within ten minutes is
    reported, and serve stops everything with exit code 1 instead of restarting it forever."""
    import yaml

    config_path = tmp_path / "c.yaml"
    config = cluster_config(random_family, drafter_service={"colocate": False})  # a process of its own, to kill
    config_path.write_text(yaml.safe_dump(config))
    cluster = Cluster(config, tmp_path, "crashing")
    cluster.config_path = config_path
    cluster.router = f"127.0.0.1:{yaml.safe_load(config_path.read_text())['router']['port']}"
    log = open(tmp_path / "crashing.log", "w")
    cluster.proc = subprocess.Popen(
        [sys.executable, "-m", "specfleet.cli", "serve", "--config", str(config_path), "--max-restarts", "1"],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        while "specfleet is ready" not in cluster.proc.stdout.readline():
            assert cluster.proc.poll() is None, (tmp_path / "crashing.log").read_text()
        first = service_pid(cluster, "drafter")
        os.kill(first, signal.SIGKILL)
        second = wait_restarted(cluster, "drafter", first)
        os.kill(second, signal.SIGKILL)
        assert cluster.proc.wait(timeout=120) == 1
    finally:
        if cluster.proc.poll() is None:
            cluster.proc.kill()
        log.close()
    text = (tmp_path / "crashing.log").read_text()
    assert "drafter drafters killed by SIGKILL: 2 crashes within 10 min, more than --max-restarts 1; not restarting it" in text, text[-2000:]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed (scripts/ensure-redis)")
def test_two_routers_two_verifiers_two_drafters_survive_kills(random_family, tmp_path):
    """Two verifier replicas, two drafter services (one of them in two replicas), two routers sharing
    one Redis; 32 greedy streams through both routers. kill -9 one verifier replica, the drafter
    service alpha and one replica of beta mid-run: no request fails, every output is the target's,
    the dead verifier replica's requests moved to the live one. Then the verifier replica serve
    restarted takes traffic again."""
    from tests.e2e.test_redis import RedisServer

    target = str(random_family["target"])
    redis_server = RedisServer(free_port()).start()
    config = cluster_config(random_family, router={"redis_url": redis_server.url, "routing_policy": "random", "metrics_port": free_port()})
    replica = f"127.0.0.1:{free_port()}"
    config["verifier"]["replicas"] = [replica]
    config["drafters"] = [
        {
            "name": "alpha",
            "address": f"127.0.0.1:{free_port()}",
            "models": [{"name": "drafter-noisy", "path": str(random_family["drafter-noisy"])}],
            "metrics_port": 0,
        },
        {
            "name": "beta",
            "address": f"127.0.0.1:{free_port()}",
            "replicas": [f"127.0.0.1:{free_port()}"],
            "models": [{"name": "drafter-copy", "path": str(random_family["drafter-copy"])}],
            "metrics_port": 0,
        },
    ]
    cluster = Cluster(config, tmp_path, "replicas").start()
    import yaml

    second_port = free_port()
    second_config = tmp_path / "router-2.yaml"
    second_config.write_text(yaml.safe_dump({**config, "router": {**config["router"], "port": second_port, "metrics_port": 0}}))
    second_log = open(tmp_path / "router-2.log", "w")
    second = subprocess.Popen([sys.executable, "-m", "router", "--config", str(second_config)], stderr=second_log)
    try:
        from specfleet.serving import wait_until_serving
        import asyncio

        asyncio.run(wait_until_serving(f"127.0.0.1:{second_port}", 180))
        routers = [cluster.router, f"127.0.0.1:{second_port}"]
        streams = Streams(routers, [PROMPTS[i % len(PROMPTS)] for i in range(32)], max_tokens=200)
        streams.start()
        first_replica = service_pid(cluster, "verifier", also="--replica 0")
        doomed = service_pid(cluster, "verifier", also="--replica 1")
        alpha = service_pid(cluster, "drafter", also="--name alpha")
        beta = service_pid(cluster, "drafter", also="--name beta --host 127.0.0.1 --replica 1")
        port = config["router"]["metrics_port"]
        with paused(first_replica):
            # Both replicas hold requests of this router (new requests go to the less loaded one).
            assert metrics(port).get(f'specfleet:verifier_replica_sessions_total{{replica="{replica}"}}', 0) > 0
            os.kill(doomed, signal.SIGKILL)
            os.kill(alpha, signal.SIGKILL)
            os.kill(beta, signal.SIGKILL)
        streams.join()
        streams.check(target)
        assert metrics(port)["specfleet:verifier_replica_moves_total"] > 0
        wait_restarted(cluster, "verifier", doomed, also="--replica 1")
        # The restarted replica is probed back into use and takes new requests.
        deadline = time.monotonic() + 60
        while metrics(port)[f'specfleet:verifier_replica_up{{replica="{replica}"}}'] != 1.0:
            assert time.monotonic() < deadline, "the restarted verifier replica was not taken back"
            time.sleep(0.2)
        before = metrics(port)[f'specfleet:verifier_replica_sessions_total{{replica="{replica}"}}']
        again = Streams([cluster.router], [PROMPTS[i] for i in range(8)], max_tokens=32)
        again.start()
        again.join()
        again.check(target)
        assert metrics(port)[f'specfleet:verifier_replica_sessions_total{{replica="{replica}"}}'] > before
    finally:
        second.send_signal(signal.SIGTERM)
        try:
            second.wait(timeout=60)
        except subprocess.TimeoutExpired:
            second.kill()
        second_log.close()
        cluster.stop()
        redis_server.kill()


def test_router_health_follows_the_verifier(random_family, tmp_path):
    """While its only verifier does not answer (stopped), the router reports NOT_SERVING on
    grpc.health.v1, so a load balancer sends clients elsewhere; SERVING again once it answers."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    cluster = Cluster(cluster_config(random_family, verifier={"colocate": False}), tmp_path, "health").start()  # pauses the verifier alone

    def status_within(want: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(cluster.router) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == want:
                    return True
                time.sleep(0.2)
        return False

    try:
        assert status_within(health_pb2.HealthCheckResponse.SERVING, 5)
        with paused(service_pid(cluster, "verifier")):
            assert status_within(health_pb2.HealthCheckResponse.NOT_SERVING, 30), "router still SERVING with its verifier stopped"
        assert status_within(health_pb2.HealthCheckResponse.SERVING, 30), "router did not return to SERVING"
    finally:
        cluster.stop()
