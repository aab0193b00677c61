"""Whether a new prompt is scored: not once recent rounds led every domain with the same drafter
(router/lead_tally.py), and again once two domains' leads differ."""

from __future__ import annotations

import asyncio

from router.drafters import DrafterService
from router.planning import Planning
from router.lead_tally import LeadTally
from router.request import RequestSpec, RequestState
from router.rounds import RoundContext, SchedulerConfig
from router.domains import DomainClassifier
from router.expertise import ExpertiseStore
from router.routing import DrafterProfile, DrafterRouter
from router.cost_model import CostModel
from router.speculation import SpeculationController
from router.transport import GrpcDrafter
from specfleet.config import RoutingConfig, SpeculationConfig
from specfleet.sampling import SamplingParams

EXEMPLARS = {
    "code": ["def main(argv):\n    return 0\n", "import os\nfor x in range(10):\n    print(x)\n"],
    "prose": ["It was a bright cold day in April, and the clocks were striking thirteen.", "She walked slowly along the river."],
}


def test_a_domain_matters_until_two_known_domains_share_one_lead():
    tally = LeadTally(min_rounds=8)
    assert tally.domain_matters()  # nothing known: scoring is how the leads are learned
    for _ in range(8):
        tally.observe("code", "ngram")
    assert tally.leads() == {"code": "ngram"} and tally.domain_matters()  # one domain shows no independence
    for _ in range(7):
        tally.observe("prose", "ngram")
    assert tally.domain_matters()  # prose not known yet: seven rounds
    tally.observe("prose", "ngram")
    assert not tally.domain_matters()
    tally.observe("", "general")  # requests nothing classifies name no domain
    assert not tally.domain_matters()


def test_a_domain_whose_lead_changes_makes_scoring_pay_again():
    tally = LeadTally(min_rounds=8, forget=0.9)
    for domain in ("code", "prose"):
        for _ in range(20):
            tally.observe(domain, "ngram")
    assert not tally.domain_matters()
    for _ in range(10):
        tally.observe("code", "code")
    assert tally.leads() == {"code": "code", "prose": "ngram"} and tally.domain_matters()


def make_router(drafters=("code", "prose", "ngram")) -> DrafterRouter:
    profiles = [DrafterProfile(d, [d] if d in EXEMPLARS else [], model_free=d == "ngram") for d in drafters]
    config = RoutingConfig(routing_policy="expertise", default_drafter="ngram", exemplar_margin=0)  # every prompt scored
    return DrafterRouter(config, profiles, DomainClassifier(EXEMPLARS), ExpertiseStore(decay=0.98), seed=1)


def test_a_prompt_is_placed_by_the_exemplars_once_every_domain_has_the_same_lead():
    router = make_router()
    first = router.start("def f(x):\n    return x\n")
    router.place(first)
    assert first.needs_scores  # no lead known: the specialists score it
    for domain in ("code", "prose"):
        for _ in range(8):
            router.leads.observe(domain, "ngram")
    later = router.start("def g(y):\n    return y\n")
    router.place(later)
    assert not later.needs_scores and later.domain == "code"  # the exemplars' guess
    for _ in range(20):
        router.leads.observe("prose", "prose")
    again = router.start("The river ran past the mill.")
    router.place(again)
    assert again.needs_scores


def request(session: str, domain_router: DrafterRouter, prompt: str) -> RequestState:
    spec = RequestSpec(session, session, list(range(1, 33)), 64, SamplingParams(), [], False, 4, "")
    state = RequestState(spec, None, 0, 4096, None, tokens=list(range(1, 33)), rounds=1)
    state.routing = domain_router.start(prompt, domain_hint="code")
    return state


def test_a_round_s_plan_tallies_the_lead_of_every_request_it_drafts_for():
    """The plan (router/planning.py) tallies each drafting request's lead under its domain; a request it decodes
    plainly adds nothing. Nothing is called: the plan only weighs the round (its gRPC channel stays unused)."""
    router = make_router()
    plan = asyncio.run(_plan(router))
    leads = [r.drafters[0] for r in plan.requests if r.k > 0]
    assert len(leads) == 1 and router.leads._counts["code"] == {leads[0]: 1.0}


async def _plan(router: DrafterRouter):
    services = {name: DrafterService("drafters", [GrpcDrafter("drafters", "127.0.0.1:9")]) for name in router.drafters}
    # Catching a drafter up costs nothing here: the plan drafts by acceptance alone (tests/router/test_catch_up.py).
    controller = SpeculationController(CostModel(pinned=True, draft_catch_up_per_token=0.0), settings=SpeculationConfig(remeasure_every=0))
    planning = Planning(RoundContext(SchedulerConfig(), services, router, controller))
    batch = [request("a", router, "def f(): pass"), request("b", router, "def g(): pass")]
    batch[1].spec.max_draft_tokens = 0
    return planning.plan(batch, overlap=False)
