"""A round drafts with fewer distinct models where that raises its expected goodput (router/drafting.py
`consolidate`): every distinct model a drafter service runs costs a step at every position, and a request moved
to the best model that stays loses only the difference in expected tokens. The cost model is given, not measured
on this machine."""

from __future__ import annotations

from types import SimpleNamespace

from router.drafters import DrafterService
from router.drafting import Drafting, consolidate, expected_tokens, most_models
from router.rounds import RoundContext, SchedulerConfig
from router.routing import DomainClassifier, DrafterProfile, DrafterRouter, ExpertiseStore
from router.speculation import CostModel, SpeculationController
from specfleet.config import RoutingConfig

# One service hosting every specialist, as the bundled demo drafters are served.
SERVICE = object()
SERVICES = {name: SERVICE for name in ("general", "code", "german", "french")}


def cost(per_step_ms: float) -> CostModel:
    return CostModel(
        verify_base=10.0, verify_per_token=0.3, draft_per_token=per_step_ms, draft_base=0.0, verify_call=0.0, draft_call=0.0, pinned=True
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
    """Drafting.usable: the drafters on a service whose every replica the breaker skips are not candidates."""
    replicas = {"left": [SimpleNamespace(name="left-0")], "right": [SimpleNamespace(name="right-0"), SimpleNamespace(name="right-1")]}
    services = {name: DrafterService(name, replicas[name]) for name in replicas}
    hosted = {"general": services["left"], "code": services["right"], "german": services["right"]}
    router = DrafterRouter(RoutingConfig(), [DrafterProfile(name) for name in hosted], DomainClassifier({}), ExpertiseStore(0.99))
    drafting = Drafting(RoundContext(SchedulerConfig(), hosted, router, SpeculationController(cost(1.0))), in_background=lambda coroutine: None)
    assert drafting.usable() == ["general", "code", "german"]
    drafting.breaker.failed("left-0")
    drafting.breaker.failed("right-0")
    assert drafting.usable() == ["code", "german"]  # right-1 still answers


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
