"""Catching a drafter up (router/cost_model.py `draft_catch_up_ms`, router/speculation.py, router/planning.py
`_catch_up_ms`): a request whose drafter lacks its context pays for feeding it on its first draft.

A request that decoded plainly for a while, or never drafted, has a drafter session that lacks its context; the draft
call feeds it that before it drafts, a prefill a probe pays for; drafting pays for the round's share of it (it buys
the rounds after, few near a request's end). The cost model learns what a token of it costs from the draft calls
that caught up many, and keeps it out of the steps' fit. The costs here are given, not measured."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from router.cost_model import CATCH_UP_TOKENS, CostModel
from router.drafters import DrafterService
from router.planning import Planning
from router.request import RequestSpec, RequestState, SessionMirror
from router.rounds import RoundContext, SchedulerConfig
from router.domains import DomainClassifier
from router.expertise import ExpertiseStore
from router.routing import DrafterProfile, DrafterRouter
from router.speculation import SpeculationController
from specfleet.config import RoutingConfig, SchedulingConfig, SpeculationConfig
from specfleet.sampling import SamplingParams

PLAIN_STEPS = 4


def _controller(per_token: float = 0.1) -> SpeculationController:
    """The cost model of tests/router/test_planning.py (drafting pays from an acceptance of 0.7 at 4 plain steps), with
    a token of catch-up at `per_token` ms."""
    cost = CostModel(
        verify_base=2.0, verify_per_token=0.1, draft_per_token=0.5, draft_base=1.0, verify_call=0.0, draft_call=0.0, pinned=True,
        draft_catch_up_per_token=per_token,
    )  # fmt: skip
    return SpeculationController(cost, settings=SpeculationConfig(remeasure_every=0))


def test_what_a_drafter_lacks_of_a_request():
    """`RequestState.lacking`: what a draft call feeds the drafter's session before it drafts, beyond the last committed
    token (which every draft's first step feeds)."""
    state = _request("s", 10)
    assert state.lacking("code") == 9  # it never drafted for the request: the whole context
    state.drafter_mirrors["code"] = SessionMirror()
    state.drafter_mirrors["code"].held = state.tokens[:-1] + [0]  # it drafted last round: its draft, then a token committed
    assert state.lacking("code") == 0
    state.tokens += [11, 12, 13, 14]  # then the request decoded plainly
    assert state.lacking("code") == 4


def test_a_draft_call_that_caught_up_measures_the_catch_up_and_leaves_the_steps_fit_alone():
    cost = CostModel(draft_base=1.0, draft_per_token=0.5, draft_call=0.0)
    for depth in (1, 4, 1, 4):
        cost.observe_draft(depth, 1.0 + 0.5 * depth)
    steps = (cost.draft_base, cost.draft_per_token)
    assert steps == pytest.approx((1.0, 0.5))
    cost.observe_draft(2, 1.0 + 0.5 * 2 + 0.05 * 100, caught_up=100)  # 100 tokens at 0.05 ms beyond two steps
    assert (cost.draft_base, cost.draft_per_token) == steps
    assert cost.draft_catch_up_per_token == pytest.approx(0.05)
    assert cost.draft_catch_up_ms(40) == pytest.approx(2.0) and cost.draft_catch_up_ms(0) == 0.0
    cost.observe_draft(1, 1.0 + 0.5 + 3.0, caught_up=CATCH_UP_TOKENS - 1)  # a few tokens ride in the call's base
    assert cost.draft_catch_up_per_token == pytest.approx(0.05) and cost.draft_base > steps[0]


def test_drafting_does_not_pay_for_its_drafter_s_catch_up_and_a_probe_does():
    """At 0.9 a request drafts whether its drafter holds its context or lacks 200 tokens of it (20 ms): the catch-up
    buys every later round's drafts (the round's modelled time counts it). A request at k = 0 probes once the rounds
    since the last probe have paid for what it loses, which includes feeding its drafter what it lacks: due with a
    caught-up drafter, not with one that lacks 1,000 tokens."""
    controller = _controller()
    assert controller.plan([0.9], [4], plain_steps=[PLAIN_STEPS], catch_up=[controller.cost.draft_catch_up_ms(200)])[0] > 0
    controller.since_probe_ms = 2_000.0  # the probe's share of it: 100 ms
    assert controller.plan([0.2], [4], plain_steps=[PLAIN_STEPS], hopeful=[True]) == [1]
    controller.since_probe_ms = 2_000.0
    far_behind = [controller.cost.draft_catch_up_ms(1_000)]
    assert controller.plan([0.2], [4], plain_steps=[PLAIN_STEPS], hopeful=[True], catch_up=far_behind) == [0]
    assert not controller.might_draft([0.2], [4], plain_steps=[PLAIN_STEPS], hopeful=[True], catch_up=far_behind)


def test_drafting_near_a_request_s_end_pays_for_the_catch_up_it_cannot_spread():
    """A drafter that lacks 200 tokens of a request (20 ms to feed it) buys every later round's drafts: with 100 tokens
    still to produce, drafting four at 0.9 pays for its round's share (5 of 100) and drafts. With 5 left, the round is
    the catch-up's only one: 20 ms for four tokens more than a plain round's, and the request decodes plainly."""
    controller = _controller()
    behind = [controller.cost.draft_catch_up_ms(200)]
    assert controller.plan([0.9], [4], plain_steps=[PLAIN_STEPS], catch_up=behind, remaining=[100])[0] > 0
    assert controller.plan([0.9], [4], plain_steps=[PLAIN_STEPS], catch_up=behind, remaining=[5]) == [0]
    assert controller.plan([0.9], [4], plain_steps=[PLAIN_STEPS], catch_up=[0.0], remaining=[5])[0] > 0


def _request(session_id: str, context: int) -> RequestState:
    tokens = list(range(1, context + 1))
    spec = RequestSpec(session_id, session_id, tokens, 64, SamplingParams(), [], True, 4, "code")
    return RequestState(spec=spec, tokenizer=None, eos_token_id=0, max_context=4096, deadline=None, tokens=tokens, rounds=1)


def test_the_plan_weighs_what_each_request_s_drafter_lacks():
    """A code request with 300 tokens of context, the code specialist's evidence thin (hope 0.8, mean 0.5: the plan
    would not draft at its mean, and probes it once a probe is due): where the specialist's session holds its tokens
    (it drafted last round) the due probe runs; where it never saw the request, the probe's 299 tokens of catch-up (30
    ms) cost more than the rounds since the last probe allow, and the round decodes plainly."""

    def plan(state: RequestState) -> list[int]:
        profiles = [DrafterProfile("general"), DrafterProfile("code", specialities=["code"])]
        config = RoutingConfig(routing_policy="expertise", default_drafter="general", fusion_width=1)
        router = DrafterRouter(config, profiles, DomainClassifier({}), ExpertiseStore(1.0))
        router.rng.seed(0)
        router.store.add("code", "general", 25.6, 230.4)
        router.store.add("code", "code", 1.0, 4.0)
        service = DrafterService("drafters", [SimpleNamespace(name="drafters-0")])
        settings = SchedulerConfig(SchedulingConfig(plain_steps=PLAIN_STEPS))
        controller = _controller()
        controller.since_probe_ms = 400.0  # a probe may lose 20 ms
        planning = Planning(RoundContext(settings, {"general": service, "code": service}, router, controller))
        state.routing = router.start("def f(x):", domain_hint="code")
        return [r.k for r in planning.plan([state], overlap=False).requests]

    held = _request("held", 300)
    for drafter in ("general", "code"):
        held.drafter_mirrors[drafter] = SessionMirror()
        held.drafter_mirrors[drafter].held = held.tokens[:-1] + [0]  # all but the last committed token, and a draft
    assert plan(held) == [1]
    assert plan(_request("lacking", 300)) == [0]
