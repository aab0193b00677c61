"""specfleet.batching.BatchQueue reports each call's own wait in the queue, beside its batch's compute time.

No threshold on this machine's speed: the test holds the model thread on an event, and checks the
reported wait against intervals it measured itself around that hold."""

from __future__ import annotations

import asyncio
import threading
import time

from specfleet.batching import BatchQueue


def test_a_call_queued_behind_a_pass_reports_its_wait_and_the_first_call_its_own():
    started, release = threading.Event(), threading.Event()

    def process(items: list) -> list:
        if items == ["first"]:
            started.set()
            release.wait(10)
        return [item.upper() for item in items]

    queue = BatchQueue("test", process, max_batch_items=1, max_wait_s=0.0)

    async def scenario():
        first = asyncio.create_task(queue.submit(["first"]))
        await asyncio.to_thread(started.wait, 10)  # the model thread is in the first call's pass
        began = time.perf_counter()
        second = asyncio.create_task(queue.submit(["second"]))
        await asyncio.sleep(0)  # the second call is in the queue now
        queued = time.perf_counter()
        await asyncio.sleep(0.01)  # it waits behind the first pass at least this long
        release.set()
        released = time.perf_counter()
        (got1, stats1), (got2, stats2) = await first, await second
        return got1, stats1, got2, stats2, (released - queued) * 1e3, (time.perf_counter() - began) * 1e3

    try:
        got1, stats1, got2, stats2, held_ms, second_wall_ms = asyncio.run(scenario())
    finally:
        queue.close()
    assert (got1, got2) == (["FIRST"], ["SECOND"])
    # The second call waited for the whole rest of the first pass; the first found the model thread free.
    assert stats2.queue_ms >= held_ms > 0
    assert stats1.queue_ms >= 0 and stats1.compute_ms >= held_ms
    # Its wait and its own pass lie within its wall time as its caller saw it.
    assert stats2.queue_ms + stats2.compute_ms <= second_wall_ms
    assert (stats1.batch_size, stats2.batch_size) == (1, 1)


def test_housekeeping_runs_on_the_model_thread_while_idle_and_between_batches_and_a_failure_keeps_serving():
    """A service's housekeeping (forgetting the sessions of clients that went away) runs on the thread that owns the
    model and its sessions, so it never races a batch: while no call comes, and between batches under load."""
    threads, calls = [], []

    def housekeeping() -> None:
        threads.append(threading.current_thread().name)
        if len(threads) == 2:
            raise RuntimeError("a failing housekeeping pass")

    def process(items: list) -> list:
        calls.append(threading.current_thread().name)
        return items

    queue = BatchQueue("hk", process, max_batch_items=4, max_wait_s=0.0, housekeeping=housekeeping, housekeeping_every_s=0.02)
    try:
        deadline = time.monotonic() + 10
        while len(threads) < 3 and time.monotonic() < deadline:  # idle: no call at all
            time.sleep(0.01)
        assert len(threads) >= 3
        idle = len(threads)

        async def load():
            for i in range(40):
                assert await queue.submit([i]) is not None
                await asyncio.sleep(0.005)

        asyncio.run(load())  # served after the failing pass, with housekeeping between its batches
        assert len(threads) > idle and len(calls) == 40
        assert set(threads) == set(calls) == {"hk-batcher"}
    finally:
        queue.close()
