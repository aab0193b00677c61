"""What a round that drafts costs beyond the cost model's prediction (router/speculation.py
`CostModel.observe_round`), and what the model predicts for a planned round (router/drafter_choice.py
`modelled_round_ms`). Synthetic timings, never this machine's."""

from __future__ import annotations

import pytest

from router import messages
from router.drafter_choice import DraftFill, modelled_round_ms
from router.cost_model import CostModel
from router.speculation import SpeculationController
from router.verifying import fed_tokens, prefills
from specfleet.config import SpeculationConfig


def model(pinned: bool = False) -> CostModel:
    costs = {"verify_base": 5.0, "verify_per_session": 0.0, "verify_per_token": 0.2, "draft_per_token": 0.5, "draft_base": 0.5}
    return CostModel(**costs, verify_call=0.0, draft_call=0.0, pinned=pinned)


def plain_among_drafting(cost: CostModel, drafted: tuple[float, float], plain: tuple[float, float]) -> None:
    """Ten rounds that draft, then a plain one (one the measured check runs now and then), as (modelled, wall) ms."""
    for _ in range(10):
        cost.observe_round(*drafted, drafted=True)
    cost.observe_round(*plain, drafted=False)


def test_drafting_rounds_pay_what_they_were_measured_to_take_beyond_the_model_and_plain_rounds_do_not():
    cost = model()
    assert cost.drafting_extra == 0.0
    for _ in range(300):
        plain_among_drafting(cost, drafted=(10.0, 13.0), plain=(6.0, 7.0))
    # Both kinds run 1 ms beyond their calls (transport the model already has, say); drafting 2 ms more (a little
    # less: plain rounds wear the measured cost of drafting down, `test_drafting_measured_dear_long_ago_is_tried_again`).
    assert 1.95 < cost.drafting_extra <= 2.0
    assert cost.draft_steps_ms(4) == 0.5 + 0.5 * 4  # the draft call alone: the extra is the round's
    assert abs(cost.drafting_round_ms(7.0, 2.5, plain=6.0) - (7.0 + 2.5 + cost.drafting_extra)) < 1e-9
    assert abs(cost.drafting_round_ms(7.0, 2.5, plain=6.0, overlap=True) - (7.0 + cost.drafting_extra)) < 1e-9
    assert cost.draft_ms(0) == 0.0  # a round that drafts nothing pays no drafting term at all
    before = cost.drafting_extra
    cost.observe_round(modelled_ms=10.0, wall_ms=1000.0, drafted=True)  # a stall counts its modelled time at most
    assert 0 < cost.drafting_extra - before <= 0.03 * 10
    pinned = model(pinned=True)
    pinned.observe_round(10.0, 13.0, True)
    pinned.observe_round(6.0, 7.0, False)
    assert pinned.drafting_extra == 0.0


def test_drafting_rounds_measured_cheaper_than_modelled_are_planned_cheaper_but_never_below_a_plain_round():
    """Measured below zero, the extra comes off the whole round, not just off the draft call (which a cheap drafter
    makes smaller than the extra: clamped at the call, rounds that draft stay modelled dearer than they run), and a
    round that drafts is never modelled cheaper than the plain round of the same requests."""
    cost = model()
    for _ in range(300):
        plain_among_drafting(cost, drafted=(10.0, 8.0), plain=(6.0, 6.0))
    assert -2.0 <= cost.drafting_extra < -1.9
    # A draft call of 0.5 ms under an extra of -2: the round is modelled 1.5 ms under its verification.
    assert abs(cost.drafting_round_ms(8.0, 0.5, plain=6.0) - (8.5 + cost.drafting_extra)) < 1e-9
    assert cost.drafting_round_ms(6.5, 0.5, plain=6.0) == 6.0
    for _ in range(300):
        plain_among_drafting(cost, drafted=(10.0, 1.0), plain=(6.0, 6.0))
    assert cost.drafting_round_ms(9.0, 0.5, plain=6.0) == 6.0


def test_a_cheap_drafter_under_a_negative_extra_drafts_where_the_extra_pays_for_its_rows():
    """Rounds that draft measured 1.5 ms cheaper than modelled against plain ones (the model's verification of drafted
    rows dearer than they run), a draft call of 0.3 ms. A request accepted at 0.15 drafts: one row more is modelled
    at max(2.5, 2.5 + 0.5 + 0.3 - 1.5) = 2.5 ms for 1.15 tokens, against 2.5 ms for one plainly. Charged to the draft
    call alone and clamped there, the extra would leave the row at 3.0 ms, which 1.15 tokens do not pay for."""
    cost = CostModel(
        verify_base=2.0, verify_per_session=0.0, verify_per_token=0.5, draft_per_token=0.05, draft_base=0.25, verify_call=0.0, draft_call=0.0
    )
    for _ in range(300):
        plain_among_drafting(cost, drafted=(10.0, 8.5), plain=(6.0, 6.0))
    assert -1.5 <= cost.drafting_extra < -1.45
    controller = SpeculationController(cost, settings=SpeculationConfig(remeasure_every=0), probe_share=0.0)
    assert controller.plan([0.15], [4]) in ([1], [2])
    assert controller.plan([0.15, 0.15], [4, 4]) != [0, 0]


def test_what_drafting_rounds_cost_beyond_the_model_makes_marginal_requests_decode_plainly():
    """A request whose drafts are accepted at 0.5 drafts while the model's costs are all there is; once drafting
    rounds are measured 4 ms dearer than the model says (against plain rounds), it no longer pays, and a request
    accepted at 0.95 still drafts. Only rounds that ran among their own kind teach the model."""
    settings = SpeculationConfig(remeasure_every=0)
    controller = SpeculationController(model(), settings=settings)
    assert controller.plan([0.5], [4]) != [0]
    controller.observe_modelled(5.2, 6.0, drafted=False)
    controller.observe_modelled(8.0, 20.0, drafted=True, clean=False)
    assert controller.cost.drafting_extra == 0.0
    for _ in range(300):
        controller.observe_modelled(5.2, 6.0, drafted=False)
        for _ in range(10):
            controller.observe_modelled(8.0, 12.8, drafted=True)
    assert 3.9 < controller.cost.drafting_extra <= 4.0
    assert controller.plan([0.5], [4]) == [0]
    assert controller.plan([0.95], [4]) != [0]


def test_the_modelled_round_is_what_the_plan_weighed():
    """Two requests: one led by `general` four deep and helped two deep by `code` on another service, one decoding
    plainly. Rows: two roots, four of the lead's, and the helper's two at the half it fills; the lead's service steps
    four positions, the helper's two, and the busier service sets the drafting term. Pipelined, the slower side."""
    cost = model(pinned=True)
    general, chains = object(), object()
    services = {"general": general, "code": chains, "ngram": general}
    fill = DraftFill()
    for _ in range(2000):
        fill.observe("code", 1, 2)
    drafters, depths = [["general", "code"], []], [[4, 2], []]
    rows = 2 + 4 + 2 * fill.rate("code")
    verifying, drafting = cost.verify_ms(2, rows), cost.draft_steps_ms(4)
    assert abs(modelled_round_ms(drafters, depths, services, cost, False, fill=fill) - (verifying + drafting)) < 1e-9
    assert modelled_round_ms(drafters, depths, services, cost, True, fill=fill) == max(verifying, drafting)
    # A model-free drafter adds no step; a plain round is its verification alone.
    alone = cost.verify_ms(1, 5) + cost.draft_steps_ms(0)
    assert modelled_round_ms([["ngram"]], [[4]], services, cost, False, frozenset({"ngram"})) == alone
    assert modelled_round_ms([[], []], [[], []], services, cost, False) == cost.verify_ms(2, 2)


def test_drafting_measured_dear_long_ago_is_tried_again():
    """Once the measured extra makes every request decode plainly, no round that drafts among its own kind measures
    it again (a probe follows plain rounds and catches its drafters up): plain rounds wear it down, so the plan drafts
    again, and rounds that draft measure it anew."""
    cost = model()
    for _ in range(300):
        plain_among_drafting(cost, drafted=(10.0, 14.0), plain=(6.0, 6.0))
    assert 3.9 < cost.drafting_extra <= 4.0
    for _ in range(300):
        cost.observe_round(modelled_ms=6.0, wall_ms=6.0, drafted=False)
    assert 0.5 < cost.drafting_extra < 3.0
    for _ in range(3000):
        cost.observe_round(modelled_ms=6.0, wall_ms=6.0, drafted=False)
    assert cost.drafting_extra < 0.01


def test_plain_steps_add_a_pass_of_the_sessions_still_decoding_and_teach_one_pass_s_time():
    cost = model()
    # Three requests decoding 1, 4 and 2 tokens: the second pass holds two of them, the third and fourth one.
    assert cost.plain_steps_ms([1, 4, 2]) == (5.0 + 0.2 * 2) + 2 * (5.0 + 0.2)
    assert cost.plain_steps_ms([1, 1]) == 0.0 and cost.plain_steps_ms([]) == 0.0
    for _ in range(200):  # four passes of one session, each as the model expects a pass to take
        cost.observe_verify(1, 1, 4 * (5.0 + 0.2), passes=4)
    assert abs(cost.verify_scale - 1.0) < 1e-6 and abs(cost.steps_scale - 1.0) < 1e-6


def test_the_passes_after_a_plain_call_s_first_follow_a_scale_of_their_own():
    """One-pass calls (a drafted tree) run as modelled; the passes after the first of calls that decode eight plain
    steps take a quarter longer (each also samples, commits and looks its sessions up). One scale for both would
    misjudge either; the lookup's rows in those passes count as rows of them."""
    cost = model()
    for _ in range(400):
        cost.observe_verify(1, 5, 5.0 + 0.2 * 5)
        cost.observe_verify(1, 1, 5.2 + 7 * 5.2 * 1.25, passes=8)
    assert abs(cost.verify_scale - 1.0) < 1e-6 and abs(cost.steps_scale - 1.25) < 1e-3
    assert abs(cost.plain_steps_ms([8]) - 7 * 5.2 * 1.25) < 0.05
    rows = model()
    for _ in range(400):
        rows.observe_verify(1, 1, 5.2 + 7 * 5.2 + 0.2 * 10, passes=8, rows=10)
    assert abs(rows.steps_scale - 1.0) < 1e-6 and abs(rows.lookup_row_ms() - 0.2) < 1e-6


def test_plain_steps_count_what_the_verifier_s_lookup_adds_so_drafting_must_beat_that():
    """One request decoding eight plain steps: 8 tokens in 41.6 ms, and drafting four at an acceptance of 0.8 (3.36
    tokens in 8.5 ms) beats that. Once its plain passes are measured to commit 1.5 looked-up tokens each beyond their
    own for two rows each, a plain round commits 20 tokens in 44.8 ms, and drafting no longer pays. What the lookup
    adds at one session says nothing of four; a request's first round (one step) looks nothing up."""
    controller = SpeculationController(model(), settings=SpeculationConfig(remeasure_every=0), probe_share=0.0)
    assert controller.plan([0.8], [4], plain_steps=[8]) != [0]
    for _ in range(200):
        controller.cost.observe_lookup(1, passes=8, proposed=16, accepted=12)
    cost = controller.cost
    assert cost.lookup_per_pass(1) == pytest.approx((1.5, 2.0)) and cost.lookup_per_pass(4) == (0.0, 0.0)
    tokens, beyond_ms = cost.plain_round([8])
    assert tokens == pytest.approx(20.0) and abs(beyond_ms - (cost.plain_steps_ms([8]) + 0.2 * 2 * 8)) < 1e-9
    assert cost.plain_round([1]) == (1.0, 0.0)
    assert controller.plan([0.8], [4], plain_steps=[8]) == [0]
    assert controller.plan([0.8] * 4, [4] * 4, plain_steps=[8] * 4) != [0] * 4


def test_a_prompt_s_prefill_counts_its_tokens_so_the_model_keeps_a_pass_s_measured_cost():
    """The verify call of a request's first round prefills its prompt, so it feeds the prompt's tokens, not the one a
    decoding session feeds (and the router leaves such calls out of what the model learns: `prefills`,
    tests/router/test_verifying.py); a call measured as modelled keeps the scale where it is, prompt or not."""
    sampling = messages.SamplingParams(temperature=0.0)
    prompt = messages.VerifySession(sync=messages.SessionSync("new", 0, list(range(64))), tree=messages.TokenTree(), sampling=sampling)
    tree = messages.TokenTree(token_ids=[5, 6, 7], parents=[-1, 0, 1], proposals=[None] * 3)
    decoding = messages.VerifySession(sync=messages.SessionSync("old", 80, []), tree=tree, sampling=sampling)
    assert fed_tokens(prompt) == 64 and fed_tokens(decoding) == 4
    assert prefills(prompt) and not prefills(decoding)
    cost = model()
    for i in range(400):  # a prompt every eighth call, the others four plain steps of one session; all as modelled
        if i % 8 == 0:
            cost.observe_verify(1, fed_tokens(prompt), 5.0 + 0.2 * 64)
        else:
            cost.observe_verify(1, 1, 4 * (5.0 + 0.2), passes=4)
    assert abs(cost.verify_scale - 1.0) < 1e-6
