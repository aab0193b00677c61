"""router.verifiers.VerifierPool's bookkeeping, with a hand-driven clock (no network: the failover itself
runs against real processes in tests/e2e/test_supervision.py and tests/e2e/test_ray.py)."""

from __future__ import annotations

from router.request import RequestSpec, RequestState
from router.transport import TransportError
from router.verifiers import VerifierPool
from specfleet.sampling import SamplingParams


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Replica:
    def __init__(self, address: str):
        self.address = address


def request(session_id: str) -> RequestState:
    spec = RequestSpec(
        request_id=session_id,
        session_id=session_id,
        prompt_ids=[1, 2, 3],
        max_tokens=8,
        sampling=SamplingParams(),
        stop=[],
        stop_at_eos=True,
        max_draft_tokens=0,
        domain="",
    )
    return RequestState(spec=spec, tokenizer=None, eos_token_id=0, max_context=64, deadline=None, tokens=[1, 2, 3])


def test_a_request_arriving_while_no_replica_is_live_waits_at_most_wait_s():
    """Also when the replica was found dead by a health check, before any call of this request failed."""
    clock = Clock()
    pool = VerifierPool([Replica("a")], wait_s=10, clock=clock)
    pool.breaker.failed("a")  # what a failed health check does
    state = request("s1")
    assert pool.place(state) is None and not pool.waited_too_long(state)
    clock.now += 9
    assert pool.place(state) is None and not pool.waited_too_long(state)
    clock.now += 2
    assert pool.place(state) is None and pool.waited_too_long(state)


def test_a_failed_call_moves_requests_to_the_live_replica_and_success_clears_the_wait():
    clock = Clock()
    pool = VerifierPool([Replica("a"), Replica("b")], wait_s=10, clock=clock)
    first, second = request("s1"), request("s2")
    assert {pool.place(first), pool.place(second)} == {"a", "b"}
    on_a = first if pool.place(first) == "a" else second
    pool.failed("a", [on_a], TransportError("UNAVAILABLE"))
    assert pool.place(on_a) == "b" and pool.moves == 1
    pool.succeeded([on_a])
    clock.now += 60
    assert not pool.waited_too_long(on_a)
