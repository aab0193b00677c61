"""Expertise routing and adaptive speculation, on simulated acceptance (fast, deterministic)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from router.domains import FEATURES, DomainClassifier, _trigram_vector
from router.expertise import ExpertiseStore
from router.routing import MAX_EXTRA_DOMAINS, DrafterProfile, DrafterRouter
from specfleet.config import RoutingConfig
from router.cost_model import CostModel
from router.speculation import MAX_FRUITLESS_PROBES, SpeculationController

EXEMPLARS = {
    "code": ["def main(argv):\n    return 0\n", "import os\nfor x in range(10):\n    print(x)\n", "class Foo:\n    def bar(self): pass"],
    "prose": ["It was a bright cold day in April, and the clocks were striking thirteen.", "She walked slowly along the river."],
    "structured": ["name: web\nports:\n  - 80\n  - 443\n", '{"key": "value", "items": [1, 2, 3]}', "[server]\nhost = example\n"],
}
# Per-token acceptance of each drafter in each domain.
ACCEPTANCE = {
    "code": {"code": 0.85, "prose": 0.3, "structured": 0.45, "general": 0.6},
    "prose": {"code": 0.25, "prose": 0.8, "structured": 0.3, "general": 0.6},
    "structured": {"code": 0.4, "prose": 0.3, "structured": 0.9, "general": 0.6},
}


def make_router(
    policy="expertise", specialities=True, decay=0.98, fusion_width=1, fusion_below=0.75, exemplar_margin=0.02, exemplars=EXEMPLARS
) -> DrafterRouter:
    profiles = [DrafterProfile(d, [d] if specialities and d != "general" else []) for d in ("code", "prose", "structured", "general")]
    config = RoutingConfig(
        routing_policy=policy, default_drafter="general", fusion_width=fusion_width, fusion_below=fusion_below, exemplar_margin=exemplar_margin
    )
    return DrafterRouter(
        config,
        profiles,
        DomainClassifier(exemplars),
        ExpertiseStore(decay=decay),
        seed=1,
    )


def simulate_round(router: DrafterRouter, routing, domain: str, rng: random.Random, k: int = 4) -> str:
    drafter = router.choose(routing)[0]
    accepted = 0
    while accepted < k and rng.random() < ACCEPTANCE[domain][drafter]:
        accepted += 1
    router.observe(routing, {drafter: (accepted, 1 if accepted < k else 0)})
    return drafter


def test_classifier_recognises_domains():
    classifier = DomainClassifier(EXEMPLARS)
    assert classifier.classify("def fibonacci(n):\n    if n < 2:\n        return n") == "code"
    assert classifier.classify("The old man looked out over the sea and remembered") == "prose"
    assert classifier.classify("name: db\nports:\n  - 5432\nreplicas: 2\n") == "structured"
    assert classifier.classify('{"id": 7, "tags": ["a", "b"]}') == "structured"


def test_each_label_scores_its_best_exemplar_s_cosine_similarity_with_the_prompt():
    """The inverted index sums what a plain dot product of the two unit vectors sums: checked against it, for every
    label, on prompts that share many features with the exemplars, few, or none."""
    classifier = DomainClassifier(EXEMPLARS)

    def dense(text: str) -> np.ndarray:
        features, values = _trigram_vector(text)
        vector = np.zeros(FEATURES)
        vector[features] = values
        return vector

    for prompt in ("def fibonacci(n):\n    return n", "She walked along the river at night.", "ports: [80, 443]", "\u00fc\u00df", "x"):
        expected = {label: max(float(dense(prompt) @ dense(text)) for text in texts) for label, texts in EXEMPLARS.items()}
        assert classifier.scores(prompt) == pytest.approx(expected, abs=1e-12), prompt
    assert max(classifier.scores("def main(argv):\n    return 0\n").items(), key=lambda item: item[1]) == ("code", pytest.approx(1.0))


def test_placing_a_prompt_classifies_it_once():
    """The sure label and, where scoring cannot run, the best guess come from one classification of the prompt (a
    few hundred microseconds on the router's event loop)."""
    router = make_router(exemplar_margin=100.0)  # nothing is sure
    calls = []
    scores = router.classifier.scores
    router.classifier.scores = lambda prompt: calls.append(prompt) or scores(prompt)
    routing = router.start("def f(x):\n    return x")
    routing.scorable = False
    router.place(routing)
    assert routing.domain == "code" and not routing.needs_scores
    assert len(calls) == 1


@pytest.mark.parametrize("specialities", [True, False], ids=["with-prior", "learned-only"])
def test_routing_converges_to_the_domain_expert_and_follows_a_switch(specialities):
    router = make_router(specialities=specialities)
    rng = random.Random(0)
    for domain in ("code", "prose", "structured"):
        chosen = []
        for _ in range(60):  # requests of 10 rounds each
            routing = router.start("", domain_hint=domain)
            chosen += [simulate_round(router, routing, domain, rng) for _ in range(10)]
        after_warmup = chosen[100:]
        share = sum(d == domain for d in after_warmup) / len(after_warmup)
        assert share >= 0.9, (domain, share)


def test_a_request_whose_acceptance_drops_moves_to_another_drafter():
    router = make_router(specialities=False)
    rng = random.Random(1)
    for _ in range(40):  # learn that code requests like the code drafter
        routing = router.start("", domain_hint="code")
        for _ in range(10):
            simulate_round(router, routing, "code", rng)
    # This "code" request actually behaves like prose: its own evidence should move it.
    routing = router.start("", domain_hint="code")
    chosen = [simulate_round(router, routing, "prose", rng) for _ in range(40)]
    assert sum(d == "prose" for d in chosen[20:]) >= 14


def test_fusion_adds_cooperating_drafters_only_when_the_best_is_uncertain():
    router = make_router(fusion_width=3, fusion_below=0.85)
    routing = router.start("", domain_hint="prose")
    assert len(router.choose(routing)) == 3  # only the prior (mean 0.8) so far: ask for help
    router.store.add("prose", "prose", 500, 20)
    chosen = [router.choose(router.start("", domain_hint="prose")) for _ in range(50)]
    assert all(len(c) == 1 for c in chosen)
    assert sum(c == ["prose"] for c in chosen) >= 40  # the rest is exploration


def test_baseline_policies():
    fixed = make_router(policy="fixed")
    assert {fixed.choose(fixed.start("x"))[0] for _ in range(10)} == {"general"}
    oracle = make_router(policy="oracle")
    assert oracle.choose(oracle.start("", domain_hint="structured")) == ["structured"]
    rand = make_router(policy="random")
    assert len({rand.choose(rand.start("x"))[0] for _ in range(50)}) == 4


def pinned_controller() -> SpeculationController:
    return SpeculationController(cost=CostModel(verify_base=10.0, verify_per_token=0.2, draft_per_token=0.5, pinned=True))


def test_k_is_zero_for_a_useless_drafter_and_maximal_for_a_perfect_one():
    controller = pinned_controller()
    assert controller.plan([0.01], [8]) == [0]
    assert controller.plan([0.999], [8]) == [8]
    mid = controller.plan([0.6], [8])[0]
    assert 1 <= mid < 8


def test_k_shrinks_under_load():
    controller = SpeculationController(cost=CostModel(verify_base=10.0, verify_per_token=1.0, draft_per_token=0.5, pinned=True))
    light = controller.plan([0.7], [8])[0]
    heavy = controller.plan([0.7] * 64, [8] * 64)
    assert max(heavy) < light


def _probes(controller: SpeculationController, acceptance: float, steps: int, rounds: int) -> tuple[int, float, float, float]:
    """`rounds` plans of one request at `acceptance` that decodes `steps` plain steps a round where it does not draft:
    (its probes, the modelled time of all its rounds, what one probe loses against the plain rounds, the longest round)."""
    cost = controller.cost
    plain_ms = cost.round_ms([0]) + cost.plain_steps_ms([steps])
    probe_ms = cost.round_ms([1])
    loss = probe_ms - (1 + acceptance) * plain_ms / steps  # its time beyond what its tokens take at the plain goodput
    ks = [controller.plan([acceptance], [8], plain_steps=[steps])[0] for _ in range(rounds)]
    assert ks.count(0) + ks.count(1) == rounds
    probes = ks.count(1)
    return probes, probes * probe_ms + (rounds - probes) * plain_ms, loss, max(plain_ms, probe_ms)


def test_probes_lose_at_most_their_share_of_the_round_time_and_come_as_soon_as_it_pays_for_them():
    """A request planned at k = 0 probes once the rounds since its last probe have taken 1 / probe_share times what a
    probe loses against them: one plain token a round, or plain steps (dearer rounds, and a probe loses more against
    their four tokens). Its probes lose no more than that share of the time, and come as soon as the rounds since the
    last have paid for one (at most a round later)."""
    for share in (0.05, 0.2):
        for steps in (1, 4):
            controller = SpeculationController(cost=pinned_controller().cost, probe_share=share)
            probes, total, loss, longest = _probes(controller, 0.01, steps, 400)
            assert probes * loss <= share * total, (share, steps)
            first = SpeculationController(cost=pinned_controller().cost, probe_share=share)
            # The first probe comes once the plain rounds before it have paid for it, at most a round later.
            at = _probe_rounds(first, 0.01, steps, 400)[0]
            plain_ms = first.cost.round_ms([0]) + first.cost.plain_steps_ms([steps])
            assert loss / share / plain_ms - 1 <= at <= loss / share / plain_ms + 1, (share, steps)


def _probe_rounds(controller: SpeculationController, acceptance: float, steps: int, rounds: int, running: int = 1) -> list[int]:
    """The indices of the probe rounds among `rounds` plans of one request (`_probes`)."""
    ks = [controller.plan([acceptance], [8], running=running, plain_steps=[steps])[0] for _ in range(rounds)]
    return [i for i, k in enumerate(ks) if k]


def test_probes_after_which_nobody_drafts_come_ever_further_apart_until_the_plan_drafts():
    """Exploration costs less the longer it finds nothing: each probe after which the plan drafted for nobody halves the
    share the next may lose at that load, to 1 / 2^MAX_FRUITLESS_PROBES of it; the first round the plan drafts in
    restores the full share, and a load's fruitless probes leave another load's share whole."""
    controller = pinned_controller()
    probes = _probe_rounds(controller, 0.01, 1, 3000)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert len(gaps) > MAX_FRUITLESS_PROBES + 2
    # The first probe comes at the full share, the next at half of it, ... (gaps[i]: after i + 1 fruitless probes).
    for before, after in zip(gaps[: MAX_FRUITLESS_PROBES - 1], gaps[1:MAX_FRUITLESS_PROBES]):
        assert 1.8 * before <= after <= 2.2 * before + 1, gaps
    floor = gaps[MAX_FRUITLESS_PROBES - 1 :]
    assert max(floor) <= 1.1 * min(floor) + 1, gaps  # no further apart than the floor's share
    assert controller.fruitless_probes == {1: MAX_FRUITLESS_PROBES}
    other = _probe_rounds(controller, 0.01, 1, probes[1] + 1, running=4)  # another load: its first gap, as a fresh one's
    assert other[1] - other[0] <= gaps[0] + 1
    assert controller.plan([0.999], [8])[0] > 0  # the plan drafts at load 1: its probes' share is whole again
    assert 1 not in controller.fruitless_probes
    again = _probe_rounds(controller, 0.01, 1, probes[2] + 1)
    assert again[1] - again[0] <= gaps[0] + 1


def test_a_round_nobody_could_draft_in_counts_towards_the_next_probe():
    """A round the plan is not asked for (no request hopeful: router/planning.py) is still time the next probe's loss is
    weighed against."""
    fresh, waited = pinned_controller(), pinned_controller()
    for _ in range(3):
        waited.planned_plainly([1])
    assert fresh.plan([0.01], [8]) == [0]
    assert waited.plan([0.01], [8]) == [1]


def test_a_round_s_requests_at_k_zero_probe_together():
    """Probes share their round: its draft call and wider pass are paid once for every request that probes in it,
    not once per request in rounds of their own; riding a round that drafts anyway, they cost only their rows and
    come almost every round. A request that may not draft (bound 0) does not probe, and one the plan drafts for keeps
    its k."""
    controller = pinned_controller()
    rounds = [controller.plan([0.01, 0.01, 0.01, 0.999], [8, 8, 0, 8]) for _ in range(16)]
    probing = [ks for ks in rounds if ks[:3] != [0, 0, 0]]
    assert probing == [[1, 1, 0, 8]] * len(probing) and len(probing) >= 12
    assert all(ks[3] == 8 for ks in rounds)


def test_a_request_probes_only_where_its_hope_could_make_the_plan_draft():
    """A probe round probes the requests at k = 0 whose hope (`could_draft`) could make the plan draft for them, not
    the others; `could_draft` is the plan at the hoped acceptances, and asking it moves no probe clock."""
    controller = pinned_controller()
    rounds = [controller.plan([0.01, 0.01], [8, 8], hopeful=[True, False]) for _ in range(16)]
    probing = [ks for ks in rounds if ks != [0, 0]]
    assert probing == [[1, 0]] * len(probing) and probing
    since = controller.since_probe_ms
    assert controller.could_draft([0.999, 0.01], [8, 8]) == [True, False]
    assert controller.since_probe_ms == since
    for a in (0.05, 0.2, 0.4, 0.6, 0.8):
        plan = SpeculationController(cost=pinned_controller().cost, probe_share=0.0).plan([a], [8], plain_steps=[4])
        assert controller.could_draft([a], [8], plain_steps=[4]) == [plan[0] > 0]


def test_drafting_must_beat_the_plain_round_s_steps():
    """The plan weighs drafting against the round it would otherwise be: plain steps, several tokens for one round's
    overhead. A drafter good enough to beat one plain token a round is not always good enough to beat four; k never
    grows for the plain round getting cheaper, and a near-perfect drafter still drafts."""
    acceptances = [i / 20 for i in range(1, 20)] + [0.999]
    # probe_share 0: no probe round among these plans.
    alone = [SpeculationController(cost=pinned_controller().cost, probe_share=0.0).plan([a], [8]) for a in acceptances]
    stepped = [SpeculationController(cost=pinned_controller().cost, probe_share=0.0).plan([a], [8], plain_steps=[4]) for a in acceptances]
    assert all(s[0] <= a[0] for s, a in zip(stepped, alone))
    assert any(s[0] == 0 < a[0] for s, a in zip(stepped, alone)), list(zip(acceptances, alone, stepped))
    assert stepped[-1] == [8]


def test_draft_cost_is_fitted_as_base_plus_per_token():
    """A draft call's base is catching its sessions up on the committed tokens: charged per
    token, it made shallow drafts look dear, so the plan drafted ever shallower."""
    cost = CostModel(draft_per_token=1.0)
    rng = random.Random(0)
    for _ in range(200):
        depth = rng.randint(1, 8)
        cost.observe_draft(depth, 6.0 + 0.25 * depth + rng.uniform(-0.1, 0.1))
    assert cost.draft_base == pytest.approx(6.0, abs=0.3)
    assert cost.draft_per_token == pytest.approx(0.25, abs=0.02)


def true_verify_ms(sessions: int, tokens: int) -> float:
    """A verifier like the demo target's on this machine: a pass, each session, each token."""
    return 15.0 + 1.0 * sessions + 0.35 * tokens


def profiled_cost() -> CostModel:
    cost = CostModel(verify_call=0.0, draft_call=0.0, draft_base=3.0, draft_per_token=4.0)
    cost.fit_verify([(n, n * (d + 1), true_verify_ms(n, n * (d + 1))) for n in (1, 4, 16) for d in (0, 4)])
    return cost


def test_verify_cost_separates_sessions_from_tokens_and_follows_the_machine():
    cost = profiled_cost()
    assert (cost.verify_base, cost.verify_per_session, cost.verify_per_token) == pytest.approx((15.0, 1.0, 0.35))
    rng = random.Random(0)
    for _ in range(300):  # the machine slows down by half
        n = rng.randint(8, 20)
        cost.observe_verify(n, 4 * n, 1.5 * true_verify_ms(n, 4 * n))
    assert cost.verify_ms(16, 64) == pytest.approx(1.5 * true_verify_ms(16, 64), rel=0.01)
    # Passes that cannot separate the terms keep what they can, never a negative cost.
    flat = CostModel()
    flat.fit_verify([(8, 8, 20.0), (8, 40, 30.0)])
    assert flat.verify_per_session == 0.0 and flat.verify_per_token == pytest.approx(10 / 32)


def test_k_stays_deep_under_load_when_a_draft_token_costs_only_its_own_share():
    """16 requests share each pass. Folding the per-session cost into a per-token one (the line
    through passes of growing batches, 1.35 ms a token) made a draft token look four times dearer
    than it is (0.35 ms): here the plan then drafts one token a request instead of three."""
    cost = profiled_cost()
    controller = SpeculationController(cost=cost)
    ks = controller.plan([0.7] * 16, [4] * 16, overlap=True)
    assert sum(ks) >= 3 * 16
    folded = CostModel(verify_base=15.0, verify_per_token=1.35, draft_base=3.0, draft_per_token=4.0, verify_call=0.0, draft_call=0.0, pinned=True)
    assert sum(SpeculationController(cost=folded).plan([0.7] * 16, [4] * 16, overlap=True)) < sum(ks) * 0.75


def test_cost_model_without_spread_still_costs_what_it_measured():
    """Only ever depth 2, and cheaper than the prior per-token cost says (2 x 1.0 ms): the slope
    is cut down to what was measured rather than the base going negative (clamped, 2.0 ms)."""
    cost = CostModel(draft_per_token=1.0)
    for _ in range(50):
        cost.observe_draft(2, 1.2)
    assert cost.draft_ms(2) - cost.draft_call == pytest.approx(1.2, abs=1e-6)


def test_k_holds_steady_when_the_cost_model_learns_from_its_own_plans():
    """Closed loop: plan, draft at the planned depth, observe its cost, plan again."""
    cost = CostModel(verify_base=10.0, verify_per_token=0.2, draft_per_token=0.5, verify_call=0.0, draft_call=0.0)
    controller = SpeculationController(cost=cost)
    ks = []
    for r in range(60):
        (k,) = controller.plan([0.7], [8])
        ks.append(k)
        if k:
            cost.observe_draft(k, 3.0 + 0.5 * k)  # catch-up forward + one step per token
        cost.observe_verify(1, k + 1, 10.0 + 0.2 * (k + 1))
    truth = CostModel(verify_base=10.0, verify_per_token=0.2, draft_base=3.0, draft_per_token=0.5, verify_call=0.0, draft_call=0.0, pinned=True)
    assert ks[-1] == SpeculationController(cost=truth).plan([0.7], [8])[0] >= 3


def test_several_requests_draft_together_when_the_shared_drafting_step_pays():
    """The drafting step is shared by the batch: one request alone may not pay for it, four together do."""
    controller = SpeculationController(cost=CostModel(verify_base=22.0, verify_per_token=0.5, draft_per_token=3.0, pinned=True))
    assert all(k >= 1 for k in controller.plan([0.7] * 4, [8] * 4))


def test_pipelined_rounds_hide_drafting_so_k_can_be_deeper():
    cost = dict(verify_base=22.0, verify_per_token=1.0, draft_per_token=3.0, verify_call=0.0, draft_call=0.0, pinned=True)
    sequential = SpeculationController(cost=CostModel(**cost)).plan([0.8] * 8, [8] * 8)
    overlapped = SpeculationController(cost=CostModel(**cost)).plan([0.8] * 8, [8] * 8, overlap=True)
    assert sum(overlapped) > sum(sequential)


def test_specialists_scores_set_the_domain_and_the_classifier_is_the_fallback():
    router = make_router(exemplar_margin=0)  # every prompt is scored
    routing = router.start("The old man looked out over the sea and remembered")
    assert routing.needs_scores and routing.domain == ""  # undecided until the specialists score it
    assert set(router.scorers()) == {"code", "prose", "structured"}  # the general drafter declares nothing
    router.assign_domain(routing, {"code": -1.2, "prose": -3.5, "structured": -2.0})
    assert routing.domain == "code" and not routing.needs_scores
    unreachable = router.start("name: db\nports:\n  - 5432\n")
    router.assign_domain(unreachable, {})
    assert unreachable.domain == "structured"
    # A declared domain, or another policy, needs no scoring.
    assert not router.start("anything", domain_hint="prose").needs_scores
    assert not make_router(policy="random").start("def f(): pass").needs_scores


def test_a_prompt_the_exemplars_place_clearly_is_not_scored():
    # "prose" and "code" share an exemplar, so a prompt like it is no closer to one than to the other.
    exemplars = {
        "prose": ["The river ran past the mill.", "It rained all night."],
        "code": ["The river ran past the mill."],
        "structured": EXEMPLARS["structured"],
    }
    router = make_router(exemplars=exemplars)
    clear, tied = router.start('{"key": "value", "items": [1, 2, 3]}'), router.start("The river ran past the mill.")
    assert clear.needs_scores and tied.needs_scores  # decided in the first round (`place`), not at submission
    router.place(clear)
    router.place(tied)
    assert clear.domain == "structured" and not clear.needs_scores
    assert tied.needs_scores and tied.domain == ""
    assert router.classifier.scores("The river ran past the mill.")["prose"] == pytest.approx(1.0)  # one exemplar is the prompt
    always = make_router(exemplars=exemplars, exemplar_margin=0)
    scored = always.start('{"key": "value", "items": [1, 2, 3]}')
    always.place(scored)
    assert scored.needs_scores


def test_a_call_overhead_makes_drafting_deeper_not_shallower():
    """A round that drafts pays for one more call; once paid, deeper drafts amortise it."""
    cost = dict(verify_base=7.0, verify_per_token=1.5, draft_per_token=1.75, pinned=True)
    cheap_calls = SpeculationController(cost=CostModel(**cost, verify_call=0.0, draft_call=0.0)).plan([0.75], [8])
    costly_calls = SpeculationController(cost=CostModel(**cost, verify_call=3.0, draft_call=3.0)).plan([0.75], [8])
    assert costly_calls[0] > cheap_calls[0] >= 1


def test_the_domains_requests_may_name_are_bounded():
    """Each domain is a metrics label and a Redis field per drafter: past MAX_EXTRA_DOMAINS new names, a request's domain
    comes from its prompt, as if it named none; the drafters' specialities and names already admitted always count."""
    router = make_router()
    named = [router.start("some text", f"probe-{i}").domain for i in range(MAX_EXTRA_DOMAINS + 10)]
    assert named[:MAX_EXTRA_DOMAINS] == [f"probe-{i}" for i in range(MAX_EXTRA_DOMAINS)]
    assert not any(domain.startswith("probe-") for domain in named[MAX_EXTRA_DOMAINS:])
    assert router.start("some text", "probe-3").domain == "probe-3" and router.start("x", "code").domain == "code"
    assert len(router.pairs()) == (len(router.domains) + MAX_EXTRA_DOMAINS + 1) * len(router.drafters)
