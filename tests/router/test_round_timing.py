"""Where a round's time goes (router/rounds.py, RoundPlan): the router's own time is the round's wall time
less its longest draft call and its longest verify call, so that the phases add up to the round."""

from __future__ import annotations

import pytest

from router.rounds import RoundPlan


def test_the_router_s_time_and_the_longest_calls_add_up_to_the_round():
    plan = RoundPlan(requests=[])
    for wall in (2.5, 6.0, 4.0):  # concurrent draft calls: the round waited for the longest
        plan.called("draft", wall)
    plan.called("verify", 9.0)
    plan.called("verify", 3.0)
    assert (plan.draft_calls_ms, plan.verify_calls_ms) == (6.0, 9.0)
    wall_ms = 17.25
    router_ms = plan.router_ms(wall_ms)
    assert router_ms == pytest.approx(2.25)
    assert router_ms + plan.draft_calls_ms + plan.verify_calls_ms == pytest.approx(wall_ms)


def test_a_round_without_calls_is_all_the_router_s_time():
    assert RoundPlan(requests=[]).router_ms(1.5) == 1.5
    plan = RoundPlan(requests=[])
    plan.called("verify", 4.0)
    assert plan.router_ms(5.0) == pytest.approx(1.0) and plan.router_ms(3.0) == 0.0  # never below zero
