"""router/verifying.py asks the verifier to look up chains in plain steps (`router.lookup_tokens`), within each
request's max_draft_tokens and never where speculation is off or the round decodes one token, and counts what the
lookup drafted and the target accepted as the request's drafter `lookup`."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

from router import messages
from router.request import RequestSpec, RequestState
from router.rounds import RequestPlan, RoundContext, RoundPlan, SchedulerConfig
from router.verifiers import VerifierPool
from router.verifying import LOOKUP, Verifying
from specfleet.config import SchedulingConfig
from specfleet.sampling import SamplingParams
from tests.router.test_drafter_choice import cost
from router.speculation import SpeculationController


def _state(name: str, max_draft_tokens: int, prompt: list[int] | None = None, max_context: int = 512) -> RequestState:
    spec = RequestSpec(name, name, prompt or [1, 2, 3], 32, SamplingParams(), [], True, max_draft_tokens, "")
    tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: " ".join(map(str, ids)))
    state = RequestState(spec=spec, tokenizer=tokenizer, eos_token_id=0, max_context=max_context, deadline=None)
    state.rounds = 1
    return state


class Replica:
    """A verifier replica that records the sessions it is sent and answers each with two tokens, one of them looked up
    where the session asked for lookup."""

    address = "replica"

    def __init__(self):
        self.sent: list[messages.VerifySession] = []

    async def verify(self, sessions, timeout_s):
        self.sent += sessions
        replies = [
            messages.VerifiedSession(True, token_ids=[5, 6], lookup_proposed=3 if s.lookup_tokens else 0, lookup_accepted=1 if s.lookup_tokens else 0)
            for s in sessions
        ]
        return messages.VerifyResponse(replies, compute_ms=1.0, batch_size=len(sessions), passes=1)


def test_plain_steps_ask_for_lookup_within_each_request_s_drafts_and_count_what_it_drafted():
    replica = Replica()
    config = SchedulerConfig(dataclasses.replace(SchedulingConfig(), lookup_tokens=4))
    controller = SpeculationController(cost(1.0))
    verifying = Verifying(RoundContext(config, {}, None, controller), VerifierPool([replica], wait_s=60))
    wide, narrow, off, first = _state("wide", 16), _state("narrow", 2), _state("off", 0), _state("first", 16)
    plan = RoundPlan([RequestPlan(wide, plain_steps=8), RequestPlan(narrow, plain_steps=8), RequestPlan(off, plain_steps=8), RequestPlan(first)])
    asyncio.run(verifying.verify(plan, {}))
    assert [s.lookup_tokens for s in replica.sent] == [4, 2, 0, 0], "speculation off, or a round of one token, looks nothing up"
    assert [s.max_tokens for s in replica.sent] == [32, 32, 0, 0], "a call with chains stops at what the request keeps"
    for state in (wide, narrow):
        assert (state.draft_tokens, state.accepted_tokens) == (3, 1)
        assert {name: (c.rounds, c.draft_tokens, c.accepted_tokens) for name, c in state.per_drafter.items()} == {LOOKUP: (1, 3, 1)}
    assert (off.draft_tokens, off.per_drafter) == (0, {})
    assert [s.tokens[-2:] for s in (wide, narrow, off, first)] == [[5, 6]] * 4
    # The cost model learns what the lookup adds to a plain pass at four sessions a call (each session's one pass
    # committed its chain's accepted token and one of its own), and the round's rows are compared with its wall time.
    assert controller.cost.lookup_per_pass(4) == (1.0, 3.0) and controller.cost.lookup_per_pass(1) == (0.0, 0.0)
    assert plan.lookup_rows == 6
    plan.modelled_ms = 20.0
    assert plan.modelled_with_lookup(0.5) == 23.0


def test_a_round_the_measured_check_sent_to_plain_decoding_looks_nothing_up():
    """The lookup is speculation: a round decoded plainly and unrouted (the measured check's k = 0) asks for none, so
    that the check weighs speculating, lookup included, against plain decoding as speculation off runs it."""
    replica = Replica()
    config = SchedulerConfig(dataclasses.replace(SchedulingConfig(), lookup_tokens=4))
    verifying = Verifying(RoundContext(config, {}, None, SpeculationController(cost(1.0))), VerifierPool([replica], wait_s=60))
    state = _state("wide", 16)
    asyncio.run(verifying.verify(RoundPlan([RequestPlan(state, plain_steps=8)], routed=False), {}))
    assert [s.lookup_tokens for s in replica.sent] == [0] and state.per_drafter == {}
