"""Whatever is written into the shared expertise hash, a router keeps routing (a real Redis server)."""

from __future__ import annotations

import math
import shutil
import threading

import pytest
import redis

from router.routing import RedisExpertiseStore
from tests.harness import free_port
from tests.e2e.test_redis import RedisServer
from tests.router.test_routing import make_router

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed (scripts/ensure-redis)")

POISON = [b"nan,nan", b"inf,1", b"-5,2", b"3", b"a,b", b"1,2,3", b""]


@pytest.fixture
def redis_url():
    server = RedisServer(free_port()).start()
    yield server.url
    server.kill()


def test_bad_values_in_redis_are_ignored_and_routing_keeps_answering(redis_url):
    client = redis.Redis.from_url(redis_url)
    for i, value in enumerate(POISON):
        client.hset("specfleet:expertise", f"code\x1fd{i}", value)
    client.hset("specfleet:expertise", "code\x1fgood", b"4.0,1.0")
    client.hset("specfleet:expertise", b"\xff\xfe-not-utf8", b"1,1")
    store = RedisExpertiseStore(redis_url, decay=0.98)
    store.sync()
    snapshot = store.snapshot()
    assert set(snapshot) == {("code", "good")}
    assert (snapshot[("code", "good")].accepted, snapshot[("code", "good")].rejected) == (4.0, 1.0)

    # Updates to a poisoned field start it afresh instead of failing the script (and every later push).
    store.add("code", "d0", 2.0, 1.0)
    store.add("code", "good", 1.0, 0.0)
    store.sync()
    assert store.backend == "redis"
    fresh = client.hget("specfleet:expertise", "code\x1fd0").decode().split(",")
    assert [float(x) for x in fresh] == [2.0, 1.0]
    assert store.snapshot()[("code", "good")].accepted == pytest.approx(4.0 * 0.98 + 1.0)

    # The Thompson sample over what was read must return (it looped forever on NaN parameters).
    router = make_router()
    router.store = store
    client.hset("specfleet:expertise", "code\x1fcode", b"nan,nan")
    store.sync()
    routing = router.start("def f(x):\n    return x\n", "code")
    chosen: list = []
    worker = threading.Thread(target=lambda: chosen.extend(router.choose(routing) for _ in range(100)), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "choosing drafters hung on a bad value read from redis"
    assert len(chosen) == 100
    a, r = router.posterior(routing, "code")
    assert math.isfinite(a) and math.isfinite(r)
