"""Who drafts for each request of a round (router/drafter_choice.py), by the round's expected goodput.

`consolidate`: a round drafts with fewer distinct models where that raises its expected goodput: every distinct
model a drafter service runs costs a step at every position, and a request moved to the best model that stays
loses only the difference in expected tokens. `cooperate`: a request gets helpers where the tokens they are
expected to add pay for the tree rows and model steps they cost. The cost model is given, not measured on this
machine."""

from __future__ import annotations

import random
from types import SimpleNamespace

from router.drafters import DrafterService
from router.drafter_choice import AcceptanceScale, DraftFill, FusionGain, consolidate, cooperate, expected_tokens, fused_tokens, most_models
from router.planning import Planning
from router.request import RequestSpec, RequestState
from router.rounds import RequestPlan, RoundContext, SchedulerConfig
from router.domains import DomainClassifier
from router.expertise import ExpertiseStore
from router.routing import DrafterProfile, DrafterRouter
from router.cost_model import CostModel
from router.speculation import SpeculationController
from specfleet.config import RoutingConfig, SpeculationConfig
from specfleet.sampling import SamplingParams

# One service hosting every specialist, as the bundled demo drafters are served.
SERVICE = object()
SERVICES = {name: SERVICE for name in ("general", "code", "german", "french")}


def cost(per_step_ms: float, per_row_ms: float = 0.3) -> CostModel:
    return CostModel(
        verify_base=10.0,
        verify_per_token=per_row_ms,
        draft_per_token=per_step_ms,
        draft_base=0.0,
        verify_call=0.0,
        draft_call=0.0,
        pinned=True,
    )


def means(best: str, best_acceptance: float, general: float) -> dict[str, float]:
    return {name: (best_acceptance if name == best else general if name == "general" else 0.2) for name in SERVICES}


def test_each_distinct_model_costs_a_step_per_position():
    model = cost(2.0)
    assert model.draft_ms(4, 3) == 3 * model.draft_ms(4, 1) == 24.0
    assert most_models([["code"], ["german"], ["code"], []], SERVICES) == 2
    assert most_models([["code"], ["german"]], {"code": object(), "german": object()}) == 1  # two services, one model each


def test_dear_steps_send_every_request_to_the_model_most_of_them_share():
    """Specialists a little better than the general drafter, steps dear: one model serves the round better."""
    chosen = [["code"], ["german"], ["general"], ["general"]]
    acceptance = [means("code", 0.7, 0.6), means("german", 0.7, 0.6), means("general", 0.6, 0.6), means("general", 0.6, 0.6)]
    bounds = [4] * 4
    model = cost(3.0)
    out = consolidate(chosen, acceptance, bounds, SERVICES, model)
    assert out == [["general"]] * 4

    def goodput(assignment):
        tokens = sum(expected_tokens(acceptance[i][d[0]], 4) for i, d in enumerate(assignment))
        return tokens / (model.verify_ms(4, 20) + model.draft_ms(4, most_models(assignment, SERVICES)))

    assert goodput(out) > goodput(chosen)


def test_a_model_no_request_leads_with_may_take_the_whole_round():
    """Three requests routed to three specialists a little better than the general drafter, steps dear: the general
    drafter alone serves the round better, though no request chose it; never one the breaker skips (not usable), and
    not where steps are cheap."""
    chosen = [["code"], ["german"], ["french"]]
    acceptance = [means("code", 0.7, 0.6), means("german", 0.7, 0.6), means("french", 0.7, 0.6)]
    assert consolidate(chosen, acceptance, [4] * 3, SERVICES, cost(3.0), usable=SERVICES) == [["general"]] * 3
    without = consolidate(chosen, acceptance, [4] * 3, SERVICES, cost(3.0), usable=["code", "german", "french"])
    assert all(d != ["general"] for d in without)
    assert consolidate(chosen, acceptance, [4] * 3, SERVICES, cost(0.05), usable=SERVICES) == chosen


def test_a_round_moves_no_request_to_a_drafter_whose_service_is_skipped():
    """Planning.usable: the drafters on a service whose every replica the breaker skips are not candidates."""
    replicas = {"left": [SimpleNamespace(name="left-0")], "right": [SimpleNamespace(name="right-0"), SimpleNamespace(name="right-1")]}
    services = {name: DrafterService(name, replicas[name]) for name in replicas}
    hosted = {"general": services["left"], "code": services["right"], "german": services["right"]}
    router = DrafterRouter(RoutingConfig(), [DrafterProfile(name) for name in hosted], DomainClassifier({}), ExpertiseStore(0.99))
    planning = Planning(RoundContext(SchedulerConfig(), hosted, router, SpeculationController(cost(1.0))))
    assert planning.usable() == ["general", "code", "german"]
    planning.breaker.failed("left-0")
    planning.breaker.failed("right-0")
    assert planning.usable() == ["code", "german"]  # right-1 still answers


def test_cheap_steps_or_much_better_specialists_keep_the_routing():
    chosen = [["code"], ["german"], ["general"]]
    acceptance = [means("code", 0.7, 0.6), means("german", 0.7, 0.6), means("general", 0.6, 0.6)]
    assert consolidate(chosen, acceptance, [4] * 3, SERVICES, cost(0.05)) == chosen
    acceptance = [means("code", 0.9, 0.2), means("german", 0.9, 0.2)]
    assert consolidate(chosen[:2], acceptance, [4] * 2, SERVICES, cost(1.0)) == chosen[:2]


def test_cooperating_drafters_keep_their_models_and_plain_requests_stay_plain():
    chosen = [["code", "general"], ["german"], []]
    acceptance = [means("code", 0.7, 0.6), means("german", 0.7, 0.65), {}]
    out = consolidate(chosen, acceptance, [4, 4, 0], SERVICES, cost(3.0))
    assert out[0] == ["code", "general"] and out[2] == []
    assert out[1] in (["code"], ["general"])  # german leaves for a model the fused request keeps anyway


def test_the_cost_model_learns_what_a_model_step_costs_from_calls_with_several_models():
    """Calls with one, two and three distinct models, 2 ms a model step plus 1 ms a call: the fit separates them."""
    model = CostModel(draft_per_token=0.5, draft_base=0.0)
    for _ in range(20):
        for models in (1, 2, 3):
            model.observe_draft(4, 1.0 + 2.0 * 4 * models, models)
    assert abs(model.draft_per_token - 2.0) < 0.01 and abs(model.draft_base - 1.0) < 0.05


def test_fused_tokens_is_the_chain_without_helpers_and_adds_each_helpers_paths():
    assert abs(fused_tokens(0.6, 4, []) - expected_tokens(0.6, 4)) < 1e-12
    # Lead 0.5, a helper of 0.4 two positions deep. A chain of its own: a path of length i is the lead's chain or
    # the helper's, 1 + [1 - 0.5 * 0.6] + [1 - 0.75 * 0.84].
    assert abs(fused_tokens(0.5, 2, [(0.4, 2, False)]) - (1 + 0.7 + 0.37)) < 1e-12
    # In lockstep its proposals are siblings on the main branch: position 2 is reached only through the main token
    # at 1, 1 + [1 - 0.5 * 0.6] + 0.5 * [1 - 0.5 * 0.6].
    assert abs(fused_tokens(0.5, 2, [(0.4, 2, True)]) - (1 + 0.7 + 0.35)) < 1e-12
    # A helper one position deep adds at position 1 only.
    assert abs(fused_tokens(0.5, 2, [(0.4, 1, False)]) - (1 + 0.7 + 0.25)) < 1e-12


TWO_SERVICES = {"general": object(), "code": object()}


def test_a_helper_on_another_service_joins_where_its_tokens_pay_for_its_rows():
    """A chain from another service costs the verifier its rows, not a step of the lead's service: at 0.3 ms a row
    it pays; at 5 ms a row it does not."""
    acceptance = [{"general": 0.5, "code": 0.5}]
    taken, gains = cooperate([["general", "code"]], [4], acceptance, TWO_SERVICES, cost(2.0))
    assert taken == [["general", "code"]]
    assert abs(gains[0] - (fused_tokens(0.5, 4, [(0.5, 4, False)]) - expected_tokens(0.5, 4))) < 1e-12
    dear_rows = CostModel(verify_base=10.0, verify_per_token=5.0, draft_per_token=2.0, draft_base=0.0, verify_call=0.0, draft_call=0.0, pinned=True)
    assert cooperate([["general", "code"]], [4], acceptance, TWO_SERVICES, dear_rows) == ([["general"]], [0.0])


def test_a_helper_in_lockstep_pays_only_where_its_model_step_is_cheap():
    """On the lead's service a helper adds its model's step at every position: dear steps leave it out."""
    acceptance = [{"general": 0.5, "code": 0.5}]
    assert cooperate([["general", "code"]], [4], acceptance, SERVICES, cost(3.0))[0] == [["general"]]
    assert cooperate([["general", "code"]], [4], acceptance, SERVICES, cost(0.05))[0] == [["general", "code"]]
    # One position deep, its model steps once, not at all four: at 2 ms a step that pays, at four steps it would not.
    assert cooperate([["general", "code"]], [4], acceptance, SERVICES, cost(2.0, per_row_ms=0.0), fusion_depth=1)[0] == [["general", "code"]]
    assert cooperate([["general", "code"]], [4], acceptance, SERVICES, cost(2.0, per_row_ms=0.0), fusion_depth=4)[0] == [["general"]]


def test_a_drafter_that_runs_no_model_adds_no_step():
    """The n-gram drafter beside the lead on its service costs no model step: it helps where a model would not, and a
    round of it alone drafts at the call's base cost."""
    acceptance = [{"general": 0.5, "code": 0.5}]
    assert cooperate([["general", "code"]], [4], acceptance, SERVICES, cost(3.0), free=frozenset({"code"}))[0] == [["general", "code"]]
    assert most_models([["code"], ["general"]], SERVICES, free=frozenset({"code"})) == 1
    assert most_models([["code"]], SERVICES, free=frozenset({"code"})) == 0
    assert cost(3.0).draft_ms(4, 0) == 0.0 and cost(3.0).draft_ms(0, 1) == 0.0


def test_a_model_step_is_paid_once_for_every_request_it_helps():
    """Eight requests whose helper's step on the lead's service pays for all of them together, though not for any
    one of them alone beside the seven others: the step is weighed once against every request it helps."""
    acceptance = {"general": 0.5, "code": 0.5}
    step = cost(0.3, per_row_ms=0.0)
    taken, _ = cooperate([["general", "code"]] * 8, [4] * 8, [acceptance] * 8, SERVICES, step, fusion_depth=1)
    assert taken == [["general", "code"]] * 8
    alone = expected_tokens(0.5, 4) * 7 + fused_tokens(0.5, 4, [(0.5, 1, True)])
    assert alone / (10 + step.draft_steps_ms(4 + 1)) < 8 * expected_tokens(0.5, 4) / (10 + step.draft_steps_ms(4))


def test_no_helper_for_a_plain_request_nor_where_helpers_add_nothing():
    acceptance = [{"general": 0.5, "code": 0.5}] * 2
    taken, _ = cooperate([["general", "code"]] * 2, [4, 0], acceptance, TWO_SERVICES, cost(2.0))
    assert taken == [["general", "code"], []]
    assert cooperate([["general", "code"]], [4], acceptance[:1], TWO_SERVICES, cost(2.0), efficiency=0.0)[0] == [["general"]]


def test_what_helpers_add_is_measured_against_what_was_expected_of_them():
    gain = FusionGain()
    assert gain.efficiency == FusionGain.PRIOR
    for _ in range(200):
        gain.observe(expected=0.4, added=0)
    assert gain.efficiency < 0.06
    for _ in range(400):
        gain.observe(expected=0.4, added=0.3)
    assert abs(gain.efficiency - 0.75) < 0.05


def _request(session_id: str, max_draft_tokens: int = 4) -> RequestState:
    spec = RequestSpec(
        request_id=session_id,
        session_id=session_id,
        prompt_ids=[1, 2, 3],
        max_tokens=32,
        sampling=SamplingParams(),
        stop=[],
        stop_at_eos=True,
        max_draft_tokens=max_draft_tokens,
        domain="code",
    )
    return RequestState(spec=spec, tokenizer=None, eos_token_id=0, max_context=512, deadline=None, tokens=[1, 2, 3], rounds=1)


def test_a_round_plans_helpers_by_goodput_with_adaptive_speculation_and_by_fusion_below_without():
    """Through `Planning.plan`: with adaptive speculation a helper on another service, whose rows cost nothing,
    joins whatever fusion_below says, and the plan records what it is expected to add; with fusion_width 1 there is none; with
    adaptive speculation off routing's fusion_below rule alone decides."""
    replicas = {name: DrafterService(name, [SimpleNamespace(name=f"{name}-0")]) for name in ("left", "right")}
    hosted = {"general": replicas["left"], "code": replicas["right"]}
    profiles = [DrafterProfile("general"), DrafterProfile("code", specialities=["code"])]

    def plan(fusion_width: int, adaptive: bool, fusion_below: float = 0.0):
        config = RoutingConfig(routing_policy="expertise", default_drafter="general", fusion_width=fusion_width, fusion_below=fusion_below)
        router = DrafterRouter(config, profiles, DomainClassifier({}), ExpertiseStore(0.99))
        controller = SpeculationController(cost(0.5, per_row_ms=0.0), settings=SpeculationConfig(adaptive_speculation=adaptive, remeasure_every=0))
        planning = Planning(RoundContext(SchedulerConfig(), hosted, router, controller))
        batch = [_request(f"s{i}") for i in range(2)]
        for state in batch:
            state.routing = router.start("def f(x):", domain_hint="code")
        return planning.plan(batch, overlap=False).requests

    fused = plan(fusion_width=2, adaptive=True)
    assert all(len(r.drafters) == 2 and r.k > 0 and r.expected_gain > 0 for r in fused)
    assert all(len(r.drafters) == 1 and r.expected_gain == 0 for r in plan(fusion_width=1, adaptive=True))
    assert all(len(r.drafters) == 1 for r in plan(fusion_width=2, adaptive=False, fusion_below=0.0))
    assert all(len(r.drafters) == 2 and r.expected_gain == 0 for r in plan(fusion_width=2, adaptive=False, fusion_below=1.01))


def test_verification_measures_what_the_helpers_added():
    """A round whose lead's chain missed at once and whose helper's chain was accepted two deep: the helpers added
    two tokens against the gain the plan expected, and the lead gained none of what routing predicted of it. A round
    with no expected gain (fusion by fusion_below, or no helper) teaches helpers nothing."""
    from router.trees import DraftTree
    from router.verifying import Verifying
    from tests.router.test_trees import chain

    router = DrafterRouter(
        RoutingConfig(routing_policy="expertise"), [DrafterProfile("general"), DrafterProfile("code")], DomainClassifier({}), ExpertiseStore(0.99)
    )
    controller = SpeculationController(cost(1.0))
    verifying = Verifying(RoundContext(SchedulerConfig(), {}, router, controller), verifiers=None)
    state = _request("s0")
    state.routing = router.start("x", domain_hint="")
    tree = DraftTree()
    tree.add_chain("general", chain([5, 6, 7, 8]))
    tree.add_chain("code", chain([9, 10]))  # nodes 4 and 5
    fused = RequestPlan(state, ["general", "code"], [4, 2], [], expected_gain=0.5, acceptance=0.6)
    verifying._learn(fused, tree, accepted_nodes=[4, 5], emitted=[9, 10, 11])
    assert (controller.fusion_gain.expected, controller.fusion_gain.added) == (0.5, 2)
    # The lead, predicted at 0.6 a position for four, gained nothing itself.
    assert controller.acceptance_scale._sums == {"general": (0, [0.6, 0.6**2, 0.6**3, 0.6**4])}
    # Both filled what they were asked: 4 of 4 and 2 of 2 positions.
    assert controller.fill._sums == {"general": (4, 4), "code": (2, 2)}
    verifying._learn(RequestPlan(state, ["general", "code"], [4, 2], []), tree, accepted_nodes=[4], emitted=[9, 3])
    assert (controller.fusion_gain.expected, controller.fusion_gain.added) == (0.5, 2)


def test_a_drafter_that_fills_few_of_its_positions_is_charged_the_rows_it_fills():
    """The n-gram drafter proposes only where a suffix of the context occurred before: measured to fill a third of
    what it is asked, a round charges it a third of the rows. The plan then asks it for more positions where rows are
    dear, and a round moves its requests to it where that pays, though its acceptance is lower."""
    fill = DraftFill()
    assert fill.rate("ngram") == 1.0
    for _ in range(300):
        fill.observe("ngram", proposed=1, asked=3)
        fill.observe("general", proposed=4, asked=4)
    assert abs(fill.rate("ngram") - 1 / 3) < 0.02 and fill.rate("general") == 1.0
    dear_rows = CostModel(verify_base=5.0, verify_per_token=1.5, draft_per_token=0.5, draft_base=0.0, verify_call=0.0, draft_call=0.0, pinned=True)
    controller = SpeculationController(dear_rows, settings=SpeculationConfig(remeasure_every=0))
    (full,) = controller.plan([0.6], [8])
    (third,) = controller.plan([0.6], [8], fill=[1 / 3])
    assert third > full
    # Four requests, general at 0.6; the n-gram drafter at 0.5 runs no model and fills a third of its rows.
    chosen, bounds = [["general"]] * 4, [4] * 4
    acceptance = [{"general": 0.6, "ngram": 0.5}] * 4
    services = {"general": SERVICE, "ngram": SERVICE}
    free = frozenset({"ngram"})
    assert consolidate(chosen, acceptance, bounds, services, dear_rows, usable=["general", "ngram"], free=free, fill=fill) == [["ngram"]] * 4
    assert consolidate(chosen, acceptance, bounds, services, dear_rows, usable=["general", "ngram"], free=free) == chosen


def test_a_drafter_whose_leads_gain_less_than_routing_predicts_is_weighed_by_what_they_gain():
    """Leading at a predicted per-token acceptance of 0.6 for four positions (1.31 tokens expected beyond the
    target's own), rounds that gained one token each bring the drafter's scale c to where sum_j (0.6 c)^j = 1; one
    whose leads gain what routing predicts keeps c near 1; one that never led keeps 1."""
    scale = AcceptanceScale()
    predicted = sum(0.6**j for j in range(1, 5))
    for _ in range(2000):
        scale.observe("code", 0.6, 4, hits=1)
        for hits in (0, 1, 1, 1):  # 0.75 a round, as 0.5 + 0.25 predicts
            scale.observe("general", 0.5, 2, hits=hits)
    c = scale.scale("code")
    assert abs(sum((0.6 * c) ** j for j in range(1, 5)) - 1.0) < 0.01 and predicted > 1.3 and c < 0.9
    assert abs(scale.scaled("code", 0.6) - 0.6 * c) < 1e-12
    assert abs(scale.scale("general") - 1.0) < 0.01
    assert scale.scale("french") == 1.0 and scale.scaled("french", 0.995) == AcceptanceScale.MOST


def test_a_round_weighs_each_lead_by_what_its_leads_gained():
    """Through `Planning.plan`, one request in the code specialist's domain: routing's prior makes the specialist its
    lead (0.8 per token); once its leads are measured to gain nothing (routing's own evidence unchanged), the round
    moves the request to the general drafter. The plan records routing's own prediction for the lead."""
    service = DrafterService("drafters", [SimpleNamespace(name="drafters-0")])
    profiles = [DrafterProfile("general"), DrafterProfile("code", specialities=["code"])]
    router = DrafterRouter(RoutingConfig(routing_policy="expertise", default_drafter="general"), profiles, DomainClassifier({}), ExpertiseStore(0.99))
    controller = SpeculationController(cost(0.5, per_row_ms=0.1), settings=SpeculationConfig(remeasure_every=0))
    context = RoundContext(SchedulerConfig(), {"general": service, "code": service}, router, controller)
    planning = Planning(context)
    state = _request("s0")
    state.routing = router.start("def f(x):", domain_hint="code")
    (before,) = planning.plan([state], overlap=False).requests
    assert before.drafters == ["code"] and before.k > 0 and before.acceptance == router.mean(state.routing, "code")
    for _ in range(300):  # what verification measures (`test_verification_measures_what_the_helpers_added`)
        controller.acceptance_scale.observe("code", 0.8, 4, hits=0)
    assert abs(controller.acceptance_scale.scale("code") - AcceptanceScale.LOW) < 1e-6
    (after,) = planning.plan([state], overlap=False).requests
    assert after.drafters == ["general"], after.drafters


def test_a_round_the_measured_check_sends_to_plain_decoding_routes_nothing_and_scores_no_prompt():
    """Where rounds that draft were measured slower than plain ones at this load (router/measured_goodput.py), the
    round decodes plainly without routing: no drafter, no prompt placed (so none scored beside it), the plan marked
    unrouted; with drafting measured ahead the same requests are routed and draft."""
    service = DrafterService("left", [SimpleNamespace(name="left-0")])
    hosted = {"general": service, "code": service}
    exemplars = DomainClassifier({"code": ["def f(x): return x"], "en": ["the cat sat on the mat"]})
    config = RoutingConfig(routing_policy="expertise", default_drafter="general", exemplar_margin=0.01)
    profiles = [DrafterProfile("general"), DrafterProfile("code", specialities=["code"])]

    def plan(plain_ms: float, drafting_ms: float, max_draft_tokens: int = 4):
        router = DrafterRouter(config, profiles, exemplars, ExpertiseStore(0.99))
        controller = SpeculationController(cost(0.5), settings=SpeculationConfig(remeasure_every=32))
        for _ in range(40):  # two requests running: plain rounds commit one token each, drafting rounds two
            controller.observe_round(2, 2, plain_ms, speculated=False, running=2)
            controller.observe_round(2, 4, drafting_ms, speculated=True, running=2)
        planning = Planning(RoundContext(SchedulerConfig(), hosted, router, controller))
        batch = [_request(f"s{i}", max_draft_tokens) for i in range(2)]
        for state in batch:
            state.routing = router.start("def f(x): return x", domain_hint="", drafts=max_draft_tokens > 0)
        return planning.plan(batch, overlap=False, running=2), batch

    plain, batch = plan(plain_ms=4.0, drafting_ms=12.0)  # drafting: 2 tokens in 12 ms against 1 in 4
    assert not plain.routed and all(r.k == 0 and not r.drafters for r in plain.requests)
    assert all(s.routing.needs_scores for s in batch) and plain.to_score() == [], "no prompt placed or scored unrouted"
    routed, batch = plan(plain_ms=8.0, drafting_ms=9.0)
    assert routed.routed and all(r.k > 0 for r in routed.requests)
    assert not any(s.routing.needs_scores for s in batch)  # the exemplars placed them
    batch[0].routing.needs_scores = batch[0].routing.scorable = True  # one the exemplars could not place: scored in a round that routes
    assert routed.to_score() == [batch[0]]
    # A round none of whose requests drafts at all (speculation off for each) decodes plainly, unrouted, whatever
    # the check measured: it is plain decoding's round, not speculating's.
    assert not plan(plain_ms=8.0, drafting_ms=9.0, max_draft_tokens=0)[0].routed


def scoring_setup() -> tuple[DrafterRouter, SpeculationController, Planning]:
    """A general drafter and a code specialist on one service, exemplars that place no prompt for sure, a controller
    with the measured check on, and the round planning over them: (the router, the controller, the planning)."""
    service = DrafterService("left", [SimpleNamespace(name="left-0")])
    hosted = {"general": service, "code": service}
    exemplars = DomainClassifier({"code": ["def f(x): return x"], "en": ["the cat sat on the mat"]})
    config = RoutingConfig(routing_policy="expertise", default_drafter="general", exemplar_margin=100.0)  # nothing sure
    router = DrafterRouter(config, [DrafterProfile("general"), DrafterProfile("code", specialities=["code"])], exemplars, ExpertiseStore(0.99))
    controller = SpeculationController(cost(0.5), settings=SpeculationConfig(remeasure_every=32))
    return router, controller, Planning(RoundContext(SchedulerConfig(), hosted, router, controller))


def test_a_prompt_first_decoded_plainly_by_the_measured_check_is_placed_by_the_exemplars_not_scored():
    """A request whose first round the check decoded plainly, unrouted, is not scored when a round routes it: the
    exemplars' best guess places it, so that a round that speculates again does not pay for every prompt that arrived
    while the lane decoded plainly. Nor is one whose first round speculates only to remeasure speculating. A request
    routed from its first round while speculating is not measured to lose is scored as before."""
    router, controller, planning = scoring_setup()
    for _ in range(40):  # plain decoding measured ahead
        controller.observe_round(2, 2, 4.0, speculated=False, running=2)
        controller.observe_round(2, 4, 12.0, speculated=True, running=2)
    early = _request("early")
    early.routing = router.start("def f(x): return x", domain_hint="")
    assert not planning.plan([early], overlap=False, running=2).routed
    for _ in range(32):  # plain rounds until speculating is due to be remeasured
        controller.observe_round(2, 2, 4.0, speculated=False, running=2)
    remeasured = _request("remeasured")
    remeasured.routing = router.start("def f(x): return x", domain_hint="")
    plan = planning.plan([remeasured], overlap=False, running=2)
    assert plan.routed and plan.to_score() == [], "a round that only remeasures speculating scores no prompt"
    assert not remeasured.routing.needs_scores and remeasured.routing.domain == "code"
    controller.settings = SpeculationConfig(remeasure_every=0)  # from now on every round routes
    late = _request("late")
    late.routing = router.start("def f(x): return x", domain_hint="")
    routed = planning.plan([early, late], overlap=False, running=2)
    assert routed.routed and routed.to_score() == [late]
    assert not early.routing.needs_scores and early.routing.domain == "code"


def test_prompts_are_scored_only_where_speculating_is_measured_to_pay():
    """The specialists' scoring of a new prompt (a prefill each) buys better drafting, which pays only where drafting
    does: on a cold start, before speculating is measured against plain decoding, the exemplars place the prompt;
    once speculating is measured ahead at the load, new prompts are scored."""
    router, controller, planning = scoring_setup()
    cold = _request("cold")
    cold.routing = router.start("def f(x): return x", domain_hint="")
    plan = planning.plan([cold], overlap=False, running=2)
    assert plan.routed and plan.to_score() == [], "a cold start scores no prompt"
    assert not cold.routing.needs_scores and cold.routing.domain == "code"  # the exemplars' best guess
    for _ in range(3):  # speculating's rounds draft; plain decoding is not measured yet
        controller.observe_round(2, 4, 9.0, speculated=True, running=2, drafted=True)
    unmeasured = _request("unmeasured")
    unmeasured.routing = router.start("def f(x): return x", domain_hint="")
    plan = planning.plan([unmeasured], overlap=False, running=2)
    assert plan.routed and plan.to_score() == [], "speculating not yet measured against plain decoding"
    for _ in range(40):  # speculating measured ahead: two tokens a request in 9 ms against one in 8
        controller.observe_round(2, 2, 8.0, speculated=False, running=2)
        controller.observe_round(2, 4, 9.0, speculated=True, running=2, drafted=True)
    warm = _request("warm")
    warm.routing = router.start("def f(x): return x", domain_hint="")
    assert planning.plan([warm], overlap=False, running=2).to_score() == [warm]


def test_prompts_are_not_scored_where_speculating_s_rounds_drafted_for_nobody_lately():
    """Speculating measured ahead beyond the noise, but by rounds the plan routed and drafted in for nobody (plain
    rounds, whichever way the check counts them): the lead is chance, and scoring would buy drafting that does not
    happen. One drafting round among the last few is enough to score again."""
    router, controller, planning = scoring_setup()
    for _ in range(40):
        controller.observe_round(2, 2, 8.0, speculated=False, running=2)
        controller.observe_round(2, 4, 9.0, speculated=True, running=2)
    assert controller.measured.speculating_wins(2) and not controller.measured.drafted_lately(2)
    plain = _request("plain")
    plain.routing = router.start("def f(x): return x", domain_hint="")
    assert planning.plan([plain], overlap=False, running=2).to_score() == []
    controller.observe_round(2, 4, 9.0, speculated=True, running=2, drafted=True)
    again = _request("again")
    again.routing = router.start("def f(x): return x", domain_hint="")
    assert planning.plan([again], overlap=False, running=2).to_score() == [again]


def test_prompts_are_not_scored_where_speculating_and_plain_decoding_are_level():
    """Rounds that speculate deliver what plain rounds do, within their spread: a prefill by every specialist would
    buy drafting that does not pay. Speculating's point estimate is ahead here, by chance; only ahead beyond the noise
    does scoring pay."""
    router, controller, planning = scoring_setup()
    rng = random.Random(0)
    for _ in range(40):
        controller.observe_round(2, 16, 14.0 * rng.uniform(0.9, 1.1), speculated=False, running=2)
        controller.observe_round(2, 16, 14.0 * rng.uniform(0.9, 1.1), speculated=True, running=2, drafted=True)
    measured = controller.measured
    assert measured.goodput(2, speculated=True) > measured.goodput(2, speculated=False)
    assert not measured.speculating_wins(2) and not measured.speculating_loses(2)
    level = _request("level")
    level.routing = router.start("def f(x): return x", domain_hint="")
    assert planning.plan([level], overlap=False, running=2).to_score() == []
