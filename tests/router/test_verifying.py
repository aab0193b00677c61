"""router/verifying.py: what a verify call's reply teaches the router, where the verifier's pass served other calls
too (a prompt prefilled beside the last of another call's plain steps: specfleet/batching.py `BatchQueue.answer`)."""

from __future__ import annotations

import asyncio

import pytest

from router import messages
from router.cost_model import CostModel
from router.rounds import PREFILL_TOKENS_PER_S, RequestPlan, RoundContext, RoundPlan, SchedulerConfig
from router.speculation import SpeculationController
from router.verifiers import VerifierPool
from router.verifying import VERIFY_DEADLINE_FLOOR_S, Verifying
from tests.router.test_drafting import Chunked
from tests.router.test_lookup import _state


class SharedPass:
    """A verifier replica whose one pass of 10 ms also served another call's sessions, 6 ms of its work."""

    address = "replica"

    async def verify(self, sessions, timeout_s):
        replies = [messages.VerifiedSession(True, token_ids=[5]) for _ in sessions]
        return messages.VerifyResponse(replies, compute_ms=10.0, batch_size=len(sessions), passes=1, shared_ms=6.0)


def test_a_pass_shared_with_other_calls_counts_only_this_call_s_work_as_busy_and_as_its_cost():
    """The pass is the round's compute, as the request's timings say; the work that went to the other call's sessions
    is neither the verifier's busy time for this call nor what the cost model learns a pass of these sessions costs:
    counted, a prompt's prefill beside a few sessions' last plain step made their steps look dearer than they are."""
    cost = CostModel(verify_base=2.0, verify_per_session=0.0, verify_per_token=0.0, verify_call=0.0)
    context = RoundContext(SchedulerConfig(), {}, None, SpeculationController(cost))
    verifying = Verifying(context, VerifierPool([SharedPass()], wait_s=60))
    state = _state("a", 4)
    for _ in range(2):  # the prompt's call (which the cost model leaves out), then a call of the token that predicts
        asyncio.run(verifying.verify(RoundPlan([RequestPlan(state)]), {}))
    assert state.timing_ms["verify_compute"] == 20.0 and state.tokens[-2:] == [5, 5]
    assert context.metrics.verify_busy_ms == 8.0
    # One pass of 4 ms where 2 ms were modelled: the scale moves a step (1 - forget) from 1 toward 2, not toward 5.
    assert cost.verify_scale == pytest.approx(1.0 + (1 - cost.forget) * (2.0 - 1.0))


class Measured:
    """A verifier replica whose passes take 1 ms whatever they feed (a prompt's prefill is cheaper per row than the
    start-up fit charges a verified row)."""

    address = "replica"

    async def verify(self, sessions, timeout_s):
        replies = [messages.VerifiedSession(True, token_ids=[5]) for _ in sessions]
        return messages.VerifyResponse(replies, compute_ms=1.0, batch_size=len(sessions), passes=1)


def test_a_call_that_prefills_a_prompt_teaches_the_cost_model_nothing():
    """A new request's first call feeds its whole prompt: its pass is no measure of a verified row's cost, and learned
    from, prompts pulled the scale of drafted passes to about 0.55 at four clients on the held-out workload. A call
    that feeds the one token that predicts is learned from."""
    cost = CostModel(verify_base=0.5, verify_per_session=0.0, verify_per_token=0.25, verify_call=0.0)
    verifying = Verifying(RoundContext(SchedulerConfig(), {}, None, SpeculationController(cost)), VerifierPool([Measured()], wait_s=60))
    new = _state("new", 4)  # nothing held yet: the first call sends the prompt
    asyncio.run(verifying.verify(RoundPlan([RequestPlan(new)]), {}))
    assert new.tokens[-1] == 5 and cost.verify_scale == 1.0, "the prompt's call left the scale alone"
    asyncio.run(verifying.verify(RoundPlan([RequestPlan(new)]), {}))
    assert cost.verify_scale > 1.0, "a call of one token a session moves it (1 ms against 0.75 modelled)"


def test_a_call_that_goes_on_prefilling_a_prompt_in_chunks_has_the_deadline_of_its_prefill():
    """A prompt prefilled in chunks: the calls after the first send no new tokens, yet each may prefill a chunk of
    the prompt at any length of it. Their deadline allows for the rest of the prompt as the first call's did for all
    of it (on a loaded machine a chunk at 19,000 tokens of context outran a deadline of the pass alone: the call
    failed and the request went on without its drafts); once the prompt is in, the deadline is the pass's again."""
    replica = Chunked(chunks=2)
    cost = CostModel(verify_base=0.5, verify_per_session=0.0, verify_per_token=0.25, verify_call=0.0)
    verifying = Verifying(RoundContext(SchedulerConfig(), {}, None, SpeculationController(cost)), VerifierPool([replica], wait_s=60))
    state = _state("long", 4, prompt=list(range(1, 1281)), max_context=4096)  # 20 s of prefill at PREFILL_TOKENS_PER_S
    for _ in range(4):
        asyncio.run(verifying.verify(RoundPlan([RequestPlan(state)]), {}))
    floor = VERIFY_DEADLINE_FLOOR_S
    assert replica.deadlines[:3] == pytest.approx([floor + 1280 / PREFILL_TOKENS_PER_S] * 3)
    assert replica.deadlines[3] == pytest.approx(floor) and state.tokens[1280:] == [5, 5]
