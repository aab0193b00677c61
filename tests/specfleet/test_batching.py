"""specfleet.batching.BatchQueue reports each call's own wait in the queue, beside its batch's compute time.

No threshold on this machine's speed: the test holds the model thread on an event, and checks the
reported wait against intervals it measured itself around that hold."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

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


JOINT_PASS_S = 0.2
# The joined pair's share of the pass's work, as the batch function weighs it (a prefill's rows beside a step's): more
# than its share of the items (two of three).
JOINED_SHARE = 0.9


def test_waiting_calls_join_a_running_batch_in_order_and_one_it_leaves_unanswered_fails():
    """`BatchQueue.join_running`, between a batch's passes on the model thread: the waiting calls its predicate accepts, oldest
    first, up to the room given, stopping at the first it refuses; each is answered with `answer` (its own results,
    its wait until it joined, the pass as its compute, and the others' share of the pass's work as shared) without a
    batch of its own, and its share of that pass's work is shared in the running batch's compute. A call that joins a batch which then
    ends without answering it fails with a message, and the queue serves on."""
    started, go, joined = threading.Event(), threading.Event(), []
    batches, first_ms = [], []

    def process(items: list) -> list:
        batches.append(list(items))
        if items == ["first"]:
            began = time.perf_counter()
            started.set()
            go.wait(10)
            taken = queue.join_running(lambda call: call[0].startswith("join"), 3)
            joined.extend(call.items for call in taken)
            time.sleep(JOINT_PASS_S)  # the pass they joined
            for call in taken:
                if call.items != ["join-unanswered"]:
                    queue.answer(call, [item.upper() for item in call.items], batch_size=1 + len(call.items), share=JOINED_SHARE)
            first_ms.append((time.perf_counter() - began) * 1e3)
        return [item.upper() for item in items]

    queue = BatchQueue("test", process, max_batch_items=8, max_wait_s=0.0)

    async def scenario():
        first = asyncio.create_task(queue.submit(["first"]))
        await asyncio.to_thread(started.wait, 10)
        calls = [asyncio.create_task(queue.submit(items)) for items in (["join-a", "join-b"], ["join-unanswered"], ["other"], ["join-late"])]
        await asyncio.sleep(0.01)
        go.set()
        results = await asyncio.wait_for(asyncio.gather(first, *calls, return_exceptions=True), 30)  # none is left waiting
        after = await queue.submit(["after"])
        return results, after

    try:
        (first, pair, unanswered, other, late), after = asyncio.run(scenario())
    finally:
        queue.close()
    assert first[0] == ["FIRST"] and pair[0] == ["JOIN-A", "JOIN-B"] and pair[1].batch_size == 2
    # The pass served both calls: it is each one's compute, and its work is shared by the batch function's weighing
    # (the pair's 0.9 of it is not the first batch's work; the first batch's tenth is not the pair's). Neither waited
    # for the pass: the pair waited only to join it.
    joint_ms = JOINT_PASS_S * 1e3
    assert joint_ms <= pair[1].compute_ms <= first[1].compute_ms and first[1].compute_ms >= first_ms[0]
    assert pair[1].shared_ms == pytest.approx(pair[1].compute_ms * (1 - JOINED_SHARE))
    assert first[1].shared_ms == pytest.approx(pair[1].compute_ms * JOINED_SHARE)
    assert first[1].queue_ms < joint_ms / 2, "the first call waited for no pass"
    assert 10 <= pair[1].queue_ms < joint_ms / 2 + 10 and pair[1].passes == 1
    assert isinstance(unanswered, RuntimeError) and "joined a batch that ended without answering it" in str(unanswered)
    # "other" is refused, so the call behind it waits too; both run in batches of their own, in order.
    assert joined == [["join-a", "join-b"], ["join-unanswered"]]
    assert other[0] == ["OTHER"] and late[0] == ["JOIN-LATE"] and after[0] == ["AFTER"]
    assert batches[0] == ["first"] and ["join-a", "join-b"] not in batches
