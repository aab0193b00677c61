"""Planning, step 1 of a round (router/scheduler.py has the whole round): who drafts for each request, and how far.

The drafter router (router/routing.py) ranks each request's drafters and the speculation controller
(router/speculation.py) plans its draft length k (0: plain decoding this round); `Planning.plan` returns both as a
`RoundPlan` (router/rounds.py), which drafting (router/drafting.py) and verification (router/verifying.py) take as
an argument. Where no request could draft even at its hope (the best acceptance its drafters' evidence leaves
plausible), the round decodes plain steps without ranking drafters, and a request found hopeless is weighed again
only every HOPE_RECHECK_ROUNDS rounds: a routed round of plain steps then costs the router little more than an
unrouted one (docs/benchmarks/plan-cost.md).
"""

from __future__ import annotations

from collections.abc import Callable

from router.breaker import Breaker
from router.drafter_choice import consolidate, cooperate, modelled_round_ms, most_models, upper_acceptance
from router.request import RequestState
from router.rounds import RequestPlan, RoundContext, RoundPlan, plain_steps, plain_steps_of
from router.trees import lockstep

# A request the plan found hopeless (it would not draft for it even at its hope) is taken to stay so for this many
# rounds before its drafters' posteriors and its hope are weighed again: what could change that (its domain's
# evidence from other requests' drafts, the cost model, the load) moves over tens of rounds, and weighing it costs a
# routed round of plain steps three times an unrouted one's plan (docs/benchmarks/plan-cost.md).
HOPE_RECHECK_ROUNDS = 4


def _depths(members: int, k: int, fusion_depth: int) -> list[int]:
    """Draft positions per drafter: the first in routing order drafts all k; the others the first fusion_depth (0: all)."""
    return [k if i == 0 or fusion_depth == 0 else min(fusion_depth, k) for i in range(members)]


class Planning:
    def __init__(self, context: RoundContext, breaker: Breaker | None = None):
        self.context = context
        # Drafting's breaker (router/drafting.py): a request is not moved to a drafter whose service it skips.
        self.breaker = breaker or Breaker()

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
            routing = state.routing
            if routing.needs_scores:
                routing.scorable = routing.scorable and scoring
                if routing.scorable:
                    router.place(routing)  # placed for sure by the exemplars, or scored in this round
            bound = max(0, min(state.spec.max_draft_tokens, state.remaining() - 1))
            # With adaptive speculation, a request's first round (its prompt's prefill, and its first token) decodes
            # plainly: the plan does not weigh the drafters' prefill of the prompt, which drafting there would make the
            # first token wait for (the draft call runs before the verify call). A prompt still being scored has no
            # domain to route by: it decodes plainly too.
            first = state.rounds == 0 and controller.adaptive
            drafts = bound > 0 and not first and not routing.awaits_scores
            drafts = drafts and state.rounds >= state.hopeless_until  # found hopeless lately: not weighed again yet
            if drafts and routing.unplaced and not by_goodput:
                router.place(routing)
            # Routed by goodput, every drafter's posterior for the request: the hope, consolidating and cooperating
            # weigh them all (for a request the exemplars have not placed yet, its best anywhere: `_place_hopeful`);
            # otherwise routing's choice alone.
            if drafts and by_goodput:
                posteriors.append(router.posteriors_anywhere() if routing.unplaced else router.posteriors(routing))
            else:
                posteriors.append({})
            leads.append(router.choose(routing) if drafts and not by_goodput else [])
            bounds.append(bound if posteriors[-1] or leads[-1] else 0)  # no drafter at all: nothing to draft with
        steps = [plain_steps_of(state, self.context.config.settings.plain_steps) for state in batch]
        hopeful = self._hopeful(batch, posteriors, leads, bounds, overlap, steps) if controller.adaptive else [True] * len(batch)
        if by_goodput and any(p and s.routing.unplaced for s, p in zip(batch, posteriors)):
            hopeful = self._place_hopeful(batch, posteriors, leads, bounds, overlap, steps, hopeful)
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

    def _place_hopeful(self, batch, posteriors, leads, bounds, overlap: bool, steps: list[int], hopeful: list[bool]) -> list[bool]:
        """Requests the exemplars have not placed were weighed at their hope anywhere (`posteriors_anywhere`): where
        even that could not make the plan draft for one, it is hopeless wherever it belongs, and its prompt is not
        classified (the exemplar classifier is the largest part of a new request's plan, about 0.4 ms a prompt with
        the demo family, where nothing may draft); it is weighed again HOPE_RECHECK_ROUNDS rounds later. The others
        are placed, and weighed at their domain's posteriors. Returns the round's hopes."""
        router, placed = self.context.router, False
        for i, state in enumerate(batch):
            if not (posteriors[i] and state.routing.unplaced):
                continue
            if hopeful[i]:
                router.place(state.routing)
                posteriors[i], placed = router.posteriors(state.routing), True
            else:
                state.hopeless_until, posteriors[i], bounds[i] = state.rounds + HOPE_RECHECK_ROUNDS, {}, 0
        return self._hopeful(batch, posteriors, leads, bounds, overlap, steps) if placed else hopeful

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
