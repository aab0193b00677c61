"""Drafting, step 2 of a round (router/scheduler.py has the whole round; router/planning.py plans it).

`Drafting.draft(plan)` returns each drafting request's token tree. A request with one drafter gets a chain from one
call. Cooperating drafters hosted by the lead's service draft in lockstep inside it, in the same call: at each position
each proposes a token, the most confident proposal (`specfleet.fusion.lead`) continues the main branch and is fed back
to all of them, the others become side branches. Cooperating drafters on other services (other cores, nodes or GPUs)
each draft a chain of their own, concurrently, and the router merges the chains into the tree (router/trees.py
`request_tree`). Either way the result is a token tree whose every node carries the distribution it was drawn from.
All sessions of one drafter service go in one call (split to the service's per-call limits); all services are called
concurrently. A drafter that fails, or lost a session, costs only that round's drafts: the request decodes plainly,
and the service's breaker skips it until a probe answers. `score_prompts` has the specialists score new prompts.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from router import messages
from router.breaker import Breaker
from router.request import RequestState, SessionMirror
from router.rounds import PREFILL_TOKENS_PER_S, RoundContext, RoundPlan, concurrently
from router.transport import DrafterTransport, TransportError
from router.trees import DraftTree, request_tree
from specfleet import limits

log = logging.getLogger(__name__)

# A steady-state draft call may take this many times the modelled time, and at least the floor
# (a shared machine's speed drifts 2x; a draft call is milliseconds), before its round goes on
# without it.
DRAFT_DEADLINE_FACTOR = 10.0
DRAFT_DEADLINE_FLOOR_S = 1.0


@dataclass
class DraftCall:
    """One drafter's session of one request in a Draft call, as drafting asks for it."""

    state: RequestState
    drafter: str
    tokens: list[int]  # what the drafter's session holds before it drafts (its mirror decides what travels)
    k: int  # positions to draft
    group: str = ""  # the lockstep group (the request's session id) when it drafts in lockstep with the lead
    score: bool = False  # also score the context it prefills (in a request's first round)


@dataclass
class _Outgoing:
    """A call placed on a replica, with the session it sends there (only what the replica lacks)."""

    call: DraftCall
    session: messages.DraftSession


@dataclass
class DraftResult:
    """A call whose session drafted."""

    call: DraftCall
    drafted: messages.DraftedSession


def _drafting_models(sessions: list[messages.DraftSession], free: frozenset[str]) -> int:
    """The distinct draft models a call drafts with (a session that only scores its prompt runs no draft step, and
    `free` drafters, such as the n-gram drafter, run no model)."""
    return len({s.model for s in sessions if s.num_draft_tokens > 0 and s.model not in free})


class Drafting:
    def __init__(self, context: RoundContext, in_background: Callable):
        self.context = context
        self.breaker = Breaker()
        self._in_background = in_background  # runs a coroutine beside the lanes (the scheduler's)

    async def draft(self, plan: RoundPlan) -> dict[str, DraftTree]:
        """Draft trees for every request that drafts this round, keyed by session id. A tree may be empty (no drafter
        proposed, as an n-gram drafter without a match): its request is verified plainly, and its drafters are still
        scored (a miss each) and their fill measured, or routing and the plan would judge them by their lucky rounds."""
        drafting = plan.drafting()
        calls = [
            DraftCall(r.state, drafter, r.state.tokens, depth, group=r.state.spec.session_id if drafter in r.lockstep else "")
            for r in drafting
            for drafter, depth in zip(r.drafters, r.depths)
        ]
        replies: dict[str, dict[str, messages.DraftedSession]] = collections.defaultdict(dict)
        for result in await self._calls(calls, plan):
            if not result.drafted.prefilling:  # a drafter still prefilling the context had nothing to propose from
                replies[result.call.state.spec.session_id][result.call.drafter] = result.drafted
        return {r.state.spec.session_id: request_tree(r, replies[r.state.spec.session_id]) for r in drafting}

    async def score_prompts(self, batch: list[RequestState]) -> None:
        """In a request's first round, beside its verification: every specialist prefills and scores its prompt; the
        best one sets its domain. Each call holds a copy of the tokens it sends, as the round commits to the request's."""
        router = self.context.router
        calls = [DraftCall(s, d, list(s.tokens), 0, score=True) for s in batch for d in router.scorers()]
        scores: dict[str, dict[str, float]] = collections.defaultdict(dict)
        for result in await self._calls(calls):
            if result.drafted.context_tokens > 0:
                scores[result.call.state.spec.session_id][result.call.drafter] = result.drafted.context_log_prob
        for state in batch:
            router.assign_domain(state.routing, scores[state.spec.session_id])

    async def _calls(self, calls: list[DraftCall], plan: RoundPlan | None = None) -> list[DraftResult]:
        """Each call to the replica of its drafter's service that drafts for the request, one Draft call per
        replica (split to the service's per-call limits), all concurrently. Returns the sessions that drafted;
        a round's `plan` learns how long its calls took."""
        drafters = self.context.drafters
        by_replica: dict[str, list[_Outgoing]] = collections.defaultdict(list)
        transports: dict[str, DrafterTransport] = {}
        for call in calls:
            state, service = call.state, drafters[call.drafter]
            transport, moved = service.pick(state.spec.session_id, self.breaker.allow)
            if moved:
                # The new replica holds none of this request's sessions of this service: send everything.
                for model, mirror in state.drafter_mirrors.items():
                    if drafters.get(model) is service:
                        mirror.reset()
            transports[transport.name] = transport
            diff = state.drafter_mirrors.setdefault(call.drafter, SessionMirror()).diff(call.tokens)
            session = messages.DraftSession(
                sync=messages.SessionSync.of(state.spec.session_id, diff, state.spec.cache_salt),
                model=call.drafter,
                num_draft_tokens=call.k,
                sampling=state.spec.sampling,
                stop_below_confidence=self.context.controller.stop_below,
                score_context=call.score,
                lockstep_group=call.group,
            )
            by_replica[transport.name].append(_Outgoing(call, session))

        def units(outgoing: list[_Outgoing]) -> list[list[_Outgoing]]:
            # A lockstep group's sessions draft together: they travel in one call.
            grouped: dict = collections.defaultdict(list)
            for entry in outgoing:
                grouped[entry.call.group or id(entry)].append(entry)
            return list(grouped.values())

        def call_limits(outgoing: list[_Outgoing]) -> limits.CallLimits:
            service = drafters[outgoing[0].call.drafter].name  # every replica of a service has its limits
            return self.context.config.draft_limits.get(service, limits.CallLimits())

        parts = [
            (name, part)
            for name, outgoing in by_replica.items()
            for part in limits.split(units(outgoing), lambda entry: limits.draft_tokens(entry.session), call_limits(outgoing))
        ]
        results = await concurrently([self._call(transports[name], part, plan) for name, part in parts])
        return [r for part in results for r in part]

    async def _call(self, transport: DrafterTransport, part: list[_Outgoing], plan: RoundPlan | None) -> list[DraftResult]:
        if not self.breaker.allow(transport.name):
            if self.breaker.probe_due(transport.name):
                self._in_background(self._probe(transport))
            return []  # these requests decode plainly this round
        metrics, cost = self.context.metrics, self.context.controller.cost
        sessions = [entry.session for entry in part]
        started = time.perf_counter()
        try:
            prefill = sum(e.call.state.drafter_mirrors[e.call.drafter].prefill_tokens(e.session.sync.new_token_ids) for e in part)
            reply = await transport.draft(sessions, self._timeout_s(sessions, prefill))
        except TransportError as err:
            if plan is not None:
                plan.called("draft", (time.perf_counter() - started) * 1e3)
            # Losing a drafter costs speed, never correctness: these requests decode plainly this round.
            metrics.drafter_errors += 1
            log.warning("drafter service %s failed (%s); decoding without its drafts this round", transport.name, err)
            self.breaker.failed(transport.name)
            for entry in part:
                entry.call.state.drafter_mirrors[entry.call.drafter].reset()
            return []
        wall = (time.perf_counter() - started) * 1e3
        if plan is not None:
            plan.called("draft", wall)
        if self.context.telemetry is not None:
            self.context.telemetry.draft_call.labels(drafter_service=transport.name).observe(wall / 1e3)
            self.context.telemetry.call_phases("draft", wall, reply.compute_ms, reply.queue_ms)
        depth = max((s.num_draft_tokens for s in sessions), default=0)
        if depth > 0:
            # A call that only scores prompts (depth 0) runs beside a round's verification and costs what prefill
            # costs: the cost model plans drafting, so it learns from draft calls alone.
            caught_up = sum(max(0, len(s.sync.new_token_ids) - 1) for s in sessions if s.num_draft_tokens > 0)
            cost.observe_draft(depth, reply.compute_ms, _drafting_models(sessions, self.context.router.model_free), caught_up)
            cost.observe_calls(draft_overhead_ms=wall - reply.compute_ms)
        out = []
        # The call's time counts once for each request it served, however many of its sessions (specialists
        # scoring a prompt, drafters in lockstep) the request had in it.
        for state in {id(entry.call.state): entry.call.state for entry in part}.values():
            state.timing_ms["draft_wall"] += wall
            state.timing_ms["draft_compute"] += reply.compute_ms
            state.timing_ms["draft_queue"] += reply.queue_ms
        for entry, drafted in zip(part, reply.sessions):
            call = entry.call
            mirror = call.state.drafter_mirrors[call.drafter]
            if not drafted.known:
                metrics.session_misses += 1
                mirror.reset()
                continue
            # A lockstep session continues from the lead tokens; `_tree` records them.
            mirror.held = call.tokens + ([] if call.group else drafted.token_ids)
            mirror.unfilled = len(mirror.held) if drafted.prefilling else 0
            out.append(DraftResult(call, drafted))
        return out

    def _timeout_s(self, sessions: list[messages.DraftSession], prefill_tokens: int) -> float:
        """A draft call's deadline: a multiple of what the cost model expects it to take, so that a hung
        drafter holds a round (and every request in it) for a moment, not for rpc_timeout_s. What a call
        prefills (a new prompt, a context to score or catch up, the rest of a prompt prefilled in chunks) is
        not modelled: each of the `prefill_tokens` it may prefill adds 1 / PREFILL_TOKENS_PER_S seconds."""
        expected_ms = self.context.controller.cost.draft_ms(
            max(s.num_draft_tokens for s in sessions), _drafting_models(sessions, self.context.router.model_free)
        )
        deadline = max(DRAFT_DEADLINE_FLOOR_S, DRAFT_DEADLINE_FACTOR * expected_ms / 1e3)
        deadline += prefill_tokens / PREFILL_TOKENS_PER_S
        return min(self.context.config.settings.rpc_timeout_s, deadline)

    async def _probe(self, transport: DrafterTransport) -> None:
        """Ask an open breaker's service for its info: an answer closes the breaker."""
        try:
            await transport.info(DRAFT_DEADLINE_FLOOR_S)
        except TransportError:
            self.breaker.failed(transport.name)
        else:
            self.breaker.succeeded(transport.name)
