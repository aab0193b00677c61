"""The router's scheduler: admission and lanes; every running request advances by draft-then-verify rounds.

The running requests are split into `pipeline_depth` groups (lanes), each a
loop of rounds, so that while the verifier checks one group the drafters
draft the next: drafters and verifier run on different machines and neither
should wait. New requests join the least loaded lane between its rounds,
clients taking turns (a client is a connection), each client's earliest deadline first,
up to `max_running`; past `max_queued` waiting ones
a new request is refused (Overloaded). A request that arrives while every lane is
in a round does not wait for one to end: its first round (its prompt's prefill and
first token) starts at once beside them (`_admission`), and the verifier ends the
plain steps of a call already under way after its current pass, so that a round of
many plain steps costs a new request one pass of waiting, not the round; it joins the
least loaded lane after that round.

A round of one group (`_round`; the stages share one `rounds.RoundContext`):
1. Plan (router/planning.py): who drafts for each request and how many
   tokens, returned as a `rounds.RoundPlan` that the next stages take.
2. Draft (router/drafting.py): a token tree per drafting request, whose every
   node carries the distribution it was drawn from.
3. Verify and 4. commit and learn (router/verifying.py): one call per
   verifier replica carries every request's tree; the accepted tokens plus
   the target's next token are committed, and the routing and cost models
   learn from what each drafter proposed.
5. Publish: each request's new text goes to its client (`_publish`); a
   finished request's sessions are released everywhere in the background.

A drafter that fails costs only that round's drafts; a verifier replica that
fails hands its requests to a live one, which rebuilds their KV from the token
ids. Past its deadline a request ends with DEADLINE_EXCEEDED, and its sessions
are released; what was streamed stays delivered.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

import grpc

from router.drafters import DrafterService
from router.drafting import Drafting
from router.planning import Planning
from router.request import RequestState
from router.rounds import RecentLoad, RoundContext, RoundMeasures, RoundPlan, SchedulerConfig, concurrently
from router.routing import DrafterRouter
from router.speculation import SpeculationController
from router.verifiers import VerifierPool
from router.verifying import Verifying

log = logging.getLogger(__name__)

# A failed release (a server stalled, restarting or unreachable) is retried for this long, backing off from the first
# delay to the largest: a server that stalls for 20 s would otherwise hold the requests' sessions, and their KV,
# until it needs the room or they sit idle for its session_idle_s.
RELEASE_RETRY_S = 300.0
RELEASE_FIRST_RETRY_S = 1.0
RELEASE_MAX_BACKOFF_S = 30.0


class Overloaded(Exception):
    pass


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        verifiers: VerifierPool,
        drafters: dict[str, DrafterService],  # draft model name -> the service hosting it
        router: DrafterRouter,
        controller: SpeculationController,
    ):
        self.context = RoundContext(config, drafters, router, controller)
        self.verifiers = verifiers
        self.drafting = Drafting(self.context, self._in_background)
        self.planning = Planning(self.context, self.drafting.breaker)
        self.verifying = Verifying(self.context, verifiers)
        self._background: set[asyncio.Task] = set()
        self._stopping = asyncio.Event()  # set by stop(): background releases stop retrying
        self._waiting: list[RequestState] = []
        self._turns: collections.Counter[str] = collections.Counter()  # requests admitted per client that still has some waiting
        self._lanes: list[list[RequestState]] = [[] for _ in range(max(1, config.pipeline_depth))]
        # New requests' first round while every lane is in one (`_admission`), measured as a lane of its own.
        self._admitting: list[RequestState] = []
        self._admission: asyncio.Task | None = None
        self._measures = RoundMeasures(len(self._lanes) + 1)
        self._load = RecentLoad()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    # --- the public side -----------------------------------------------------------------------------------

    def submit(self, state: RequestState, prompt_text: str, domain_hint: str = "") -> None:
        # Requests whose clients gave up while queued hold no place in the queue.
        self._waiting = [s for s in self._waiting if not s.cancelled]
        if len(self._waiting) >= self.context.config.settings.max_queued:
            raise Overloaded(f"{self.running} requests running and {len(self._waiting)} queued (router.max_queued); retry later")
        state.routing = self.context.router.start(prompt_text, domain_hint, drafts=state.spec.max_draft_tokens > 0)
        self._waiting.append(state)
        self._wake.set()
        if self._tasks and all(self._lanes) and self._admission is None and self.running < self.context.config.settings.max_running:
            self._admission = asyncio.create_task(self._admit_at_once(), name="admission")

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._lane(i), name=f"lane-{i}") for i in range(len(self._lanes))]
        self._tasks.append(asyncio.create_task(self._sync_routing_state(), name="routing-sync"))
        self._tasks.append(asyncio.create_task(self.verifiers.watch(), name="verifier-health"))

    async def stop(self) -> None:
        self._stopping.set()
        tasks = [*self._tasks, *([self._admission] if self._admission else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # Work still under way beside the lanes (releasing finished requests' sessions, probing a skipped
        # drafter) completes, each call within its own deadline: a stopped router leaves no session behind.
        await asyncio.gather(*self._background, return_exceptions=True)

    def _in_background(self, coroutine) -> None:
        """Run beside the lanes, holding a reference until done (the event loop keeps only a weak one)."""
        task = asyncio.create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @property
    def running(self) -> int:
        return sum(len(lane) for lane in self._lanes) + len(self._admitting)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # --- lanes ---------------------------------------------------------------------------------------------------

    def _admit(self, lane: list[RequestState]) -> None:
        """Move waiting requests into this lane: clients taking turns, each's earliest deadline first, least loaded lane first."""
        if not self._waiting:
            return
        self._expire(self._waiting)
        for state in [s for s in self._waiting if s.finished]:
            self._waiting.remove(state)
            self._publish(state)  # ended before it ran: nothing was sent to a server, nothing to release

        # Clients take turns: the one that has had the fewest of its requests admitted while some wait goes next, so
        # that a client sending a thousand prompts (in one call or in many) does not run them all before another
        # client's one, whatever deadlines it sets. Within a client, earliest deadline first, then first come, first
        # served. A request's priority (0 unless router.priority_scheduling lets requests set one) comes before all.
        def turn(state: RequestState) -> tuple:
            deadline = state.deadline if state.deadline is not None else float("inf")
            return (state.spec.priority, self._turns[state.client], deadline, state.admitted_at)

        while self._waiting and self.running < self.context.config.settings.max_running:
            if len(lane) > min(len(other) for other in self._lanes):
                break
            state = min(self._waiting, key=turn)
            self._waiting.remove(state)
            state.scheduled_at = time.monotonic()
            lane.append(state)
            self._turns[state.client] += 1
        waiting_clients = {s.client for s in self._waiting}
        self._turns = collections.Counter({client: n for client, n in self._turns.items() if client in waiting_clients})

    async def _lane(self, index: int) -> None:
        lane = self._lanes[index]
        while True:
            self._admit(lane)
            if not lane:
                self._measures.idle(index)
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._serve(lane, index)
            lane[:] = [s for s in lane if not s.finished]

    async def _serve(self, batch: list[RequestState], index: int) -> None:
        """One round of these requests in slot `index`, every request's news published, the finished ones' sessions
        released in the background."""
        try:
            await self._round(list(batch), index)
        except Exception:  # a bug must not stop the router: fail this round's requests, keep serving
            self._measures.idle(index)
            log.exception("round failed")
            for state in batch:
                state.error = (grpc.StatusCode.INTERNAL, "internal error in the router's scheduler; see its log")
        for state in batch:
            self._publish(state)
        finished = [s for s in batch if s.finished]
        if finished:
            self._wake.set()  # room for waiting requests in any lane
            self._in_background(self._release(finished))

    async def _admit_at_once(self) -> None:
        """New requests' first round beside the lanes' rounds, while every lane is in one and requests wait (`submit`);
        each then joins the least loaded lane."""
        index = len(self._lanes)  # its own slot in the round measures
        try:
            while self._waiting and all(self._lanes):
                self._admit(self._admitting)
                if not self._admitting:
                    return
                batch = self._admitting
                await self._serve(batch, index)
                self._measures.idle(index)
                self._admitting = []
                for state in batch:
                    if not state.finished:
                        min(self._lanes, key=len).append(state)
                self._wake.set()  # a lane that emptied meanwhile waits for work
        finally:
            self._admission = None

    async def _sync_routing_state(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            try:
                router = self.context.router
                await asyncio.to_thread(router.store.sync, router.pairs())
            except Exception:
                log.exception("routing state sync failed")

    # --- a round -------------------------------------------------------------------------------------------------

    def _expire(self, states: list[RequestState]) -> None:
        """End the requests whose deadline passed. The client's gRPC deadline also cancels the call, but the
        router does not rely on it: a round in flight when it passes is the last, and the sessions are released."""
        now = time.monotonic()
        for state in states:
            if state.deadline is not None and now >= state.deadline and not state.finished:
                state.error = (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded; the output so far was streamed")

    async def _round(self, batch: list[RequestState], index: int) -> None:
        """One round of the batch of lane `index`."""
        self._expire(batch)
        batch = [s for s in batch if not s.finished]
        if not batch:
            return
        started, before, running = time.perf_counter(), sum(len(s.tokens) for s in batch), self._load.observe(self.running)
        # Drafting hides behind verification only while another lane has requests to verify. A new request
        # whose specialists still score its prompt decodes plainly in this round, which verifies its prompt while
        # they score it (in the same round, beside its draft and verify calls), not after.
        plan = self.planning.plan(batch, overlap=sum(1 for lane in self._lanes if lane) > 1, running=running)
        planned, prefills = time.perf_counter(), sum(1 for s in batch if s.rounds == 0)
        clean_start = self._measures.start(index, plan)
        unscored = plan.to_score()
        ended = await concurrently([self._draft_and_verify(plan), *([self.drafting.score_prompts(unscored)] if unscored else [])])
        self.context.metrics.rounds += 1
        wall_ms = (ended[0] - started) * 1e3
        committed = sum(len(s.tokens) for s in batch) - before
        # What the round delivered in its wall time, for the controller's measurements.
        measures, controller = self._measures, self.context.controller
        clean, in_way = measures.ended(index, plan, clean_start, controller, committed, wall_ms, running, bool(unscored), prefills > 0)
        # Every request of the round waited for the router's own part of it.
        router_ms = plan.router_ms(wall_ms)
        for state in batch:
            state.timing_ms["router"] += router_ms
        if self.context.telemetry is not None:
            self.context.telemetry.phases["router"].observe(router_ms / 1e3)
        if log.isEnabledFor(logging.DEBUG):  # one line a round, for scripts/round_breakdown.py
            log.debug(
                "round: requests=%d k=%d committed=%d plan_ms=%.3f draft_ms=%.3f verify_ms=%.3f wall_ms=%.3f scored=%d prefills=%d"
                " clean=%d routed=%d ranked=%d in_way=%d modelled_ms=%.3f expected=%.2f extra_ms=%.3f lookup_rows=%d"
                " verify_scale=%.3f steps_scale=%.3f verify_call_ms=%.3f",
                len(batch),
                sum(r.k for r in plan.requests),
                committed,
                (planned - started) * 1e3,
                plan.draft_calls_ms,
                plan.verify_calls_ms,
                wall_ms,
                len(unscored),
                prefills,
                clean,
                plan.routed,
                plan.ranked,
                in_way,
                plan.modelled_ms or 0.0,
                self._expected_tokens(plan),
                controller.cost.drafting_extra,
                plan.lookup_rows,
                controller.cost.verify_scale,
                controller.cost.steps_scale,
                controller.cost.verify_call,
            )

    def _expected_tokens(self, plan: RoundPlan) -> float:
        """The tokens the plan expected the round to commit, by its leads' scaled acceptance (the debug line's)."""
        scale, expected = self.context.controller.acceptance_scale, 0.0
        for request in plan.requests:
            a = scale.scaled(request.drafters[0], request.acceptance) if request.k > 0 else 0.0
            expected += sum(a**i for i in range(request.k + 1)) + request.expected_gain
        return expected

    async def _draft_and_verify(self, plan: RoundPlan) -> float:
        """The round's draft and verify stages; returns when they ended (time.perf_counter)."""
        trees = await self.drafting.draft(plan)
        await self.verifying.verify(plan, trees)
        return time.perf_counter()

    def _publish(self, state: RequestState) -> None:
        if state.published_final:
            return
        metrics, telemetry = self.context.metrics, self.context.telemetry
        if state.cancelled and state.error is None:
            metrics.requests_cancelled += 1  # nobody is listening
            state.published_final = True
            if telemetry is not None:
                telemetry.cancelled_request(state)
            return
        if state.error is not None:
            metrics.requests_failed += 1
            state.published_final = True
            state.updates.put_nowait(state.error)
            if telemetry is not None:
                telemetry.failed_with(state, state.error[0])
            return
        chunk = state.take_chunk()
        if chunk is not None:
            if chunk.final:
                metrics.requests_finished += 1
                state.published_final = True
            state.updates.put_nowait(chunk)
            if telemetry is not None:
                telemetry.published(state, chunk)

    async def _release(self, finished: list[RequestState]) -> None:
        ids = [s.spec.session_id for s in finished]
        used = {d for s in finished for d in s.drafter_mirrors}
        drafters = self.context.drafters
        services = {drafters[d].name: drafters[d] for d in used if d in drafters}
        for state in finished:
            self.verifiers.unplaced(state)
            for service in services.values():
                service.unplaced(state.spec.session_id)
        replicas = {r for s in finished for r in s.verifier_replicas}
        # Every replica of a used service: a request may have moved, and a replica that only stalled keeps its sessions.
        drafting = {t.name: t for service in services.values() for t in service.replicas}
        pending = {f"verifier {r}": self.verifiers.replicas[r] for r in replicas} | {f"drafter service {n}": t for n, t in drafting.items()}
        delay, started = RELEASE_FIRST_RETRY_S, time.monotonic()
        while pending:
            names = list(pending)
            results = await asyncio.gather(*(pending[name].release(ids) for name in names), return_exceptions=True)
            failed = {name: result for name, result in zip(names, results) if isinstance(result, Exception)}
            if not failed:
                if delay > RELEASE_FIRST_RETRY_S:
                    log.info("released %d sessions after %.0fs of retries", len(ids), time.monotonic() - started)
                return
            errors = "; ".join(f"{name}: {error}" for name, error in failed.items())
            if self._stopping.is_set() or time.monotonic() - started + delay > RELEASE_RETRY_S:
                why = "each server forgets them when it needs the room or after its session_idle_s"
                log.warning("giving up releasing %d sessions (%s); %s", len(ids), errors, why)
                return
            if delay == RELEASE_FIRST_RETRY_S:
                log.warning("releasing %d sessions failed (%s); retrying for up to %.0fs", len(ids), errors, RELEASE_RETRY_S)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)  # a stopping router tries once more, then gives up
            delay, pending = min(RELEASE_MAX_BACKOFF_S, 2 * delay), {name: pending[name] for name in failed}
