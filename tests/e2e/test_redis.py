"""Router replicas share learned expertise through a real Redis server, and survive losing it."""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
import time

import pytest
import redis

from specfleet.v1 import generation_pb2_grpc
from tests.harness import REPO, Cluster, free_port
from tests.helpers import PROMPTS, greedy_request
from tests.e2e.test_collaboration import multi_drafter_config

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed (scripts/ensure-redis)")


class RedisServer:
    def __init__(self, port: int):
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self.proc = None

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def counts(url: str) -> dict[str, tuple[float, float]]:
    raw = redis.Redis.from_url(url).hgetall("specfleet:expertise")
    return {k.decode().split("\x1f")[1]: tuple(float(x) for x in v.decode().split(",")) for k, v in raw.items()}


def generate(address: str, n: int, prompt_offset: int = 0):
    import grpc

    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        futures = [stub.Generate.future(greedy_request(PROMPTS[(i + prompt_offset) % len(PROMPTS)], 32, 4), timeout=300) for i in range(n)]
        return [f.result() for f in futures]


def test_two_routers_share_expertise_and_survive_redis_restarts(random_family, tmp_path):
    server = RedisServer(free_port()).start()
    config = multi_drafter_config(random_family, across_services=False, redis_url=server.url, fusion_width=1, pipeline_depth=1)
    config["drafters"][0]["models"] = [m for m in config["drafters"][0]["models"] if m["name"] in ("drafter-copy", "drafter-random")]
    config["router"]["default_drafter"] = "drafter-copy"
    cluster = Cluster(config, tmp_path, "redis").start()
    second = None
    try:
        # Router 1 learns: the copy of the target is accepted, the random drafter is not.
        for _ in range(3):
            generate(cluster.router, 16)
        time.sleep(1.0)
        learned = counts(server.url)
        # The random drafter may never have been tried (routing learns the copy first): then it has no entry.
        assert learned["drafter-copy"][0] > 10 * max(1.0, learned.get("drafter-random", (0.0, 0.0))[0])

        # Router 2, a separate process with no history of its own, routes by what router 1 learned.
        port2 = free_port()
        second = subprocess.Popen(
            [sys.executable, "-m", "router", "--config", str(cluster.config_path), "--port", str(port2)],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stderr=open(tmp_path / "router2.log", "w"),
        )
        address2 = f"127.0.0.1:{port2}"
        import asyncio

        from specfleet.serving import wait_until_serving

        asyncio.run(wait_until_serving(address2, 120))
        time.sleep(1.0)  # its first sync with Redis
        replies = generate(address2, 8, prompt_offset=5)
        rounds = collections.Counter()
        for reply in replies:
            for d in reply.speculation.drafters:
                rounds[d.drafter] += d.rounds
        assert rounds["drafter-copy"] >= 0.9 * sum(rounds.values()), rounds

        # Redis dies mid-run: requests keep succeeding on local state.
        before = counts(server.url)["drafter-copy"][0]
        server.kill()
        replies = generate(cluster.router, 8)
        assert all(r.finish_reason for r in replies)
        # The router notices at its next sync (every 0.25 s); the requests may all finish before that.
        deadline = time.monotonic() + 5
        while "unavailable" not in cluster.log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "unavailable" in cluster.log_path.read_text()

        # Redis returns (empty): what was learned meanwhile is pushed, sharing resumes.
        server = RedisServer(server.port).start()
        generate(cluster.router, 4)
        time.sleep(1.5)
        after = counts(server.url)
        assert "drafter-copy" in after and after["drafter-copy"][0] > 0
        assert "is back" in cluster.log_path.read_text()
        assert before > 0
    finally:
        if second is not None:
            second.terminate()
            second.wait(timeout=30)
        cluster.stop()
        server.kill()
