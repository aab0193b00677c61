"""Planning and drafting, steps 1 and 2 of a round (router/scheduler.py has the whole round).

Plan: the drafter router picks each request's drafters (one, or several that cooperate) and the speculation controller
its draft length k (0 means plain decoding this round); `plan` returns both as a `RoundPlan` (router/rounds.py), which
drafting and verification take as an argument. Draft: a request with one drafter gets a chain from one call.
Cooperating drafters hosted by the lead's service draft in lockstep inside it, in the same call: at each position each
proposes a token, the most confident proposal (`specfleet.fusion.lead`) continues the main branch and is fed back to
all of them, the others become side branches. Cooperating drafters on other services (other cores, nodes or GPUs) each
draft a chain of their own, concurrently, and the router merges the chains into the tree (router/trees.py
`request_tree`). Either way the result is a token tree whose every node carries the distribution it was drawn from.
All sessions of one drafter service go in one call (split to the service's per-call limits); all services are called
concurrently. A drafter that fails, or lost a session, costs only that round's drafts: the request decodes plainly,
and the service's breaker skips it until a probe answers.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from router import messages
from router.breaker import Breaker
from router.drafter_choice import consolidate, cooperate, modelled_round_ms, most_models, upper_acceptance
from router.request import RequestState, SessionMirror
from router.rounds import PREFILL_TOKENS_PER_S, RequestPlan, RoundContext, RoundPlan, concurrently, plain_steps, plain_steps_of
from router.transport import DrafterTransport, TransportError
from router.trees import DraftTree, lockstep, request_tree
from specfleet import limits

log = logging.getLogger(__name__)

# A steady-state draft call may take this many times the modelled time, and at least the floor
# (a shared machine's speed drifts 2x; a draft call is milliseconds), before its round goes on
# without it.
DRAFT_DEADLINE_FACTOR = 10.0
DRAFT_DEADLINE_FLOOR_S = 1.0
# A request the plan found hopeless (it would not draft for it even at its hope) is taken to stay so for this many
# rounds before its drafters' posteriors and its hope are weighed again: what could change that (its domain's
# evidence from other requests' drafts, the cost model, the load) moves over tens of rounds, and weighing it costs a
# routed round of plain steps three times an unrouted one's plan (docs/benchmarks/plan-cost.md).
HOPE_RECHECK_ROUNDS = 4


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


def _depths(members: int, k: int, fusion_depth: int) -> list[int]:
    """Draft positions per drafter: the first in routing order drafts all k; the others the first fusion_depth (0: all)."""
    return [k if i == 0 or fusion_depth == 0 else min(fusion_depth, k) for i in range(members)]


def _drafting_models(sessions: list[messages.DraftSession], free: frozenset[str]) -> int:
    """The distinct draft models a call drafts with (a session that only scores its prompt runs no draft step, and
    `free` drafters, such as the n-gram drafter, run no model)."""
    return len({s.model for s in sessions if s.num_draft_tokens > 0 and s.model not in free})


class Drafting:
    def __init__(self, context: RoundContext, in_background: Callable):
        self.context = context
        self.breaker = Breaker()
        self._in_background = in_background  # runs a coroutine beside the lanes (the scheduler's)

    def plan(self, batch: list[RequestState], overlap: bool, running: int | None = None) -> RoundPlan:
        """Who drafts for each request this round, and how many positions.

        Routing ranks each request's drafters where the plan might draft or probe at all (at each request's hope,
        and, routed by goodput, at its best drafter's mean); with adaptive speculation and expertise routing the cost
        model then moves requests to fewer distinct models (`consolidate`), plans each lead's k, and gives requests the
        helpers (up to fusion_width - 1) that raise the round's expected goodput (`cooperate`, router/drafter_choice.py).
        Without it, a request fuses as routing's `fusion_below` rule says.

        overlap: another lane's verification runs while this one drafts. running: requests in all lanes."""
        router, services, controller = self.context.router, self.context.drafters, self.context.controller
        # No request of the round drafts at all (speculation off for each): plain decoding, unrouted, and measured as
        # plain decoding, which it is.
        never_drafts = not any(state.spec.max_draft_tokens > 0 for state in batch)
        if never_drafts or (controller.adaptive and not controller.speculates(running or len(batch))):
            # Or speculating measured slower than plain decoding at this load (router/measured_goodput.py): the round
            # decodes plainly, as cheaply as with speculation off, without routing its requests or scoring prompts.
            for state in batch:
                if state.routing.needs_scores:
                    state.routing.scorable = False
            return self._planned([RequestPlan(state) for state in batch], overlap, routed=False)
        config, scale = router.config, controller.acceptance_scale
        by_goodput, free = controller.adaptive and config.routing_policy == "expertise", router.model_free
        bounds, posteriors, leads = [], [], []
        # Specialists score new prompts only where speculating is measured to pay at this load; elsewhere (a cold
        # start, a round that speculates only to remeasure it) the exemplars place them.
        scoring = controller.scoring_pays(running or len(batch))
        for state in batch:
            if state.routing.needs_scores:
                state.routing.scorable = state.routing.scorable and scoring
                router.place(state.routing)
            bound = max(0, min(state.spec.max_draft_tokens, state.remaining() - 1))
            # With adaptive speculation, a request's first round (its prompt's prefill, and its first token) decodes
            # plainly: the plan does not weigh the drafters' prefill of the prompt, which drafting there would make the
            # first token wait for (the draft call runs before the verify call). A prompt still being scored has no
            # domain to route by: it decodes plainly too.
            first = state.rounds == 0 and controller.adaptive
            drafts = bound > 0 and not first and not state.routing.needs_scores
            drafts = drafts and state.rounds >= state.hopeless_until  # found hopeless lately: not weighed again yet
            # Routed by goodput, every drafter's posterior for the request: the hope, consolidating and cooperating
            # weigh them all; otherwise routing's choice alone.
            posteriors.append(router.posteriors(state.routing) if drafts and by_goodput else {})
            leads.append(router.choose(state.routing) if drafts and not by_goodput else [])
            bounds.append(bound if posteriors[-1] or leads[-1] else 0)  # no drafter at all: nothing to draft with
        steps = [plain_steps_of(state, self.context.config.settings.plain_steps) for state in batch]
        hopeful = self._hopeful(batch, posteriors, leads, bounds, overlap, steps) if controller.adaptive else [True] * len(batch)
        might = self._might_draft(batch, posteriors, leads, bounds, overlap, steps, hopeful, by_goodput, running)
        for state, bound, hope in zip(batch, bounds, hopeful):
            if bound and not (hope and might):  # hopeless, or no draft nor probe due even at its best drafter
                state.hopeless_until = state.rounds + HOPE_RECHECK_ROUNDS
        if not might:
            # Nobody drafts or probes this round (or speculation off for each, prompts being scored, last tokens):
            # plain decoding, without ranking drafters or planning k.
            if controller.adaptive:
                controller.planned_plainly(steps)
            return self._planned([RequestPlan(state) for state in batch], overlap)
        ranked = [router.choose(state.routing, candidates=True, posteriors=p) if p else lead for state, p, lead in zip(batch, posteriors, leads)]
        means = [{d: scale.scaled(d, a / (a + r)) for d, (a, r) in p.items()} for p in posteriors]
        chosen = [d[:1] for d in ranked] if by_goodput else ranked
        if by_goodput and config.fewer_models:
            chosen = consolidate(chosen, means, bounds, services, controller.cost, self.usable(), free, controller.fill)
        # Each lead's acceptance as routing predicts it, and as the plan weighs it (what its leads gained, measured).
        predicted = [router.mean(s.routing, drafters[0]) if drafters else 0.0 for s, drafters in zip(batch, chosen)]
        acceptance = [scale.scaled(drafters[0], a) if drafters else 0.0 for drafters, a in zip(chosen, predicted)]
        fill = [controller.fill.rate(drafters[0]) if drafters else 1.0 for drafters in chosen]
        catch_up = [self._catch_up_ms(state, drafters[0] if drafters else "") for state, drafters in zip(batch, chosen)]
        models, left = most_models(chosen, services, free), [state.remaining() for state in batch]
        ks = controller.plan(acceptance, bounds, overlap, running, models, fill, steps, hopeful, catch_up, left)
        gains = [0.0] * len(batch)
        if by_goodput and config.fusion_width > 1:
            leads_first = [lead + [d for d in drafters if d not in lead][: config.fusion_width - 1] for lead, drafters in zip(chosen, ranked)]
            weighed = (leads_first, ks, means, services, controller.cost, config.fusion_depth, overlap)
            chosen, gains = cooperate(*weighed, controller.fusion_gain.efficiency, free, controller.fill)
        requests = [
            RequestPlan(state, drafters, _depths(len(drafters), k, config.fusion_depth), lockstep(drafters, services), gain, a)
            if k > 0
            else RequestPlan(state)
            for state, drafters, k, gain, a in zip(batch, chosen, ks, gains, predicted)
        ]
        for request in requests:
            if request.k > 0:
                router.leads.observe(request.state.routing.domain, request.drafters[0])
        return self._planned(requests, overlap, ranked=True)

    def _planned(self, requests: list[RequestPlan], overlap: bool, routed: bool = True, ranked: bool = False) -> RoundPlan:
        """The round's plan, with what the cost model expects it to take where speculation adapts (checked against
        its wall time: `CostModel.observe_round`)."""
        controller = self.context.controller
        plain_steps(requests, self.context.config.settings.plain_steps)
        if not controller.adaptive:
            return RoundPlan(requests, routed=routed, ranked=ranked)
        drafters, depths = [r.drafters for r in requests], [r.depths for r in requests]
        modelled = modelled_round_ms(
            drafters, depths, self.context.drafters, controller.cost, overlap, self.context.router.model_free, controller.fill
        )
        modelled += controller.cost.plain_steps_ms([r.plain_steps for r in requests])
        modelled += sum(self._catch_up_ms(r.state, d) for r in requests if r.k > 0 for d in r.drafters)
        return RoundPlan(requests, modelled, routed=routed, ranked=ranked)

    def _catch_up_ms(self, state: RequestState, drafter: str) -> float:
        """What drafting with `drafter` costs the draft call in feeding it what it lacks of the request (`lacking`);
        nothing for a drafter that runs no model, or for no drafter ("")."""
        free = not drafter or drafter in self.context.router.model_free
        return 0.0 if free else self.context.controller.cost.draft_catch_up_ms(state.lacking(drafter))

    def _might_draft(
        self, batch, posteriors, leads, bounds, overlap: bool, steps: list[int], hopeful: list[bool], by_goodput: bool, running: int | None
    ) -> bool:
        """Whether the plan might draft or probe for any request: some request may draft and is hopeful, and, routed by
        goodput, the plan would draft or probe were each request drafted by its best drafter (its mean; Thompson
        sampling ranks who drafts once a round drafts at all)."""
        if not any(hope and bound for hope, bound in zip(hopeful, bounds)):
            return False
        if not by_goodput:
            return True
        means, fills, models, best = self._best_drafters(batch, posteriors, leads, lambda a, r: a / (a + r))
        catch_up = [self._catch_up_ms(state, drafter) for state, drafter in zip(batch, best)]
        left = [s.remaining() for s in batch]
        return self.context.controller.might_draft(means, bounds, overlap, models, fills, steps, hopeful, catch_up, left, running)

    def _hopeful(self, batch, posteriors, leads, bounds, overlap: bool, steps: list[int]) -> list[bool]:
        """Per request, whether the plan could draft for it at its hope (`upper_acceptance`), at its most hopeful
        drafter's (`_best_drafters`)."""
        if not any(bounds):
            return [False] * len(batch)
        hopes, fills, models, _ = self._best_drafters(batch, posteriors, leads, upper_acceptance)
        return self.context.controller.could_draft(hopes, bounds, overlap, models, fills, steps)

    def _best_drafters(
        self, batch, posteriors, leads, acceptance: Callable[[float, float], float]
    ) -> tuple[list[float], list[float], int, list[str]]:
        """Per request, its best drafter's `acceptance` of its posterior (accepted, rejected), scaled as the plan scales
        it (routed by goodput, the best of all its drafters; otherwise its lead), and that drafter's fill; the
        distinct models a service runs were each request drafted by its best: none where every best is model-free
        (the n-gram drafter), else one, the cheapest drafting the round could have; and each request's best drafter
        ("" where it has none)."""
        router, controller = self.context.router, self.context.controller
        scale, free = controller.acceptance_scale, router.model_free
        values, fills, drafters = [], [], []
        for state, options, lead in zip(batch, posteriors, leads):
            options = options or ({lead[0]: router.posterior(state.routing, lead[0])} if lead else {})
            best, value = "", 0.0
            for drafter, (a, r) in options.items():
                if (mine := scale.scaled(drafter, acceptance(a, r))) > value:
                    best, value = drafter, mine
            values.append(value)
            fills.append(controller.fill.rate(best) if best else 1.0)
            drafters.append(best)
        return values, fills, 0 if all(d in free for d in drafters if d) else 1, drafters

    def usable(self) -> list[str]:
        """The drafters a round may move requests to: those whose service has a replica the breaker lets rounds call
        (a request moved to a skipped service would go without drafts)."""
        services = self.context.drafters
        return [d for d in self.context.router.drafters if any(self.breaker.allow(r.name) for r in services[d].replicas)]

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
            prefix, new = state.drafter_mirrors.setdefault(call.drafter, SessionMirror()).diff(call.tokens)
            session = messages.DraftSession(
                sync=messages.SessionSync(state.spec.session_id, prefix, new),
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
            reply = await transport.draft(sessions, self._timeout_s(sessions))
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
            out.append(DraftResult(call, drafted))
        return out

    def _timeout_s(self, sessions: list[messages.DraftSession]) -> float:
        """A draft call's deadline: a multiple of what the cost model expects it to take, so that a hung
        drafter holds a round (and every request in it) for a moment, not for rpc_timeout_s. What a call
        prefills (a new prompt, a context to score or catch up) is not modelled: its new tokens add a
        second per PREFILL_TOKENS_PER_S."""
        expected_ms = self.context.controller.cost.draft_ms(
            max(s.num_draft_tokens for s in sessions), _drafting_models(sessions, self.context.router.model_free)
        )
        deadline = max(DRAFT_DEADLINE_FLOOR_S, DRAFT_DEADLINE_FACTOR * expected_ms / 1e3)
        deadline += sum(len(s.sync.new_token_ids) for s in sessions) / PREFILL_TOKENS_PER_S
        return min(self.context.config.settings.rpc_timeout_s, deadline)

    async def _probe(self, transport: DrafterTransport) -> None:
        """Ask an open breaker's service for its info: an answer closes the breaker."""
        try:
            await transport.info(DRAFT_DEADLINE_FLOOR_S)
        except TransportError:
            self.breaker.failed(transport.name)
        else:
            self.breaker.succeeded(transport.name)
