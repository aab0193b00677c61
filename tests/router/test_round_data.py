"""A round's data: the router's call records become the contract's messages at the transport, field for field."""

from __future__ import annotations

import gc

from router import messages, transport
from router.planning import _depths
from router.rounds import plain_steps
from router.request import RequestSpec, RequestState
from router.rounds import RecentLoad, RequestPlan, RoundPlan
from specfleet.guides import Guide
from specfleet.sampling import SamplingParams
from specfleet.v1 import common_pb2, drafter_pb2, verifier_pb2


def _every_field_set(message) -> list[str]:
    """The fields of `message` (recursively) left at their defaults: a record field the transport does not carry."""
    unset = []
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and not field.is_repeated:
            unset += [f"{field.name}.{name}" for name in _every_field_set(value)] if message.HasField(field.name) else [field.name]
        elif not value:
            unset.append(field.name)
    return unset


SAMPLING = SamplingParams(
    temperature=0.7,
    top_p=0.9,
    top_k=5,
    seed=123,
    drafter_invariant=True,
    logit_bias=((4, -100.0), (9, 2.5)),
    presence_penalty=0.5,
    frequency_penalty=-0.25,
    repetition_penalty=1.25,
    output_start=3,
    min_tokens=2,
    held_back=(0, 7),
    guide=Guide("json", "{}", compact=True, thought_end=(3, 4), thought_open=5),
    min_p=0.25,
    allowed_token_ids=(1, 2, 5),
    bad_words=((3,), (4, 6)),
)


def test_draft_and_verify_records_carry_every_field_of_the_contract():
    draft = messages.DraftSession(
        sync=messages.SessionSync("s", 3, [1, 2], "tenant"),
        model="m",
        num_draft_tokens=4,
        sampling=SAMPLING,
        stop_below_confidence=0.25,
        score_context=True,
        lockstep_group="g",
    )
    (sent,) = transport.draft_request([draft]).sessions
    assert not _every_field_set(sent), _every_field_set(sent)
    assert (sent.sync.session_id, sent.sync.prefix_length, list(sent.sync.new_token_ids), sent.sync.cache_salt) == ("s", 3, [1, 2], "tenant")
    assert (sent.model, sent.num_draft_tokens, sent.score_context, sent.lockstep_group) == ("m", 4, True, "g")
    assert abs(sent.stop_below_confidence - 0.25) < 1e-7
    got = SamplingParams.from_proto(sent.sampling)
    assert (round(got.temperature, 6), round(got.top_p, 6), got.top_k, got.seed, got.drafter_invariant) == (0.7, 0.9, 5, 123, True)
    adjustments = (
        got.logit_bias,
        got.presence_penalty,
        got.frequency_penalty,
        got.repetition_penalty,
        got.output_start,
        got.min_tokens,
        got.held_back,
        got.guide,
        got.min_p,
        got.allowed_token_ids,
        got.bad_words,
    )
    assert adjustments == (SAMPLING.logit_bias, 0.5, -0.25, 1.25, 3, 2, (0, 7), SAMPLING.guide, 0.25, (1, 2, 5), ((3,), (4, 6)))

    proposal = transport.point_mass(7)
    tree = messages.TokenTree(token_ids=[7, 8], parents=[-1, 0], proposals=[proposal, proposal])
    verify = messages.VerifySession(
        sync=messages.SessionSync("s", 1, [9], "tenant"),
        tree=tree,
        sampling=SAMPLING,
        logprobs=True,
        top_logprobs=2,
        prompt_logprobs=True,
        prompt_top_logprobs=4,
        plain_steps=5,
        lookup_tokens=3,
        max_tokens=9,
    )
    (sent,) = transport.verify_request([verify]).sessions
    assert not _every_field_set(sent), _every_field_set(sent)
    assert (list(sent.tree.token_ids), list(sent.tree.parents), list(sent.tree.proposals)) == ([7, 8], [-1, 0], [proposal, proposal])
    assert (sent.logprobs, sent.top_logprobs, sent.plain_steps, sent.lookup_tokens, sent.max_tokens) == (True, 2, 5, 3, 9)
    assert (sent.prompt_logprobs, sent.prompt_top_logprobs) == (True, 4)


def test_replies_become_records():
    drafted = drafter_pb2.DraftedSession(
        session_id="s",
        status=common_pb2.SESSION_OK,
        token_ids=[4, 5],
        proposals=[transport.point_mass(4), transport.point_mass(5)],
        confidences=[0.5, 0.25],
        context_log_prob=-1.5,
        context_tokens=3,
    )
    lost = drafter_pb2.DraftedSession(session_id="t", status=common_pb2.SESSION_UNKNOWN)
    reply = transport.draft_response(drafter_pb2.DraftResponse(sessions=[drafted, lost], compute_ms=2.0))
    assert reply.compute_ms == 2.0 and [s.known for s in reply.sessions] == [True, False]
    first = reply.sessions[0]
    assert (first.token_ids, first.confidences, first.context_log_prob, first.context_tokens) == ([4, 5], [0.5, 0.25], -1.5, 3)
    assert [list(p.token_ids) for p in first.proposals] == [[4], [5]]

    verified = verifier_pb2.VerifiedSession(
        session_id="s",
        status=common_pb2.SESSION_OK,
        accepted_nodes=[0],
        token_ids=[4, 6],
        logprobs=[-0.5, -1.0],
        top_token_ids=[4, 6],
        top_logprobs=[-0.5, -1.0],
        lookup_proposed=4,
        lookup_accepted=1,
        prompt_logprobs=verifier_pb2.PromptLogprobs(logprobs=[-2.0], ranks=[3], top_token_ids=[1], top_logprobs=[-0.25]),
        cached_tokens=16,
    )
    reply = transport.verify_response(verifier_pb2.VerifyResponse(sessions=[verified], compute_ms=3.0, batch_size=5, passes=3, shared_ms=0.5))
    (got,) = reply.sessions
    assert (reply.compute_ms, reply.batch_size, reply.passes, reply.shared_ms) == (3.0, 5, 3, 0.5)
    assert (got.known, got.accepted_nodes, got.token_ids, got.cached_tokens) == (True, [0], [4, 6], 16)
    assert transport.verify_response(verifier_pb2.VerifyResponse(compute_ms=1.0)).passes == 1, "a server that does not say ran one pass"
    assert (got.logprobs, got.top_token_ids, got.top_logprobs) == ([-0.5, -1.0], [4, 6], [-0.5, -1.0])
    assert (got.lookup_proposed, got.lookup_accepted) == (4, 1)
    assert got.prompt_logprobs == messages.PromptLogprobs([-2.0], [3], [1], [-0.25])
    assert transport.verify_response(verifier_pb2.VerifyResponse(sessions=[verifier_pb2.VerifiedSession()])).sessions[0].prompt_logprobs is None


def test_a_requests_sampling_message_is_built_once_and_goes_with_it():
    params = SamplingParams(temperature=1.0, seed=99)
    first = transport.sampling_message(params)
    assert transport.sampling_message(params) is first  # every later round reuses it
    gc.collect()  # entries of earlier tests' requests, gone already, leave first: only this one is counted below
    held = len(transport._sampling_messages)
    del params, first
    gc.collect()
    assert len(transport._sampling_messages) == held - 1


def test_the_plan_gives_each_drafter_its_depth():
    assert _depths(1, 4, 2) == [4]
    assert _depths(3, 4, 2) == [4, 2, 2]  # siblings at the first fusion_depth positions only
    assert _depths(3, 4, 0) == [4, 4, 4]  # 0: every position
    assert _depths(2, 1, 2) == [1, 1]
    plan = RoundPlan([RequestPlan(state=None, drafters=["a", "b"], depths=[4, 2]), RequestPlan(state=None)])
    assert [r.k for r in plan.requests] == [4, 0]
    assert plan.drafting() == plan.requests[:1]


def _state(rounds: int, max_tokens: int = 32, generated: int = 0) -> RequestState:
    spec = RequestSpec(
        request_id=f"s{rounds}-{max_tokens}",
        session_id=f"s{rounds}-{max_tokens}",
        prompt_ids=[1, 2, 3],
        max_tokens=max_tokens,
        sampling=SamplingParams(),
        stop=[],
        stop_at_eos=True,
        max_draft_tokens=4,
        domain="",
    )
    state = RequestState(spec=spec, tokenizer=None, eos_token_id=0, max_context=512, deadline=None)
    state.tokens += [7] * generated
    state.rounds = rounds
    return state


def test_a_round_where_nobody_drafts_decodes_plain_steps_as_far_as_each_request_may_go():
    first, going, last = _state(0), _state(3, generated=3), _state(5, max_tokens=8, generated=6)
    plain = [RequestPlan(first), RequestPlan(going), RequestPlan(last)]
    plain_steps(plain, 4)
    # The first round's token streams at once; the last request has two tokens left.
    assert [r.plain_steps for r in plain] == [1, 4, 2]
    one = [RequestPlan(_state(3, generated=3))]
    plain_steps(one, 1)
    assert one[0].plain_steps == 1
    mixed = [RequestPlan(_state(3, generated=3)), RequestPlan(_state(3, generated=3), drafters=["a"], depths=[4])]
    plain_steps(mixed, 4)
    assert [r.plain_steps for r in mixed] == [1, 1], "a round that drafts for one request verifies in one pass"


def test_the_load_a_round_runs_under_is_the_most_running_over_the_last_rounds():
    """Four requests that end together leave a round or two with one running while their clients' next ones arrive:
    those rounds run under the load of four, and a load that really falls is followed eight rounds later."""
    load = RecentLoad(rounds=8)
    assert [load.observe(n) for n in [1, 2, 4, 4, 4, 1, 2, 3, 4]] == [1, 2, 4, 4, 4, 4, 4, 4, 4]
    assert [load.observe(1) for _ in range(8)] == [4] * 7 + [1]
