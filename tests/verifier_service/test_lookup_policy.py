"""verifier_service/lookup.py: a chain's token is proposed while the chance that it and every token before it are
accepted pays for the row it adds, at the cost of rows and tokens this verifier's passes show."""

from __future__ import annotations

import pytest

from verifier_service.lookup import EXPLORE_EVERY, MAX_EXPLORE_BACKOFF, MOST_NEEDED, Acceptance, LookupPolicy, PassChains, PassCost


def test_the_pass_cost_is_a_line_through_recent_passes_and_free_rows_until_rows_differ():
    cost = PassCost()
    assert cost.line() == (0.0, 0.0)
    for _ in range(5):
        cost.observe(4, 3.0)
    assert cost.line() == (pytest.approx(3.0), 0.0), "passes of one size cannot tell a row's cost"
    for rows in (1, 5, 1, 5, 1, 5):
        cost.observe(rows, 1.5 + 0.5 * rows)
    base, per_row = cost.line()
    assert per_row == pytest.approx(0.4, abs=0.15) and base > 0
    later = PassCost()
    for rows in (1, 2, 3, 4) * 50:
        later.observe(rows, 2.0 + 0.5 * rows)
    assert later.line() == (pytest.approx(2.0), pytest.approx(0.5))


def test_the_chance_needed_is_a_row_against_a_plain_token_and_grows_with_the_batch():
    policy = LookupPolicy()
    assert policy.needed(1) == 0.0, "nothing measured: rows are free"
    for rows in (1, 2, 3, 4, 5) * 10:
        policy.observe_pass(1, rows, 2.0 + 0.5 * rows)
    for rows in (4, 8, 12, 16, 20) * 10:
        policy.observe_pass(4, rows, 1.0 + 0.4 * rows)
    assert policy.needed(1) == pytest.approx(0.5 / 2.5)
    assert policy.needed(4) == pytest.approx(1.6 / 2.6) and policy.needed(5) == pytest.approx(2.0 / 2.6), "4 to 7 sessions share lines"
    assert policy.needed(2) == 0.0, "2 or 3 sessions: not measured yet"
    for rows in (32, 64, 96) * 10:
        policy.observe_pass(32, rows, 0.5 * rows)
    assert policy.needed(32) == MOST_NEEDED


def test_a_chain_stops_where_its_chance_of_being_accepted_so_far_falls_below_what_is_needed():
    policy = LookupPolicy()
    # Priors: the confidence band's lower edge, one occurrence's 1/2 at least.
    assert [policy.acceptance.chance(c) for c in (0.5, 0.6, 0.75, 0.9)] == pytest.approx([0.5, 0.55, 0.7, 0.8])

    def length(confidences: list[float], needed: float) -> int:
        chains = PassChains(policy, 1, needed)
        return next((j for j, c in enumerate(confidences) if not chains.worth(c, j == 0)), len(confidences))

    assert length([0.9, 0.9, 0.9], 0.6) == 2  # 0.8, 0.64, 0.512
    assert length([0.9, 0.9, 0.9], 0.6) == 2, "each chain starts afresh"
    assert length([0.5, 0.9], 0.2) == 2 and length([0.5, 0.9], 0.45) == 1 and length([0.5], 0.6) == 0
    for rows in (1, 2, 3, 4, 5) * 10:
        policy.observe_pass(1, rows, 0.05 + 1.0 * rows)
    assert policy.needed(1) == MOST_NEEDED and policy.for_pass(1) is None, "no band's chance is enough: nothing is looked up"


def test_chains_are_proposed_in_a_pass_only_where_their_first_tokens_pay_for_a_pass_with_chains():
    """A pass with chains costs its rows and a fixed part of its own (its tree's bookkeeping): the sessions' first
    positions' chances must pay for both, or the pass runs plain."""
    policy = LookupPolicy()
    assert policy.for_pass(4) is None, "nothing measured: the first passes run plain, for chains to be weighed against"
    for _ in range(3):
        policy.observe_pass(4, 4, 3.0)
    assert policy.for_pass(4).pays([0.5]), "plain passes measured, chains not yet: chains are proposed, and teach what they cost"
    for rows in (4, 5, 6, 8, 12) * 10:
        policy.observe_pass(4, rows, 1.4 + 0.4 * rows + (0.5 if rows > 4 else 0.0))
    chains = policy.for_pass(4)
    assert chains.needed == pytest.approx(1.6 / 3.0)
    # A token at 4 sessions is worth a plain pass's 3.0 ms over 4; a pass with chains costs 0.5 ms more, and 0.4 a row.
    assert not chains.pays([0.75]) and not chains.pays([0.5, 0.5]), "0.7 tokens for 0.9 ms, or chances below what is needed"
    assert not chains.pays([0.9, 0.9]) and chains.pays([0.9, 0.9, 0.9]), "1.6 tokens (1.2 ms) for 1.3 ms; 2.4 (1.8) for 1.7"
    assert not chains.pays([]), "no session looks anything up"
    # Turned down, the lookup rests EXPLORE_EVERY passes, then runs chains once, so that what they cost stays measured.
    assert not chains.pays([0.75])
    looked = [policy.for_pass(4) for _ in range(EXPLORE_EVERY)]
    assert looked[:-1] == [None] * (EXPLORE_EVERY - 1) and looked[-1] is not None and looked[-1].pays([0.75])
    assert policy.for_pass(4) is not None and not policy.for_pass(4).pays([0.75]), "then weighs again"


def test_verdicts_teach_each_band_its_chance_up_to_the_first_rejection():
    acceptance = Acceptance()
    for _ in range(200):
        acceptance.observe([0.5, 0.5, 0.9, 0.9], accepted=1)  # the first accepted, the second rejected, the rest untried
    assert acceptance.chance(0.5) == pytest.approx(0.5, abs=0.02)
    assert acceptance.chance(0.9) == pytest.approx(0.8), "tokens after a rejection were never tried"
    for _ in range(300):
        acceptance.observe([0.9], accepted=1)
    assert acceptance.chance(0.9) > 0.97


def test_chains_measured_on_a_slower_machine_are_weighed_as_a_multiple_of_today_s_plain_pass():
    """Chains rest while the machine speeds up: their passes count as a multiple of the plain pass they ran beside,
    so the lookup is judged at today's speed, not kept off by milliseconds measured when everything was slower."""
    policy = LookupPolicy()
    for rows in (1, 2, 3, 4, 5) * 8:  # slow: a plain pass 3 ms, each row 10% more
        policy.observe_pass(1, rows, 3.0 * (0.9 + 0.1 * rows))
    for _ in range(400):  # twice as fast since
        policy.observe_pass(1, 1, 1.5)
    plain, chained = policy._lines(1)
    assert plain[0] == pytest.approx(1.5, rel=0.01) and chained == (pytest.approx(0.9 * 1.5, rel=0.02), pytest.approx(0.15, rel=0.02))
    assert policy.for_pass(1).pays([0.5]), "half a token (0.75 ms) for a row that adds 0.15 ms today"


def test_a_tree_shape_s_first_passes_are_left_out_of_what_chains_cost():
    """The first pass of each tree shape carries one-time costs (here ten times a later one's): left in, the line
    would say chains cost several plain passes and the lookup would rest."""
    policy = LookupPolicy()
    for _ in range(4):
        policy.observe_pass(4, 4, 3.0)
    for rows in (5, 6, 8, 12):
        policy.observe_pass(4, rows, 10 * (1.9 + 0.4 * rows))
    for rows in (5, 6, 8, 12) * 7:
        policy.observe_pass(4, rows, 1.9 + 0.4 * rows)
    chains = policy.for_pass(4)
    assert chains.needed == pytest.approx(1.6 / 3.0)
    assert chains.pays([0.9, 0.9, 0.9]), "2.4 tokens (1.8 ms) for 1.7 ms"


def test_a_pass_is_judged_by_what_chains_of_its_first_tokens_band_brought_not_by_their_first_token_alone():
    """Text that repeats itself has chains accepted whole: a pass with chains pays where one token a chain would not."""
    policy = LookupPolicy()
    for rows in (4, 5, 6, 8, 12) * 10:
        policy.observe_pass(4, rows, 1.4 + 0.4 * rows + (0.5 if rows > 4 else 0.0))
    assert not policy.for_pass(4).pays([0.75]), "a chain of one token at 0.7 (0.5 ms) for 0.9 ms"
    policy.resting.clear()
    for _ in range(100):
        policy.acceptance.observe([0.75] * 4, accepted=4)
    assert policy.acceptance.chain(0.75) == (pytest.approx(4.0, abs=0.1), pytest.approx(4.0, abs=0.1))
    assert policy.acceptance.chain(0.9) == (pytest.approx(0.8), 1.0), "other bands keep their own"
    assert policy.for_pass(4).pays([0.75]), "four tokens (3 ms) for four rows (2.1 ms)"


def _dear_lines(policy: LookupPolicy) -> None:
    """Passes at 4 sessions where chains are dear: a pass with chains 0.5 ms above a plain one and 0.4 ms a row,
    against a plain pass's 3.0 ms for 4 tokens."""
    for _ in range(3):
        policy.observe_pass(4, 4, 3.0)
    for rows in (4, 5, 6, 8, 12) * 10:
        policy.observe_pass(4, rows, 1.4 + 0.4 * rows + (0.5 if rows > 4 else 0.0))


def _turned_down(policy: LookupPolicy) -> None:
    _dear_lines(policy)
    assert not policy.for_pass(4).pays([0.75])


def _rest(policy: LookupPolicy) -> int:
    """Passes until the lookup explores (runs chains it would turn down), that exploration's pass included."""
    for waited in range(1, 100 * EXPLORE_EVERY):
        chains = policy.for_pass(4)
        if chains is not None:
            assert chains.pays([0.75]), "after its rest the lookup explores"
            return waited
    raise AssertionError("the lookup never explored")


def test_explorations_that_lose_double_the_next_rest_and_one_that_pays_restores_it():
    """An exploration is a pass whose chains the lines turned down: what it measures decides how long the lookup rests
    before the next, so that explorations that keep losing cost ever less (at most 2**MAX_EXPLORE_BACKOFF rests)."""
    policy = LookupPolicy()
    _turned_down(policy)
    assert _rest(policy) == EXPLORE_EVERY
    rests = []
    for _ in range(MAX_EXPLORE_BACKOFF + 1):
        policy.observe_pass(4, 5, 3.0 + 1.3, accepted=1)  # 1 token saved 0.75 ms, the chain added 1.3
        assert not policy.for_pass(4).pays([0.75])
        rests.append(_rest(policy))
    assert rests == [EXPLORE_EVERY << min(n, MAX_EXPLORE_BACKOFF) for n in range(1, MAX_EXPLORE_BACKOFF + 2)]
    policy.observe_pass(4, 4, 3.0)  # a plain pass between: the exploration is the next pass with chains
    policy.observe_pass(4, 6, 3.0 + 1.3, accepted=2)  # 2 tokens saved 1.5 ms for 1.3: it paid
    assert not policy.for_pass(4).pays([0.75])
    assert _rest(policy) == EXPLORE_EVERY, "an exploration that paid restores the rest"


def test_passes_with_chains_the_lines_chose_do_not_move_the_rest():
    """Only explorations judge the rest: a pass whose chains the lines found paying is not an exploration."""
    policy = LookupPolicy()
    _dear_lines(policy)
    assert policy.for_pass(4).pays([0.9, 0.9, 0.9]), "2.4 tokens (1.8 ms) for 1.7: paying"
    policy.observe_pass(4, 7, 3.0 + 1.9, accepted=0)  # it lost
    assert not policy.for_pass(4).pays([0.75])
    assert _rest(policy) == EXPLORE_EVERY


def test_chains_rest_where_the_passes_that_ran_them_lost_though_the_lines_say_they_pay():
    """What passes with chains measured (accepted tokens' share of a plain pass, against what they added to one) wins
    over the lines: chains the lines find paying rest once such passes lost, until an exploration wins it back."""
    policy = LookupPolicy()
    _dear_lines(policy)
    assert policy.for_pass(4).pays([0.9, 0.9, 0.9]), "2.4 tokens (1.8 ms) for 1.7: paying"
    for _ in range(3):
        policy.observe_pass(4, 7, 3.0 + 1.7, accepted=1)  # 0.75 ms saved for 1.7 added
    assert policy.gained(4) == pytest.approx(-0.95 * (1 + 0.99 + 0.99**2))
    assert not policy.for_pass(4).pays([0.9, 0.9, 0.9]), "the passes lost: chains rest"
    assert policy.gained(1) == 0.0, "each bucket of sessions keeps its own"
    assert _rest(policy) == EXPLORE_EVERY
    policy.observe_pass(4, 7, 3.0 + 1.7, accepted=7)  # 5.25 ms saved for 1.7: the exploration wins it back
    assert policy.gained(4) > 0 and policy.for_pass(4).pays([0.9, 0.9, 0.9])


def test_forced_chains_go_as_deep_as_their_tokens_are_accepted_often_enough_to_pay_for_their_rows():
    from verifier_service.lookup import ForcedAcceptance

    forced = ForcedAcceptance()
    assert forced.worth(6, 0.9) == 6, "untried: every depth is hoped for"
    for _ in range(40):  # the target keeps the first two tokens of a chain of five, and rejects the third
        forced.observe(5, 2)
    assert forced.chance(1) > 0.95 and forced.chance(2) < 0.05
    assert forced.worth(5, 0.5) == 2 and forced.worth(5, 0.0) == 5 and forced.worth(1, 0.5) == 1
