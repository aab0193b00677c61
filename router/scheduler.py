"""The router's scheduler: advances every running request by draft-then-verify rounds.

The running requests are split into `pipeline_depth` groups (lanes), each a
loop of rounds, so that while the verifier checks one group the drafters
draft the next: drafters and verifier run on different machines and neither
should wait. New requests join the least loaded lane between its rounds,
earliest deadline first, up to `max_running`.

A round of one group:
1. Plan. The drafter router picks each request's drafters (one, or several
   that cooperate) and the speculation controller its draft length k (0 means
   plain decoding this round).
2. Draft. A request with one drafter gets a chain of k tokens from one call.
   Cooperating drafters (hosted by one service) draft in lockstep inside that
   service, in the same call: at each position each proposes a token, the
   most confident proposal (`specfleet.fusion.lead`) continues the main
   branch and is fed back to all of them, the others become side branches.
   Either way the result is a token tree whose every node carries the
   distribution it was drawn from. All sessions of one drafter service go in
   one call; all services are called concurrently.
3. Verify. One call carries every request's tree; the verifier merges
   concurrent calls into one forward pass.
4. Commit and learn. The accepted tokens plus the target's next token are
   committed and streamed; each drafter's proposals are scored against what
   the target emitted, and the routing and cost models learn from it.

A drafter that fails, or lost a session, only costs that round's drafts (the
request decodes plainly); a verifier that lost a session is sent the full
token ids next round; a verifier replica that fails hands its requests to a
live one (router/verifiers.py), which rebuilds their KV from the token ids.
Past its deadline a request ends with DEADLINE_EXCEEDED; what was streamed
stays delivered.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

import grpc

from router.breaker import Breaker
from router.drafters import DrafterService
from router.trees import DraftTree
from router.request import DrafterCounts, RequestState, SessionMirror
from router.routing import DrafterRouter
from router.speculation import SpeculationController
from router.transport import DrafterTransport, TransportError
from router.verifiers import VerifierPool
from specfleet import limits
from specfleet.v1 import common_pb2, drafter_pb2, generation_pb2, verifier_pb2

log = logging.getLogger(__name__)

# A steady-state draft call may take this many times the modelled time, and at least the floor
# (a shared machine's speed drifts 2x; a draft call is milliseconds), before its round goes on
# without it.
DRAFT_DEADLINE_FACTOR = 10.0
DRAFT_DEADLINE_FLOOR_S = 1.0
# New tokens sent with a draft call (prefilled there) that add one floor to its deadline.
PREFILL_TOKENS_PER_FLOOR = 64
# A verify call may take this many times the modelled pass, and at least the floor, before its
# replica counts as hung: the call also waits behind other callers' passes, merged at the verifier.
VERIFY_DEADLINE_FACTOR = 20.0
VERIFY_DEADLINE_FLOOR_S = 10.0


class Overloaded(Exception):
    pass


@dataclass
class SchedulerConfig:
    max_running: int
    max_queued: int
    rpc_timeout_s: float
    pipeline_depth: int = 2
    # What one call to the verifier, and to each drafter service by name, may carry: larger
    # batches travel as several calls (specfleet/limits.py).
    verify_limits: limits.CallLimits = field(default_factory=limits.CallLimits)
    draft_limits: dict[str, limits.CallLimits] = field(default_factory=dict)


@dataclass
class RouterMetrics:
    rounds: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0  # the client went away (or its deadline passed on its side)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafter_errors: int = 0
    session_misses: int = 0
    verify_busy_ms: float = 0.0
    # (domain, drafter) -> counts, for the router's metrics.
    by_domain: dict = field(default_factory=lambda: collections.defaultdict(DrafterCounts))


def _sampling_proto(state: RequestState) -> common_pb2.SamplingParams:
    s = state.spec.sampling
    return common_pb2.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, drafter_invariant=s.drafter_invariant
    )


def token_logprobs(verified: verifier_pb2.VerifiedSession) -> list[generation_pb2.TokenLogprobs]:
    """The verifier's flat log-probabilities of a round's tokens, one TokenLogprobs per token."""
    n = len(verified.token_ids)
    top = len(verified.top_token_ids) // n if n else 0
    return [
        generation_pb2.TokenLogprobs(
            token_id=token,
            logprob=verified.logprobs[i],
            top=[
                generation_pb2.TokenLogprob(token_id=t, logprob=lp)
                for t, lp in zip(verified.top_token_ids[i * top : (i + 1) * top], verified.top_logprobs[i * top : (i + 1) * top])
            ],
        )
        for i, token in enumerate(verified.token_ids)
    ]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        verifiers: VerifierPool,
        drafters: dict[str, DrafterService],  # draft model name -> the service hosting it
        router: DrafterRouter,
        controller: SpeculationController,
    ):
        self.config = config
        self.verifiers = verifiers
        self.drafters = drafters
        self.router = router
        self.controller = controller
        self.metrics = RouterMetrics()
        self.telemetry = None  # specfleet.metrics.RouterTelemetry, when the router exports metrics
        self.breaker = Breaker()
        self._background: set[asyncio.Task] = set()
        self._waiting: list[RequestState] = []
        self._lanes: list[list[RequestState]] = [[] for _ in range(max(1, config.pipeline_depth))]
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    # --- the public side -----------------------------------------------------------------------------------

    def submit(self, state: RequestState, prompt_text: str, domain_hint: str = "") -> None:
        # Requests whose clients gave up while queued hold no place in the queue.
        self._waiting = [s for s in self._waiting if not s.cancelled]
        if len(self._waiting) >= self.config.max_queued:
            raise Overloaded(
                f"{self.running} requests running and {len(self._waiting)} queued (router.max_queued); retry later"
            )
        state.routing = self.router.start(prompt_text, domain_hint)
        self._waiting.append(state)
        self._wake.set()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._lane(i), name=f"lane-{i}") for i in range(len(self._lanes))]
        self._tasks.append(asyncio.create_task(self._sync_routing_state(), name="routing-sync"))
        self._tasks.append(asyncio.create_task(self.verifiers.watch(), name="verifier-health"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
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
        return sum(len(lane) for lane in self._lanes)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    # --- lanes ---------------------------------------------------------------------------------------------------

    def _admit(self, lane: list[RequestState]) -> None:
        """Move waiting requests into this lane: earliest deadline first, least loaded lane first."""
        if not self._waiting:
            return
        self._expire(self._waiting)
        for state in [s for s in self._waiting if s.finished]:
            self._waiting.remove(state)
            self._publish(state)  # ended before it ran: nothing was sent to a server, nothing to release
        self._waiting.sort(key=lambda s: (s.deadline if s.deadline is not None else float("inf"), s.admitted_at))
        while self._waiting and self.running < self.config.max_running:
            if len(lane) > min(len(other) for other in self._lanes):
                break
            lane.append(self._waiting.pop(0))

    async def _lane(self, index: int) -> None:
        lane = self._lanes[index]
        while True:
            self._admit(lane)
            if not lane:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._round(list(lane))
            except Exception:  # a bug must not stop the router: fail this round's requests, keep serving
                log.exception("round failed")
                for state in lane:
                    state.error = (grpc.StatusCode.INTERNAL, "internal error in the router's scheduler; see its log")
            for state in lane:
                self._publish(state)
            finished = [s for s in lane if s.finished]
            lane[:] = [s for s in lane if not s.finished]
            if finished:
                self._wake.set()  # room for waiting requests in any lane
                self._in_background(self._release(finished))

    async def _sync_routing_state(self) -> None:
        while True:
            await asyncio.sleep(0.25)
            try:
                await asyncio.to_thread(self.router.store.sync)
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

    async def _round(self, batch: list[RequestState]) -> None:
        self._expire(batch)
        batch = [s for s in batch if not s.finished]
        if not batch:
            return
        unscored = [s for s in batch if s.routing.needs_scores]
        if unscored:
            await self._score_prompts(unscored)
        self._plan(batch)
        trees = await self._draft(batch)
        await self._verify(batch, trees)
        self.metrics.rounds += 1

    def _plan(self, batch: list[RequestState]) -> None:
        bounds, acceptance, rounds = [], [], []
        for state in batch:
            max_draft_tokens = max(0, min(state.spec.max_draft_tokens, state.remaining() - 1))
            chosen = self.router.choose(state.routing) if max_draft_tokens > 0 else []
            # Cooperating drafters draft in lockstep inside one service: keep those hosted with the lead.
            state.round_drafters = [d for d in chosen if self.drafters[d] is self.drafters[chosen[0]]]
            if not state.round_drafters:
                max_draft_tokens = 0
            bounds.append(max_draft_tokens)
            if state.round_drafters:
                a, r = self.router.posterior(state.routing, state.round_drafters[0])
                acceptance.append(a / (a + r))
            else:
                acceptance.append(0.0)
            rounds.append(state.rounds)
        # Drafting hides behind verification only while another lane has requests to verify.
        overlap = sum(1 for lane in self._lanes if lane) > 1
        for state, k in zip(batch, self.controller.plan(acceptance, bounds, rounds, overlap)):
            state.num_draft_tokens = k

    async def _draft(self, batch: list[RequestState]) -> dict[str, DraftTree]:
        """Draft trees for every request that drafts this round, keyed by request id."""
        trees = {s.spec.session_id: DraftTree() for s in batch if s.num_draft_tokens > 0}
        chains = [s for s in batch if s.num_draft_tokens > 0 and len(s.round_drafters) == 1]
        fused = [s for s in batch if s.num_draft_tokens > 0 and len(s.round_drafters) > 1]

        async def draft_chains():
            # Every chain in one call per service, k tokens each.
            calls = [(s, s.round_drafters[0], s.tokens, s.num_draft_tokens, "") for s in chains]
            for state, drafter, drafted in await self._draft_calls(calls):
                trees[state.spec.session_id].add_chain(drafter, drafted)

        async def draft_fused():
            # The cooperating drafters of a request share a service and draft in lockstep there, all k positions in one call.
            calls = [(s, d, s.tokens, s.num_draft_tokens, s.spec.session_id) for s in fused for d in s.round_drafters]
            replies: dict[str, dict[str, drafter_pb2.DraftedSession]] = collections.defaultdict(dict)
            for state, drafter, drafted in await self._draft_calls(calls):
                replies[state.spec.session_id][drafter] = drafted
            for state in fused:
                tree, mine = trees[state.spec.session_id], replies[state.spec.session_id]
                for position in range(state.num_draft_tokens):
                    tree.fuse_position(state.round_drafters, mine, position)
                # Each drafter's session continued from the lead tokens, the main branch.
                for drafter in mine:
                    state.drafter_mirrors[drafter].held = state.tokens + [tree.tokens[i] for i in tree.main]

        await asyncio.gather(draft_chains(), draft_fused())
        return {rid: tree for rid, tree in trees.items() if tree.tokens}

    async def _score_prompts(self, batch: list[RequestState]) -> None:
        """Before a request's first round: every specialist prefills and scores its prompt; the best one sets its domain."""
        calls = [(s, d, s.tokens, 0, "") for s in batch for d in self.router.scorers()]
        scores: dict[str, dict[str, float]] = collections.defaultdict(dict)
        for state, drafter, drafted in await self._draft_calls(calls, score=True):
            if drafted.context_tokens > 0:
                scores[state.spec.session_id][drafter] = drafted.context_log_prob
        for state in batch:
            self.router.assign_domain(state.routing, scores[state.spec.session_id])

    async def _draft_calls(self, calls, score: bool = False) -> list[tuple[RequestState, str, drafter_pb2.DraftedSession]]:
        """calls: (request, drafter, tokens the drafter should hold, k, lockstep group). Returns the successful replies.

        score: also have each drafter score the context it prefills (DraftSession.score_context)."""
        by_service: dict[str, list] = collections.defaultdict(list)
        transports: dict[str, DrafterTransport] = {}
        for state, drafter, tokens, k, group in calls:
            service = self.drafters[drafter]
            transport, moved = service.pick(state.spec.session_id, self.breaker.allow)
            if moved:
                # The new replica holds none of this request's sessions of this service: send everything.
                for model, mirror in state.drafter_mirrors.items():
                    if self.drafters.get(model) is service:
                        mirror.reset()
            transports[transport.name] = transport
            mirror = state.drafter_mirrors.setdefault(drafter, SessionMirror())
            prefix, new = mirror.diff(tokens)
            session = drafter_pb2.DraftSession(
                sync=common_pb2.SessionSync(session_id=state.spec.session_id, prefix_length=prefix, new_token_ids=new),
                model=drafter,
                num_draft_tokens=k,
                sampling=_sampling_proto(state),
                stop_below_confidence=self.controller.stop_below,
                score_context=score,
                lockstep_group=group,
            )
            by_service[transport.name].append((state, drafter, tokens, session))

        async def call(transport: DrafterTransport, entries):
            if not self.breaker.allow(transport.name):
                if self.breaker.probe_due(transport.name):
                    self._in_background(self._probe(transport))
                return []  # these requests decode plainly this round
            started = time.perf_counter()
            try:
                reply = await transport.draft(drafter_pb2.DraftRequest(sessions=[e[3] for e in entries]), self._draft_timeout_s(entries, score))
            except TransportError as err:
                # Losing a drafter costs speed, never correctness: these requests decode plainly this round.
                self.metrics.drafter_errors += 1
                log.warning("drafter service %s failed (%s); decoding without its drafts this round", transport.name, err)
                self.breaker.failed(transport.name)
                for state, drafter, _, _ in entries:
                    state.drafter_mirrors[drafter].reset()
                return []
            wall = (time.perf_counter() - started) * 1e3
            if self.telemetry is not None:
                self.telemetry.draft_call.labels(drafter_service=transport.name).observe(wall / 1e3)
            self.controller.cost.observe_draft(max((e[3].num_draft_tokens for e in entries), default=0), reply.compute_ms)
            self.controller.cost.observe_calls(draft_overhead_ms=wall - reply.compute_ms)
            out = []
            for (state, drafter, tokens, session), drafted in zip(entries, reply.sessions):
                state.timing_ms["draft_wall"] += wall
                state.timing_ms["draft_compute"] += reply.compute_ms
                mirror = state.drafter_mirrors[drafter]
                if drafted.status != common_pb2.SESSION_OK:
                    self.metrics.session_misses += 1
                    mirror.reset()
                    continue
                # A lockstep session continues from the lead tokens; the caller records them.
                mirror.held = tokens + ([] if session.lockstep_group else list(drafted.token_ids))
                out.append((state, drafter, drafted))
            return out

        def units(entries):
            # A lockstep group's sessions draft together: they travel in one call.
            grouped: dict = collections.defaultdict(list)
            for entry in entries:
                grouped[entry[3].lockstep_group or id(entry)].append(entry)
            return list(grouped.values())

        def call_limits(entries) -> limits.CallLimits:
            service = self.drafters[entries[0][1]].name  # every replica of a service has its limits
            return self.config.draft_limits.get(service, limits.CallLimits())

        parts = [
            (name, part)
            for name, entries in by_service.items()
            for part in limits.split(units(entries), lambda entry: limits.draft_tokens(entry[3]), call_limits(entries))
        ]
        results = await asyncio.gather(*(call(transports[name], entries) for name, entries in parts))
        return [r for part in results for r in part]

    def _draft_timeout_s(self, entries, score: bool) -> float:
        """A draft call's deadline: a multiple of what the cost model expects it to take, so that a hung
        drafter holds a round (and every request in it) for a moment, not for rpc_timeout_s. What a call
        prefills (a new prompt, a context to score or catch up) is not modelled: each session's new
        tokens add a floor's worth per PREFILL_TOKENS_PER_FLOOR, a prefill rate no drafter falls below."""
        sessions = [e[3] for e in entries]
        expected_ms = self.controller.cost.draft_ms(max(s.num_draft_tokens for s in sessions))
        deadline = max(DRAFT_DEADLINE_FLOOR_S, DRAFT_DEADLINE_FACTOR * expected_ms / 1e3)
        deadline += DRAFT_DEADLINE_FLOOR_S * sum(len(s.sync.new_token_ids) for s in sessions) / PREFILL_TOKENS_PER_FLOOR
        return min(self.config.rpc_timeout_s, deadline)

    async def _probe(self, transport: DrafterTransport) -> None:
        """Ask an open breaker's service for its info: an answer closes the breaker."""
        try:
            await transport.info(DRAFT_DEADLINE_FLOOR_S)
        except TransportError:
            self.breaker.failed(transport.name)
        else:
            self.breaker.succeeded(transport.name)

    async def _verify(self, batch: list[RequestState], trees: dict[str, DraftTree]) -> None:
        """Every request's tree to the replica holding its sessions, one call per replica, concurrently."""
        by_replica: dict[str, list[RequestState]] = collections.defaultdict(list)
        waiting = []
        for state in batch:
            replica = self.verifiers.place(state)
            (by_replica[replica] if replica is not None else waiting).append(state)
        await asyncio.gather(*(self._verify_on(replica, states, trees) for replica, states in by_replica.items()))
        for state in waiting:
            if self.verifiers.waited_too_long(state):
                state.error = (
                    grpc.StatusCode.UNAVAILABLE,
                    f"no verifier replica has answered for {self.verifiers.wait_s:.0f}s (router.verifier_wait_s); retry",
                )
        if waiting and not by_replica:
            # No replica is live: wait for the next probe instead of spinning through empty rounds.
            await asyncio.sleep(min(0.5, max(0.05, self.verifiers.next_probe_in())))

    def _verify_timeout_s(self, sessions: list[verifier_pb2.VerifySession]) -> float:
        """A verify call's deadline: a multiple of the modelled pass plus what it prefills, so that a hung
        replica's requests move on in seconds, not after rpc_timeout_s."""
        tokens = sum(1 + len(s.tree.token_ids) for s in sessions)
        expected_s = self.controller.cost.verify_ms(len(sessions), tokens) / 1e3
        deadline = max(VERIFY_DEADLINE_FLOOR_S, VERIFY_DEADLINE_FACTOR * expected_s)
        deadline += DRAFT_DEADLINE_FLOOR_S * sum(len(s.sync.new_token_ids) for s in sessions) / PREFILL_TOKENS_PER_FLOOR
        return min(self.config.rpc_timeout_s, deadline)

    async def _verify_on(self, replica: str, batch: list[RequestState], trees: dict[str, DraftTree]) -> None:
        """The replica's requests in calls within the verifier's per-call limits, concurrently."""
        entries = []
        for state in batch:
            prefix, new = state.verifier_mirror.diff(state.tokens)
            tree = trees.get(state.spec.session_id)
            session = verifier_pb2.VerifySession(
                sync=common_pb2.SessionSync(session_id=state.spec.session_id, prefix_length=prefix, new_token_ids=new),
                tree=tree.to_proto() if tree else verifier_pb2.TokenTree(),
                sampling=_sampling_proto(state),
                logprobs=state.spec.logprobs,
                top_logprobs=state.spec.top_logprobs,
            )
            entries.append([(state, session)])
        calls = limits.split(entries, lambda entry: limits.verify_tokens(entry[1]), self.config.verify_limits)
        await asyncio.gather(*(self._verify_call(replica, [e[0] for e in call], [e[1] for e in call], trees) for call in calls))

    async def _verify_call(self, replica: str, batch: list[RequestState], sessions: list, trees: dict[str, DraftTree]) -> None:
        started = time.perf_counter()
        try:
            reply = await self.verifiers.replicas[replica].verify(verifier_pb2.VerifyRequest(sessions=sessions), self._verify_timeout_s(sessions))
        except TransportError as err:
            if err.invalid_argument:
                log.error("verifier replica %s refused the round (%s)", replica, err)
                for state in batch:
                    state.verifier_mirror.reset()
                    state.error = (grpc.StatusCode.INTERNAL, f"the verifier refused the round: {err}")
            else:
                # Nothing was committed: the requests verify again next round, on a live replica.
                self.verifiers.failed(replica, batch, err)
            return
        self.verifiers.succeeded(batch)
        if self.telemetry is not None:
            self.telemetry.replica_sessions.labels(replica=replica).inc(len(batch))
        wall = (time.perf_counter() - started) * 1e3
        if self.telemetry is not None:
            self.telemetry.verify_call.observe(wall / 1e3)
        # A merged batch reports its whole compute time to every caller: count this call's share
        # as busy time, and scale this call's sessions and tokens up to the pass for the cost model.
        self.metrics.verify_busy_ms += reply.compute_ms * len(sessions) / max(reply.batch_size, len(sessions))
        fed = sum(1 + len(s.tree.token_ids) for s in sessions)
        share = reply.batch_size / max(1, len(sessions))
        self.controller.cost.observe_verify(round(len(sessions) * share), round(fed * share), reply.compute_ms)
        self.controller.cost.observe_calls(verify_overhead_ms=wall - reply.compute_ms)
        for state, verified in zip(batch, reply.sessions):
            state.timing_ms["verify_wall"] += wall
            state.timing_ms["verify_compute"] += reply.compute_ms
            if verified.status != common_pb2.SESSION_OK:
                # Lost by the verifier: send everything next round. No tokens were committed.
                self.metrics.session_misses += 1
                state.verifier_mirror.reset()
                continue
            tree = trees.get(state.spec.session_id)
            state.rounds += 1
            if tree is not None:
                self._learn(state, tree, list(verified.accepted_nodes), list(verified.token_ids))
            state.commit(list(verified.token_ids), token_logprobs(verified) if state.spec.logprobs else None)
            state.verifier_mirror.held = list(state.tokens)

    def _learn(self, state: RequestState, tree: DraftTree, accepted_nodes: list[int], emitted: list[int]) -> None:
        """Count drafted and accepted tokens, and score each drafter's proposals against what was emitted."""
        state.draft_tokens += len(tree.tokens)
        state.accepted_tokens += len(accepted_nodes)
        if self.telemetry is not None:
            self.telemetry.verified(state, tree, accepted_nodes)
        self.metrics.draft_tokens += len(tree.tokens)
        self.metrics.accepted_tokens += len(accepted_nodes)
        accepted_owners = collections.Counter(d for node in accepted_nodes for d in tree.owners[node])
        outcomes = tree.outcomes(accepted_nodes, emitted)
        for drafter, (hits, _) in outcomes.items():
            counts = state.per_drafter.setdefault(drafter, DrafterCounts())
            counts.rounds += 1
            counts.draft_tokens += sum(1 for owners in tree.owners if drafter in owners)
            counts.accepted_tokens += accepted_owners[drafter]
            by_domain = self.metrics.by_domain[(state.routing.domain, drafter)]
            by_domain.rounds += 1
            by_domain.draft_tokens += len(tree.proposed[drafter])
            by_domain.accepted_tokens += hits
        self.router.observe(state.routing, outcomes)

    def _publish(self, state: RequestState) -> None:
        if state.published_final:
            return
        if state.cancelled and state.error is None:
            self.metrics.requests_cancelled += 1  # nobody is listening
            state.published_final = True
            if self.telemetry is not None:
                self.telemetry.cancelled_request(state)
            return
        if state.error is not None:
            self.metrics.requests_failed += 1
            state.published_final = True
            state.updates.put_nowait(state.error)
            if self.telemetry is not None:
                self.telemetry.failed_with(state, state.error[0])
            return
        chunk = state.take_chunk()
        if chunk is not None:
            if chunk.final:
                self.metrics.requests_finished += 1
                state.published_final = True
            state.updates.put_nowait(chunk)
            if self.telemetry is not None:
                self.telemetry.published(state, chunk)

    async def _release(self, finished: list[RequestState]) -> None:
        ids = [s.spec.session_id for s in finished]
        used = {d for s in finished for d in s.drafter_mirrors}
        services = {self.drafters[d].name: self.drafters[d] for d in used if d in self.drafters}
        for state in finished:
            self.verifiers.unplaced(state)
            for service in services.values():
                service.unplaced(state.spec.session_id)
        replicas = {r for s in finished for r in s.verifier_replicas}
        # Every replica of a used service: a request may have moved, and a replica that only stalled keeps its sessions.
        drafting = {t.name: t for service in services.values() for t in service.replicas}
        calls = [self.verifiers.replicas[r].release(ids) for r in replicas] + [t.release(ids) for t in drafting.values()]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, Exception):
                log.debug("release failed: %s", result)
