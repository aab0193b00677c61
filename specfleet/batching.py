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
class Joined:
    """A waiting call taken into the pass a running batch is about to run (`BatchQueue.join_running`): its items, answered
    by `BatchQueue.answer` from the model thread once that pass is done."""

    items: list
    pending: _Pending
    started: float  # when its pass began: its wait in the queue ends here


@dataclass
class BatchStats:
    """What the batch function reports back to each caller, with its results."""

    # The model thread's time in the passes that served this caller's items: its batch's; a joined call's, the pass it
    # joined.
    compute_ms: float
    # The items whose work compute_ms less shared_ms is: the batch's (calls merged into it when it started included); a
    # joined call's own.
    batch_size: int
    # How long this caller's items waited for the model thread before their first pass: in the queue (the pass
    # before, plus max_wait_s of collecting). The caller's own, not the batch's.
    queue_ms: float = 0.0
    # Forward passes the batch ran (the batch function's `passes` of its results).
    passes: int = 1
    # Of compute_ms, what went to other calls' items in a pass shared with them (`join_running`): by the batch
    # function's weighing of the pass's work (`answer`). A round's pass is its compute whoever else it served; what
    # a call's own items cost, and the model thread's busy time, are compute_ms less this.
    shared_ms: float = 0.0


def housekeeping_every(idle_s: float) -> float:
    """How often to look for sessions idle longer than idle_s: a tenth of it, between 0.1 s and a minute."""
    return min(60.0, max(0.1, idle_s / 10)) if idle_s > 0 else 60.0


class BatchQueue:
    """Merges concurrent calls into one batch for a model thread.

    Callers `await submit(items)` from the event loop. One worker thread owns the
    model: it takes the first waiting call, then keeps collecting calls for up
    to max_wait_s or until max_batch_items items, runs `process(all_items)`
    once, and hands each caller its slice of the results. A call larger than
    max_batch_items is processed alone, never split. Between its passes, `process`
    may take waiting calls into the pass about to run (`join_running`) and answer
    each after it (`answer`): continuous batching at a pass's grain. If `process`
    raises, every caller in that batch, joined ones too, gets the exception; the
    worker keeps serving.
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
        self._joined: list[Joined] = []  # calls taken into the running batch's pass, not answered yet
        self._lent_ms = 0.0  # the answered joined calls' share of the running batch's passes
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

    def join_running(self, accept: Callable[[list], bool], room: int) -> list[Joined]:
        """On the model thread, between a batch's passes: the waiting calls, oldest first, whose items `accept` takes
        and that fit in `room` items, taken into the pass about to run, so that they need no pass of their own and the
        running batch ends after it instead of before it (`waiting`). The first call it cannot take stops it (calls are
        served in order). Each is answered with `answer`; one left unanswered when the batch ends fails."""
        taken, now = [], time.perf_counter()
        with self._cond:
            while self._queue and len(self._queue[0].items) <= room and accept(self._queue[0].items):
                pending = self._queue.pop(0)
                room -= len(pending.items)
                taken.append(Joined(pending.items, pending, now))
        self._joined.extend(taken)
        return taken

    def answer(self, joined: Joined, results: list, batch_size: int, share: float | None = None) -> None:
        """A joined call's results, after the pass it joined (`join_running`) over batch_size items in all, of whose
        work its items did `share` (default: their share of the items). The batch function knows the work: a prompt's
        prefill that joins three sessions' one-token step is most of that pass, not a quarter of it."""
        self._joined.remove(joined)
        pass_ms = (time.perf_counter() - joined.started) * 1e3
        share = len(joined.items) / max(batch_size, len(joined.items)) if share is None else min(1.0, max(0.0, share))
        # Its share of the pass is work the running batch did not do for itself (`BatchStats.shared_ms`): the callers'
        # own work sums to the model thread's busy time, and each is what its items cost.
        self._lent_ms += pass_ms * share
        stats = BatchStats(
            compute_ms=pass_ms,
            batch_size=len(joined.items),
            queue_ms=(joined.started - joined.pending.enqueued) * 1e3,
            passes=self.passes(results) if self.passes is not None else 1,
            shared_ms=pass_ms * (1 - share),
        )
        joined.pending.loop.call_soon_threadsafe(_resolve, joined.pending.future, (results, stats), None)

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
            for joined in self._joined:  # the batch failed after taking them in, or did not answer them
                why = error or RuntimeError(f"{self.name}: a call joined a batch that ended without answering it")
                joined.pending.loop.call_soon_threadsafe(_resolve, joined.pending.future, None, why)
            self._joined.clear()
            passes = self.passes(results) if error is None and self.passes is not None else 1
            # The share of its passes that served joined calls is work its own callers' items did not take.
            lent_ms, self._lent_ms = self._lent_ms, 0.0
            stats = BatchStats(compute_ms=elapsed * 1e3, batch_size=len(items), passes=passes, shared_ms=lent_ms)
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
