"""Router replicas share learned expertise through a real Redis server, and survive losing it."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import subprocess
import sys
import time

import pytest
import redis

from specfleet.v1 import generation_pb2_grpc
from tests.harness import REPO, Cluster, cluster_config, free_port
from tests.helpers import PROMPTS, greedy_request
from tests.e2e.test_collaboration import multi_drafter_config
from tests.e2e import test_openai_api as served

# test_openai_api.py's fixture: the random target with a chat template (the Responses API renders chats).
target_with_template = served.target_with_template

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


@contextlib.contextmanager
def another_router(config_path, port: int, log_path, *flags: str):
    """A second router process over the cluster's services (`python -m router`, the config's with `flags`), yielding
    its gRPC address once it serves; stopped on leaving."""
    import asyncio

    from specfleet.serving import wait_until_serving

    router = subprocess.Popen(
        [sys.executable, "-m", "router", "--config", str(config_path), *flags],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stderr=open(log_path, "w"),
    )
    try:
        address = f"127.0.0.1:{port}"
        asyncio.run(wait_until_serving(address, 120))
        yield address
    finally:
        router.terminate()
        router.wait(timeout=30)


def test_two_routers_share_expertise_and_survive_redis_restarts(random_family, tmp_path):
    server = RedisServer(free_port()).start()
    config = multi_drafter_config(random_family, across_services=False, redis_url=server.url, fusion_width=1, pipeline_depth=1)
    config["drafters"][0]["models"] = [m for m in config["drafters"][0]["models"] if m["name"] in ("drafter-copy", "drafter-random")]
    config["router"]["default_drafter"] = "drafter-copy"
    cluster = Cluster(config, tmp_path, "redis").start()
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
        with another_router(cluster.config_path, port2, tmp_path / "router2.log", "--port", str(port2)) as address2:
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
        cluster.stop()
        server.kill()


def test_two_routers_share_stored_responses_through_redis_and_read_their_own_while_it_is_away(random_family, target_with_template, tmp_path):
    """The Responses API behind two router replicas (router.redis_url): a conversation goes on through either, a
    response deleted through one is gone through the other; with Redis away, a router reads the responses it answered
    itself, and one it did not is a 503 that names Redis, not a 404."""
    import openai
    import yaml

    server = RedisServer(free_port()).start()
    config = cluster_config(random_family, router={"http_port": free_port(), "redis_url": server.url, "served_model_name": "m"})
    config["verifier"]["model"] = str(target_with_template)
    cluster = Cluster(config, tmp_path, "responses").start()
    other = {**config, "router": {**config["router"], "port": free_port(), "http_port": free_port()}}
    other_path = tmp_path / "router2.yaml"
    other_path.write_text(yaml.safe_dump(other))
    try:
        with another_router(other_path, other["router"]["port"], tmp_path / "router2.log"):
            one, two = (
                openai.OpenAI(base_url=f"http://127.0.0.1:{c['router']['http_port']}/v1", api_key="-", max_retries=0, timeout=120)
                for c in (config, other)
            )
            greedy = {"model": "m", "temperature": 0, "max_output_tokens": 8}
            first = one.responses.create(input=PROMPTS[0], **greedy)
            assert two.responses.retrieve(first.id).output_text == first.output_text
            through_two = two.responses.create(input=PROMPTS[1], previous_response_id=first.id, **greedy)
            through_one = one.responses.create(input=PROMPTS[1], previous_response_id=first.id, **greedy)
            assert through_two.output_text == through_one.output_text and through_two.usage.input_tokens == through_one.usage.input_tokens
            # Deleted through the second router: gone through the first too, though the first answered it.
            two.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                one.responses.retrieve(first.id)
            # Redis away: each router reads its own from memory; the other's is a 503 naming Redis; new responses still come.
            server.kill()
            assert two.responses.retrieve(through_two.id).output_text == through_two.output_text
            with pytest.raises(openai.InternalServerError) as err:
                one.responses.retrieve(through_two.id)
            assert err.value.status_code == 503 and "Redis" in err.value.body["message"] and "router.redis_url" in err.value.body["message"]
            meanwhile = one.responses.create(input=PROMPTS[2], **greedy)
            assert "stored responses are read from this router's memory" in cluster.log_path.read_text()
            # Redis back (empty): what a router kept meanwhile stays its own, and sharing resumes.
            server = RedisServer(server.port).start()
            assert one.responses.retrieve(meanwhile.id).output_text == meanwhile.output_text
            with pytest.raises(openai.NotFoundError):
                two.responses.retrieve(meanwhile.id)
            after = one.responses.create(input=PROMPTS[3], **greedy)
            assert two.responses.retrieve(after.id).output_text == after.output_text
    finally:
        cluster.stop()
        server.kill()
