"""Dynamic batching: concurrent calls of a service merged into one batch for its model thread."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

log = logging.getLogger(__name__)


@dataclass
class _Pending:
    items: list
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.perf_counter)


@dataclass
class BatchStats:
    """What the batch function reports back to each caller, with its results."""

    compute_ms: float
    batch_size: int
    # How long this caller's items waited in the queue before its batch's pass started (the wait for the
    # model thread to finish the pass before, plus max_wait_s of collecting): the caller's own, not the batch's.
    queue_ms: float = 0.0
    # Forward passes the batch ran (the batch function's `passes` of its results).
    passes: int = 1


def housekeeping_every(idle_s: float) -> float:
    """How often to look for sessions idle longer than idle_s: a tenth of it, between 0.1 s and a minute."""
    return min(60.0, max(0.1, idle_s / 10)) if idle_s > 0 else 60.0


class BatchQueue:
    """Merges concurrent calls into one batch for a model thread.

    Callers `await submit(items)` from the event loop. One worker thread owns the
    model: it takes the first waiting call, then keeps collecting calls for up
    to max_wait_s or until max_batch_items items, runs `process(all_items)`
    once, and hands each caller its slice of the results. A call larger than
    max_batch_items is processed alone, never split. If `process` raises, every
    caller in that batch gets the exception; the worker keeps serving.
    """

    def __init__(
        self,
        name: str,
        process: Callable[[list], list],
        max_batch_items: int,
        max_wait_s: float,
        housekeeping: Callable[[], None] | None = None,
        housekeeping_every_s: float = 10.0,
        passes: Callable[[list], int] | None = None,
    ):
        self.name = name
        self.process = process
        self.max_batch_items = max_batch_items
        self.max_wait_s = max_wait_s
        # Run on the worker thread (which owns the model and its sessions) at most every housekeeping_every_s,
        # between batches or while idle: expiring the sessions of clients that went away.
        self.housekeeping = housekeeping
        self.housekeeping_every_s = housekeeping_every_s
        self._next_housekeeping = time.monotonic() + housekeeping_every_s
        self.passes = passes  # how many forward passes a batch's results took (None: one)
        self._queue: list[_Pending] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"{name}-batcher", daemon=True)
        self._thread.start()

    async def submit(self, items: list) -> tuple[list, BatchStats]:
        loop = asyncio.get_running_loop()
        pending = _Pending(items=items, future=loop.create_future(), loop=loop)
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self.name} is shutting down")
            self._queue.append(pending)
            self._cond.notify()
        return await pending.future

    def waiting(self) -> bool:
        """Whether a call waits for the model thread: a batch function that runs several passes (plain steps) asks
        between them, and ends early so that the waiting call joins the next batch."""
        return bool(self._queue)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def join(self, timeout_s: float) -> None:
        """After `close`: wait for the model thread to finish what it holds."""
        self._thread.join(timeout_s)

    def _take_batch(self) -> list[_Pending] | None:
        """The next batch; [] when housekeeping is due while no call waits; None once closed."""
        with self._cond:
            while not self._queue and not self._closed:
                if self.housekeeping is None:
                    self._cond.wait()
                elif not self._cond.wait(max(0.0, self._next_housekeeping - time.monotonic())):
                    return []
            if not self._queue:
                return None
            deadline = self._queue[0].enqueued + self.max_wait_s
            while sum(len(p.items) for p in self._queue) < self.max_batch_items and not self._closed:
                remaining = deadline - time.perf_counter()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            batch, count = [], 0
            while self._queue and (not batch or count + len(self._queue[0].items) <= self.max_batch_items):
                pending = self._queue.pop(0)
                batch.append(pending)
                count += len(pending.items)
            return batch

    def _housekeep(self) -> None:
        if self.housekeeping is None or time.monotonic() < self._next_housekeeping:
            return
        try:
            self.housekeeping()
        except Exception:  # housekeeping never stops the serving
            log.exception("%s: housekeeping failed", self.name)
        self._next_housekeeping = time.monotonic() + self.housekeeping_every_s

    def _run(self) -> None:
        while (batch := self._take_batch()) is not None:
            self._housekeep()
            if not batch:
                continue
            items = [item for pending in batch for item in pending.items]
            started = time.perf_counter()
            try:
                results = self.process(items)
                error = None
            except Exception as exc:  # delivered to every caller of this batch
                log.exception("%s: batch of %d items failed", self.name, len(items))
                results, error = None, exc
            elapsed = time.perf_counter() - started
            passes = self.passes(results) if error is None and self.passes is not None else 1
            stats = BatchStats(compute_ms=elapsed * 1e3, batch_size=len(items), passes=passes)
            offset = 0
            for pending in batch:
                n = len(pending.items)
                if error is None:
                    value = (results[offset : offset + n], replace(stats, queue_ms=(started - pending.enqueued) * 1e3))
                    pending.loop.call_soon_threadsafe(_resolve, pending.future, value, None)
                else:
                    pending.loop.call_soon_threadsafe(_resolve, pending.future, None, error)
                offset += n


def _resolve(future: asyncio.Future, value, error) -> None:
    if future.done():  # the caller went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
