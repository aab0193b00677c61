"""Whatever is written into the shared expertise hash, a router keeps routing (a real Redis server)."""

from __future__ import annotations

import math
import shutil
import threading

import pytest
import redis

from router.expertise import EXPERTISE_TTL_S, RedisExpertiseStore
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
    pairs = [("code", "good"), *((("code", f"d{i}") for i in range(len(POISON))))]
    store.sync(pairs)
    snapshot = store.snapshot()
    assert set(snapshot) == {("code", "good")}
    assert (snapshot[("code", "good")].accepted, snapshot[("code", "good")].rejected) == (4.0, 1.0)

    # Updates to a poisoned field start it afresh instead of failing the script (and every later push).
    store.add("code", "d0", 2.0, 1.0)
    store.add("code", "good", 1.0, 0.0)
    store.sync(pairs)
    assert store.backend == "redis"
    fresh = client.hget("specfleet:expertise", "code\x1fd0").decode().split(",")
    assert [float(x) for x in fresh] == [2.0, 1.0]
    assert store.snapshot()[("code", "good")].accepted == pytest.approx(4.0 * 0.98 + 1.0)
    # What is computed from the evidence (router/routing.py `posteriors_anywhere`) is kept while a sync reads nothing
    # new, and recomputed once another router's update arrives.
    version = store.version
    store.sync(pairs)
    assert store.version == version
    client.hset("specfleet:expertise", "code\x1fgood", b"9.0,1.0")
    store.sync(pairs)
    assert store.version > version and store.snapshot()[("code", "good")].accepted == 9.0

    # The Thompson sample over what was read must return (it looped forever on NaN parameters).
    router = make_router()
    router.store = store
    client.hset("specfleet:expertise", "code\x1fcode", b"nan,nan")
    store.sync(router.pairs())
    routing = router.start("def f(x):\n    return x\n", "code")
    chosen: list = []
    worker = threading.Thread(target=lambda: chosen.extend(router.choose(routing) for _ in range(100)), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "choosing drafters hung on a bad value read from redis"
    assert len(chosen) == 100
    a, r = router.posterior(routing, "code")
    assert math.isfinite(a) and math.isfinite(r)


def test_junk_in_the_shared_hash_costs_the_router_nothing_and_the_hash_expires(redis_url):
    """200,000 fields of domains no drafter declares and no request named: the router reads only the pairs it routes
    by, so its state stays what it learned; the hash expires a week after the last update, so it is not kept for ever."""
    client = redis.Redis.from_url(redis_url)
    with client.pipeline(transaction=False) as pipe:
        for start in range(0, 200_000, 10_000):
            pipe.hset("specfleet:expertise", mapping={f"probe-{i}\x1fcode": "1.0,1.0" for i in range(start, start + 10_000)})
        pipe.execute()
    router = make_router()
    router.store = store = RedisExpertiseStore(redis_url, decay=0.98)
    store.add("code", "code", 3.0, 1.0)
    store.sync(router.pairs())
    assert set(store.snapshot()) == {("code", "code")}
    assert len(router.pairs()) == (len(router.domains) + 1) * len(router.drafters)
    assert 0 < client.ttl("specfleet:expertise") <= EXPERTISE_TTL_S
