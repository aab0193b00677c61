"""Planning and drafting, steps 1 and 2 of a round (router/scheduler.py has the whole round).

Plan: the drafter router picks each request's drafters (one, or several that
cooperate) and the speculation controller its draft length (num_draft_tokens;
0 means plain decoding this round). Draft: a request with one drafter gets a
chain from one call; cooperating drafters (hosted by one service) draft in
lockstep inside that service, in the same call: at each position each proposes
a token, the most confident proposal (`specfleet.fusion.lead`) continues the
main branch and is fed back to all of them, the others become side branches.
Either way the result is a token tree whose every node carries the
distribution it was drawn from. All sessions of one drafter service go in one
call (split to the service's per-call limits); all services are called
concurrently. A drafter that fails, or lost a session, costs only that round's
drafts: the request decodes plainly, and the service's breaker skips it until
a probe answers.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

from router.breaker import Breaker
from router.request import RequestState, SessionMirror
from router.rounds import PREFILL_TOKENS_PER_S, Round, sampling_proto
from router.transport import DrafterTransport, TransportError
from router.trees import DraftTree
from specfleet import limits
from specfleet.v1 import common_pb2, drafter_pb2

log = logging.getLogger(__name__)

# A steady-state draft call may take this many times the modelled time, and at least the floor
# (a shared machine's speed drifts 2x; a draft call is milliseconds), before its round goes on
# without it.
DRAFT_DEADLINE_FACTOR = 10.0
DRAFT_DEADLINE_FLOOR_S = 1.0


class Drafting:
    def __init__(self, round_: Round, in_background: Callable):
        self.round = round_
        self.breaker = Breaker()
        self._in_background = in_background  # runs a coroutine beside the lanes (the scheduler's)

    def plan(self, batch: list[RequestState], overlap: bool) -> None:
        """Set each request's round_drafters and num_draft_tokens for this round.

        overlap: another lane's verification runs while this one drafts."""
        router, bounds, acceptance, rounds = self.round.router, [], [], []
        for state in batch:
            max_draft_tokens = max(0, min(state.spec.max_draft_tokens, state.remaining() - 1))
            chosen = router.choose(state.routing) if max_draft_tokens > 0 else []
            # Cooperating drafters draft in lockstep inside one service: keep those hosted with the lead.
            state.round_drafters = [d for d in chosen if self.round.drafters[d] is self.round.drafters[chosen[0]]]
            if not state.round_drafters:
                max_draft_tokens = 0
            bounds.append(max_draft_tokens)
            if state.round_drafters:
                a, r = router.posterior(state.routing, state.round_drafters[0])
                acceptance.append(a / (a + r))
            else:
                acceptance.append(0.0)
            rounds.append(state.rounds)
        for state, k in zip(batch, self.round.controller.plan(acceptance, bounds, rounds, overlap)):
            state.num_draft_tokens = k

    async def draft(self, batch: list[RequestState]) -> dict[str, DraftTree]:
        """Draft trees for every request that drafts this round, keyed by session id."""
        trees = {s.spec.session_id: DraftTree() for s in batch if s.num_draft_tokens > 0}
        chains = [s for s in batch if s.num_draft_tokens > 0 and len(s.round_drafters) == 1]
        fused = [s for s in batch if s.num_draft_tokens > 0 and len(s.round_drafters) > 1]

        async def draft_chains():
            # Every chain in one call per service, num_draft_tokens tokens each.
            calls = [(s, s.round_drafters[0], s.tokens, s.num_draft_tokens, "") for s in chains]
            for state, drafter, drafted in await self._calls(calls):
                trees[state.spec.session_id].add_chain(drafter, drafted)

        async def draft_fused():
            # The cooperating drafters of a request share a service and draft in lockstep there, every position in one call.
            # The first drafter in routing order drafts every position; the others the first fusion_depth.
            depth = self.round.router.config.fusion_depth
            calls = [
                (s, d, s.tokens, s.num_draft_tokens if i == 0 or depth == 0 else min(depth, s.num_draft_tokens), s.spec.session_id)
                for s in fused
                for i, d in enumerate(s.round_drafters)
            ]
            replies: dict[str, dict[str, drafter_pb2.DraftedSession]] = collections.defaultdict(dict)
            for state, drafter, drafted in await self._calls(calls):
                replies[state.spec.session_id][drafter] = drafted
            for state in fused:
                tree, mine = trees[state.spec.session_id], replies[state.spec.session_id]
                for position in range(state.num_draft_tokens):
                    tree.fuse_position(state.round_drafters, mine, position)
                # Each drafter's session continued from the lead tokens, the main branch, for as many positions as it drafted.
                for drafter, drafted in mine.items():
                    state.drafter_mirrors[drafter].held = state.tokens + [tree.tokens[i] for i in tree.main[: len(drafted.token_ids)]]

        await asyncio.gather(draft_chains(), draft_fused())
        return {sid: tree for sid, tree in trees.items() if tree.tokens}

    async def score_prompts(self, batch: list[RequestState]) -> None:
        """Before a request's first round: every specialist prefills and scores its prompt; the best one sets its domain."""
        router = self.round.router
        calls = [(s, d, s.tokens, 0, "") for s in batch for d in router.scorers()]
        scores: dict[str, dict[str, float]] = collections.defaultdict(dict)
        for state, drafter, drafted in await self._calls(calls, score=True):
            if drafted.context_tokens > 0:
                scores[state.spec.session_id][drafter] = drafted.context_log_prob
        for state in batch:
            router.assign_domain(state.routing, scores[state.spec.session_id])

    async def _calls(self, calls, score: bool = False) -> list[tuple[RequestState, str, drafter_pb2.DraftedSession]]:
        """calls: (request, drafter, tokens the drafter should hold, num_draft_tokens, lockstep group).
        Returns the successful replies.

        score: also have each drafter score the context it prefills (DraftSession.score_context)."""
        drafters = self.round.drafters
        by_service: dict[str, list] = collections.defaultdict(list)
        transports: dict[str, DrafterTransport] = {}
        for state, drafter, tokens, k, group in calls:
            service = drafters[drafter]
            transport, moved = service.pick(state.spec.session_id, self.breaker.allow)
            if moved:
                # The new replica holds none of this request's sessions of this service: send everything.
                for model, mirror in state.drafter_mirrors.items():
                    if drafters.get(model) is service:
                        mirror.reset()
            transports[transport.name] = transport
            mirror = state.drafter_mirrors.setdefault(drafter, SessionMirror())
            prefix, new = mirror.diff(tokens)
            session = drafter_pb2.DraftSession(
                sync=common_pb2.SessionSync(session_id=state.spec.session_id, prefix_length=prefix, new_token_ids=new),
                model=drafter,
                num_draft_tokens=k,
                sampling=sampling_proto(state),
                stop_below_confidence=self.round.controller.stop_below,
                score_context=score,
                lockstep_group=group,
            )
            by_service[transport.name].append((state, drafter, tokens, session))

        def units(entries):
            # A lockstep group's sessions draft together: they travel in one call.
            grouped: dict = collections.defaultdict(list)
            for entry in entries:
                grouped[entry[3].lockstep_group or id(entry)].append(entry)
            return list(grouped.values())

        def call_limits(entries) -> limits.CallLimits:
            service = drafters[entries[0][1]].name  # every replica of a service has its limits
            return self.round.config.draft_limits.get(service, limits.CallLimits())

        parts = [
            (name, part)
            for name, entries in by_service.items()
            for part in limits.split(units(entries), lambda entry: limits.draft_tokens(entry[3]), call_limits(entries))
        ]
        results = await asyncio.gather(*(self._call(transports[name], entries, score) for name, entries in parts))
        return [r for part in results for r in part]

    async def _call(self, transport: DrafterTransport, entries, score: bool) -> list:
        if not self.breaker.allow(transport.name):
            if self.breaker.probe_due(transport.name):
                self._in_background(self._probe(transport))
            return []  # these requests decode plainly this round
        metrics, cost = self.round.metrics, self.round.controller.cost
        started = time.perf_counter()
        try:
            reply = await transport.draft(drafter_pb2.DraftRequest(sessions=[e[3] for e in entries]), self._timeout_s(entries))
        except TransportError as err:
            # Losing a drafter costs speed, never correctness: these requests decode plainly this round.
            metrics.drafter_errors += 1
            log.warning("drafter service %s failed (%s); decoding without its drafts this round", transport.name, err)
            self.breaker.failed(transport.name)
            for state, drafter, _, _ in entries:
                state.drafter_mirrors[drafter].reset()
            return []
        wall = (time.perf_counter() - started) * 1e3
        if self.round.telemetry is not None:
            self.round.telemetry.draft_call.labels(drafter_service=transport.name).observe(wall / 1e3)
        cost.observe_draft(max((e[3].num_draft_tokens for e in entries), default=0), reply.compute_ms)
        cost.observe_calls(draft_overhead_ms=wall - reply.compute_ms)
        out = []
        for (state, drafter, tokens, session), drafted in zip(entries, reply.sessions):
            state.timing_ms["draft_wall"] += wall
            state.timing_ms["draft_compute"] += reply.compute_ms
            mirror = state.drafter_mirrors[drafter]
            if drafted.status != common_pb2.SESSION_OK:
                metrics.session_misses += 1
                mirror.reset()
                continue
            # A lockstep session continues from the lead tokens; the caller records them.
            mirror.held = tokens + ([] if session.lockstep_group else list(drafted.token_ids))
            out.append((state, drafter, drafted))
        return out

    def _timeout_s(self, entries) -> float:
        """A draft call's deadline: a multiple of what the cost model expects it to take, so that a hung
        drafter holds a round (and every request in it) for a moment, not for rpc_timeout_s. What a call
        prefills (a new prompt, a context to score or catch up) is not modelled: its new tokens add a
        second per PREFILL_TOKENS_PER_S."""
        sessions = [e[3] for e in entries]
        expected_ms = self.round.controller.cost.draft_ms(max(s.num_draft_tokens for s in sessions))
        deadline = max(DRAFT_DEADLINE_FLOOR_S, DRAFT_DEADLINE_FACTOR * expected_ms / 1e3)
        deadline += sum(len(s.sync.new_token_ids) for s in sessions) / PREFILL_TOKENS_PER_S
        return min(self.round.config.rpc_timeout_s, deadline)

    async def _probe(self, transport: DrafterTransport) -> None:
        """Ask an open breaker's service for its info: an answer closes the breaker."""
        try:
            await transport.info(DRAFT_DEADLINE_FLOOR_S)
        except TransportError:
            self.breaker.failed(transport.name)
        else:
            self.breaker.succeeded(transport.name)
