"""router/drafting.py: what a draft call is given (its deadline) and what its reply leaves the router holding."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from router import messages
from router.cost_model import CostModel
from router.drafters import DrafterService
from router.drafting import DRAFT_DEADLINE_FLOOR_S, DraftCall, Drafting
from router.rounds import PREFILL_TOKENS_PER_S, RoundContext, SchedulerConfig
from router.speculation import SpeculationController
from tests.router.test_lookup import _state


class Chunked:
    """A replica, of a drafter service or of the verifier, that prefills a long prompt in chunks: its first `chunks`
    answers say `prefilling`, then it drafts or verifies one token; it records each call's deadline."""

    name = address = "replica"

    def __init__(self, chunks: int):
        self.chunks, self.deadlines = chunks, []

    def _prefilling(self, timeout_s: float) -> bool:
        self.deadlines.append(timeout_s)
        return len(self.deadlines) <= self.chunks

    async def draft(self, sessions, timeout_s):
        prefilling = self._prefilling(timeout_s)
        replies = [messages.DraftedSession(True, prefilling=prefilling, token_ids=[] if prefilling else [7]) for _ in sessions]
        return messages.DraftResponse(replies, compute_ms=1.0)

    async def verify(self, sessions, timeout_s):
        prefilling = self._prefilling(timeout_s)
        replies = [messages.VerifiedSession(True, prefilling=prefilling, token_ids=[] if prefilling else [5]) for _ in sessions]
        return messages.VerifyResponse(replies, compute_ms=1.0, batch_size=len(sessions), passes=1)


def test_a_draft_call_that_goes_on_prefilling_a_prompt_in_chunks_has_the_deadline_of_its_prefill():
    """The drafter's side of a prompt prefilled in chunks (drafter_service/drafter.py `_catch_up`): the calls after the
    first send no new tokens, yet each may prefill a chunk at any length of the prompt. With a deadline of the
    modelled draft alone (a second), a chunk at 19,000 tokens of context on a loaded machine failed the call, opened
    the breaker and reset the request's session there: the drafter began the prompt again and the request never drafted
    (tests/e2e/test_call_limits.py's 20,000-token prompt). Their deadline allows for the rest of the prompt as the first
    call's did for all of it; once the drafter drafts, it is the draft's again."""
    replica = Chunked(chunks=2)
    cost = CostModel(draft_base=1.0, draft_per_token=0.5, draft_call=0.0)
    context = RoundContext(
        SchedulerConfig(), {"d": DrafterService("drafters", [replica])}, SimpleNamespace(model_free=frozenset()), SpeculationController(cost)
    )
    drafting = Drafting(context, in_background=lambda coroutine: coroutine.close())
    state = _state("long", 4, prompt=list(range(1, 1281)), max_context=4096)  # 20 s of prefill at PREFILL_TOKENS_PER_S
    drafted = [asyncio.run(drafting._calls([DraftCall(state, "d", list(state.tokens), 3)])) for _ in range(4)]
    floor = DRAFT_DEADLINE_FLOOR_S
    assert replica.deadlines[:3] == pytest.approx([floor + 1280 / PREFILL_TOKENS_PER_S] * 3)
    assert replica.deadlines[3] == pytest.approx(floor)
    assert [len(d) for d in drafted] == [1, 1, 1, 1] and drafted[3][0].drafted.token_ids == [7]
