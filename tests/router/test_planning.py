"""Planning a round (router/planning.py `Planning.plan`): where nobody could draft, nothing is ranked or probed; a
request's first round decodes plainly.

Each request's hope is the best acceptance its drafters' posteriors leave plausible (router/drafter_choice.py
`upper_acceptance`). A round in which the plan would draft for nobody even at those hopes decodes plainly without
ranking drafters; a request whose evidence is thin still probes. The cost model is given, not measured here."""

from __future__ import annotations

from types import SimpleNamespace

from router.cost_model import CostModel
from router.drafter_choice import upper_acceptance
from router.drafters import DrafterService
from router.planning import HOPE_RECHECK_ROUNDS, Planning
from router.request import RequestSpec, RequestState
from router.rounds import RoundContext, SchedulerConfig
from router.domains import DomainClassifier
from router.expertise import ExpertiseStore
from router.routing import DrafterProfile, DrafterRouter
from router.speculation import SpeculationController
from specfleet.config import RoutingConfig, SchedulingConfig, SpeculationConfig
from specfleet.sampling import SamplingParams

PLAIN_STEPS = 4  # what a round nobody drafts in decodes a request here (the cost model below is calibrated at it)


def _controller(remeasure_every: int = 0) -> SpeculationController:
    """Two requests decoding PLAIN_STEPS plain steps a round: drafting pays from an acceptance of 0.7 (checked below)."""
    cost = CostModel(verify_base=2.0, verify_per_token=0.1, draft_per_token=0.5, draft_base=1.0, verify_call=0.0, draft_call=0.0, pinned=True)
    return SpeculationController(cost, settings=SpeculationConfig(remeasure_every=remeasure_every))


def _request(session_id: str) -> RequestState:
    spec = RequestSpec(
        request_id=session_id,
        session_id=session_id,
        prompt_ids=[1, 2, 3],
        max_tokens=64,
        sampling=SamplingParams(),
        stop=[],
        stop_at_eos=True,
        max_draft_tokens=4,
        domain="code",
    )
    state = RequestState(spec=spec, tokenizer=None, eos_token_id=0, max_context=512, deadline=None, tokens=[1, 2, 3])
    state.rounds = 1  # past its first round: a plain round decodes its plain steps
    return state


def _plans(code_accepted: float, code_rejected: float, rounds: int, first_rounds: int = 0) -> tuple[list, int, int]:
    """`rounds` plans of two code requests, the general drafter (ranked first) accepting a tenth of 256 tokens and
    the code specialist what it is given, the first `first_rounds` requests in their first round: (the plans, how many
    times a drafter was ranked for a request, how many times the plan was asked whether it might draft at the means)."""
    service = DrafterService("left", [SimpleNamespace(name="left-0")])
    config = RoutingConfig(routing_policy="expertise", default_drafter="general", fusion_width=1)
    profiles = [DrafterProfile("general"), DrafterProfile("code", specialities=["code"])]
    router = DrafterRouter(config, profiles, DomainClassifier({}), ExpertiseStore(1.0))
    router.rng.seed(0)  # Thompson sampling ranks the drafters the same way every run
    router.store.add("code", "general", 25.6, 230.4)
    router.store.add("code", "code", code_accepted, code_rejected)
    ranked = []
    choose = router.choose
    router.choose = lambda *args, **kwargs: ranked.append(args) or choose(*args, **kwargs)
    controller, asked = _controller(), []
    might_draft = controller.might_draft
    controller.might_draft = lambda *args, **kwargs: asked.append(args) or might_draft(*args, **kwargs)
    planning = Planning(
        RoundContext(SchedulerConfig(SchedulingConfig(plain_steps=PLAIN_STEPS)), {"general": service, "code": service}, router, controller)
    )
    batch = [_request(f"s{i}") for i in range(2)]
    for state in batch[:first_rounds]:
        state.rounds = 0
    for state in batch:
        state.routing = router.start("def f(x):", domain_hint="code")
    plans = []
    for _ in range(rounds):
        plans.append(planning.plan(batch, overlap=False))
        for state in batch:
            state.rounds += 1  # as the round's verification counts it
    return plans, len(ranked), len(asked)


def test_the_cost_model_here_drafts_from_an_acceptance_of_0_7():
    controller = _controller()
    drafts = [a for a in (0.3, 0.5, 0.6, 0.7, 0.8, 0.95) if controller.could_draft([a, a], [4, 4], plain_steps=[PLAIN_STEPS] * 2)[0]]
    assert drafts == [0.7, 0.8, 0.95]


def test_a_round_nobody_could_draft_in_at_their_hopes_ranks_no_drafter_and_probes_nobody():
    """The specialist measured at 0.3 over 256 tokens (hope 0.38), the general drafter at 0.1: no plan could draft, so
    no round ranks a drafter or probes, and each is speculating's round (routed), decoded as plainly as speculation
    off's. With the specialist's evidence thin (one token of five accepted: mean 0.5 with its prior, hope 0.8) the
    plan still drafts nothing at the mean, but its requests probe, and only in probe rounds."""
    assert upper_acceptance(4 + 76.8, 1 + 179.2) < 0.6 < 0.7 < upper_acceptance(4 + 1, 1 + 4)
    plans, ranked, asked = _plans(76.8, 179.2, rounds=32)
    assert ranked == asked == 0  # nor is the plan asked at the means: nobody's hope could make it draft
    assert all(plan.routed and all(r.k == 0 and not r.drafters for r in plan.requests) for plan in plans)
    assert all(r.plain_steps == PLAIN_STEPS for plan in plans for r in plan.requests)

    plans, ranked, _ = _plans(1.0, 4.0, rounds=32)
    probing = [plan for plan in plans if any(r.k > 0 for r in plan.requests)]
    assert ranked > 0 and 0 < len(probing) < len(plans)
    assert all(r.k == 1 and r.drafters == ["code"] for plan in probing for r in plan.requests)


def test_a_hopeful_round_ranks_drafters_only_where_the_plan_would_draft_or_probe():
    """The specialist's evidence thin (hope 0.8, mean 0.5 with its prior): its requests are hopeful every round, but
    at their best drafter's mean the plan drafts for nobody, so only the rounds a probe is due in rank drafters (both
    requests, together); the others decode their plain steps unranked, as cheaply as a round nobody hopes in. A round
    that found no draft or probe due leaves its requests unweighed for HOPE_RECHECK_ROUNDS rounds, as hopeless ones
    are: at four clients on one core, asking the plan at the means every round took a routed round's plan from 0.08 ms
    to 0.45 ms (docs/benchmarks/compare.md)."""
    plans, ranked, asked = _plans(1.0, 4.0, rounds=32)
    probing = [plan for plan in plans if any(r.k > 0 for r in plan.requests)]
    assert 0 < len(probing) < len(plans) and ranked == 2 * len(probing)
    assert asked <= len(plans) // HOPE_RECHECK_ROUNDS + len(probing) + 1
    assert all(r.plain_steps == PLAIN_STEPS for plan in plans if plan not in probing for r in plan.requests)


def test_a_request_s_first_round_decodes_plainly():
    """With adaptive speculation, a request's first round prefills its prompt and streams its first token: it drafts
    from its second round on (drafting in the first would wait for its drafters to prefill the prompt too), beside
    requests that draft. (With k as asked, the first round drafts: tests/e2e/test_demo_serving.py.)"""
    plans, _, _ = _plans(200.0, 20.0, rounds=1)  # the specialist at 0.9: both requests draft
    assert all(r.k > 0 for r in plans[0].requests)
    plans, _, _ = _plans(200.0, 20.0, rounds=1, first_rounds=1)
    assert [r.k > 0 for r in plans[0].requests] == [False, True]


def test_a_request_found_hopeless_is_weighed_again_every_few_rounds_not_every_round():
    """A request the plan found hopeless (nobody could draft for it at its hope: the specialist at 0.3 over 256 tokens)
    has its drafters' posteriors and its hope weighed again HOPE_RECHECK_ROUNDS rounds later, not in every round
    between (which decode their plain steps, routed, for a third of the plan). Once its specialist's evidence turns
    good, it drafts at the next weighing."""
    service = DrafterService("left", [SimpleNamespace(name="left-0")])
    config = RoutingConfig(routing_policy="expertise", default_drafter="general", fusion_width=1)
    profiles = [DrafterProfile("general"), DrafterProfile("code", specialities=["code"])]
    router = DrafterRouter(config, profiles, DomainClassifier({}), ExpertiseStore(1.0))
    router.rng.seed(0)
    router.store.add("code", "general", 25.6, 230.4)
    router.store.add("code", "code", 76.8, 179.2)
    weighed = []
    posteriors = router.posteriors
    router.posteriors = lambda routing: weighed.append(state.rounds) or posteriors(routing)
    settings = SchedulerConfig(SchedulingConfig(plain_steps=PLAIN_STEPS))
    planning = Planning(RoundContext(settings, {"general": service, "code": service}, router, _controller()))
    state = _request("s0")
    state.routing = router.start("def f(x):", domain_hint="code")
    ks = []
    for rounds in range(1, 15):
        state.rounds = rounds
        if rounds == 6:
            router.store.add("code", "code", 2000.0, 0.0)  # the specialist's drafts now accepted
        ks.append(planning.plan([state], overlap=False).requests[0].k)
    assert weighed[:3] == [1, 5, 9], weighed
    assert ks[:8] == [0] * 8 and ks[8] > 0, ks  # drafts from round 9 on


def test_a_prompt_the_exemplars_have_not_placed_is_classified_only_once_a_round_might_draft_for_it():
    """Where the specialists do not score new prompts (scoring does not pay on a cold start), the exemplars place a
    prompt in the first round that might draft for it: weighed at its hope anywhere (each drafter's best domain), a
    request nobody could draft for wherever it belongs is left unplaced, its prompt not classified (the largest part
    of a new request's plan). Once some domain's evidence could make it draft, it is placed and drafts there."""
    service = DrafterService("left", [SimpleNamespace(name="left-0")])
    exemplars = DomainClassifier({"code": ["def f(x): return x"], "en": ["the cat sat on the mat"]})
    classified = []
    scores = exemplars.scores
    exemplars.scores = lambda prompt: classified.append(prompt) or scores(prompt)
    config = RoutingConfig(routing_policy="expertise", default_drafter="general", fusion_width=1)
    profiles = [DrafterProfile("general"), DrafterProfile("code", specialities=["code"]), DrafterProfile("en", specialities=["en"])]
    router = DrafterRouter(config, profiles, exemplars, ExpertiseStore(1.0))
    router.rng.seed(0)
    for domain, drafter in (("code", "general"), ("code", "code"), ("en", "en"), ("en", "general"), ("", "general")):
        router.store.add(domain, drafter, 76.8, 179.2)  # hope 0.38 each, where drafting pays from 0.7
    router.store.add("", "code", 76.8, 179.2)
    router.store.add("", "en", 76.8, 179.2)
    router.store.add("code", "en", 76.8, 179.2)
    router.store.add("en", "code", 76.8, 179.2)
    controller = _controller(remeasure_every=32)  # the measured check on, cold: scoring does not pay
    settings = SchedulerConfig(SchedulingConfig(plain_steps=PLAIN_STEPS))
    planning = Planning(RoundContext(settings, {d.name: service for d in profiles}, router, controller))
    state = _request("s0")
    state.rounds = 0
    state.routing = router.start("def g(y): return y", domain_hint="")
    assert state.routing.needs_scores
    ks = []
    for rounds in range(14):
        state.rounds = rounds
        if rounds == 6:
            router.store.add("code", "code", 2000.0, 0.0)  # the code specialist's drafts now accepted in code
        plan = planning.plan([state], overlap=False)
        assert plan.to_score() == []  # nor is it ever scored
        ks.append(plan.requests[0].k)
        if rounds < 9:
            assert classified == [] and state.routing.unplaced and state.routing.domain == "", rounds
    assert ks[:9] == [0] * 9 and ks[9] > 0, ks  # weighed in rounds 1 and 5 (hopeless anywhere), then 9: drafts
    assert len(classified) == 1 and state.routing.domain == "code" and not state.routing.needs_scores
