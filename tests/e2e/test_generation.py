"""End to end through real gRPC: specfleet's output is the target model's own output."""

from __future__ import annotations

import concurrent.futures
import math

import grpc
import pytest

from specfleet.config import SchedulingConfig
from specfleet.v1 import common_pb2, drafter_pb2_grpc, generation_pb2, generation_pb2_grpc, verifier_pb2_grpc
from tests.harness import Cluster, cluster_config
from specfleet.tokenizer import load_tokenizer
from tests.helpers import PROMPTS, greedy_request, target_greedy, target_logprobs

MAX_TOKENS = 64


@pytest.fixture(scope="module")
def stub(cluster):
    with cluster.channel() as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def reference(random_family):
    path = str(random_family["target"])
    return {p: target_greedy(path, p, MAX_TOKENS) for p in PROMPTS}


@pytest.mark.parametrize("k", range(1, 9))
def test_greedy_output_equals_target_generate(stub, reference, k):
    futures = {p: stub.Generate.future(greedy_request(p, MAX_TOKENS, k), timeout=300) for p in PROMPTS}
    accepted = drafted = 0
    for prompt, future in futures.items():
        reply = future.result()
        assert list(reply.token_ids) == reference[prompt], f"k={k} prompt={prompt!r}"
        assert reply.finish_reason == ("eos" if len(reply.token_ids) < MAX_TOKENS else "length")
        assert reply.usage.completion_tokens == len(reply.token_ids)
        accepted += reply.speculation.accepted_tokens
        drafted += reply.speculation.draft_tokens
    # The drafter really proposed, and the target both accepted and rejected some proposals,
    # so both paths of the verification were exercised.
    assert 0 < accepted < drafted


def test_speculation_disabled_is_plain_decoding(stub, reference):
    prompt = PROMPTS[0]
    request = greedy_request(prompt, MAX_TOKENS)
    request.speculation.disabled = True
    reply = stub.Generate(request, timeout=120)
    assert list(reply.token_ids) == reference[prompt]
    assert reply.speculation.draft_tokens == 0
    # The first round decodes the first token, each later one up to plain_steps (router/rounds.py `plain_steps`).
    steps = SchedulingConfig().plain_steps
    assert steps > 1 and reply.speculation.rounds == 1 + math.ceil((len(reply.token_ids) - 1) / steps)


def test_prompt_logprobs_travel_from_a_verifier_of_its_own(stub, reference, random_family):
    """The verifier in a process of its own answers a prompt's log-probabilities over gRPC (verifier.proto's
    PromptLogprobs), as the one in the router's process does (tests/e2e/test_openai_api.py); the output is unchanged."""
    prompt = PROMPTS[0]
    reply = stub.Generate(greedy_request(prompt, MAX_TOKENS, 4, prompt_logprobs=2), timeout=300)
    assert list(reply.token_ids) == reference[prompt]
    prompt_ids = load_tokenizer(str(random_family["target"])).encode(prompt, add_special_tokens=False)
    chosen, _, best_values = target_logprobs(str(random_family["target"]), prompt_ids[:1], prompt_ids[1:], 2)
    assert [lp.token_id for lp in reply.prompt_logprobs] == prompt_ids[1:]
    assert [lp.logprob for lp in reply.prompt_logprobs] == pytest.approx(chosen, abs=1e-3)
    assert [[t.logprob for t in lp.top] for lp in reply.prompt_logprobs] == [pytest.approx(v, abs=1e-3) for v in best_values]
    assert all(lp.rank >= 1 for lp in reply.prompt_logprobs)


def test_stream_delivers_the_same_tokens_and_text(stub, reference):
    prompt = PROMPTS[1]
    chunks = list(stub.GenerateStream(greedy_request(prompt, MAX_TOKENS, 4), timeout=120))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == reference[prompt]
    assert len(chunks) > 1
    assert [bool(c.finish_reason) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    full = stub.Generate(greedy_request(prompt, MAX_TOKENS, 4), timeout=120)
    assert "".join(c.text for c in chunks) == full.text
    assert chunks[-1].usage.completion_tokens == len(tokens)


def test_sixteen_concurrent_clients(cluster, reference):
    def client(i: int):
        prompt = PROMPTS[i % len(PROMPTS)]
        with cluster.channel() as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            if i % 2:
                tokens = [t for c in stub.GenerateStream(greedy_request(prompt, MAX_TOKENS, 1 + i % 8), timeout=300) for t in c.token_ids]
            else:
                tokens = list(stub.Generate(greedy_request(prompt, MAX_TOKENS, 1 + i % 8), timeout=300).token_ids)
        return prompt, tokens

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(client, range(16)))
    for prompt, tokens in results:
        assert tokens == reference[prompt]


def test_stop_string_ends_generation_before_it(stub, reference):
    prompt = PROMPTS[0]
    full = stub.Generate(greedy_request(prompt, MAX_TOKENS, 4), timeout=120)
    stop = full.text[10:13]
    assert stop
    reply = stub.Generate(greedy_request(prompt, MAX_TOKENS, 4, stop=[stop]), timeout=120)
    assert reply.finish_reason == "stop"
    assert reply.text == full.text[: full.text.index(stop)]
    assert list(reply.token_ids) == reference[prompt][: len(reply.token_ids)]


@pytest.mark.parametrize("keep_tokens", [True, False], ids=["kv-evicted", "session-forgotten"])
def test_evicting_sessions_mid_generation_changes_nothing(cluster, stub, reference, keep_tokens):
    """Drop the verifier's and drafter's state for a request while it runs: output is unchanged.

    The router is paused while the state is dropped, so no round runs meanwhile; a request that finished
    before the pause (nothing to drop) is tried again rather than counted."""
    from tests.operations import paused, service_pid, session_of

    prompt = PROMPTS[3]
    for attempt in range(3):
        request = greedy_request(prompt, MAX_TOKENS, 3, request_id=f"evict-{keep_tokens}-{attempt}")
        stream = stub.GenerateStream(request, timeout=120)
        tokens = list(next(stream).token_ids)
        release = common_pb2.ReleaseRequest(session_ids=[session_of(cluster, request.request_id)], keep_tokens=keep_tokens)
        with paused(service_pid(cluster, "router")):
            with cluster.channel(cluster.verifier) as vch, cluster.channel(cluster.drafter) as dch:
                released = verifier_pb2_grpc.VerifierStub(vch).ReleaseSessions(release, timeout=10).released
                released += drafter_pb2_grpc.DrafterStub(dch).ReleaseSessions(release, timeout=10).released
        tokens += [t for chunk in stream for t in chunk.token_ids]
        assert tokens == reference[prompt]
        if released:
            break
    assert released >= 1, "the request finished before its sessions could be released, three times"


def test_tiny_cache_budget_forces_rebuilds_without_changing_output(random_family, tmp_path, reference):
    """KV budgets of a few bytes and room for two sessions: every round rebuilds or resends."""
    tight = {"max_cache_mb": 0.0001, "max_sessions": 2}
    config = cluster_config(random_family, verifier=tight, drafter_service=tight)
    cluster = Cluster(config, tmp_path, "tight").start()
    try:
        with cluster.channel() as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            prompts = PROMPTS[:6]
            futures = {p: stub.Generate.future(greedy_request(p, MAX_TOKENS, 4), timeout=300) for p in prompts}
            for prompt, future in futures.items():
                assert list(future.result().token_ids) == reference[prompt]
    finally:
        cluster.stop()


BAD_REQUESTS = [
    ("empty prompt", dict(prompt=""), "prompt"),
    ("prompt and ids", dict(prompt="a", prompt_token_ids=[1]), "prompt"),
    ("max_tokens 0", dict(prompt="a", max_tokens=0), "max_tokens"),
    ("max_tokens negative", dict(prompt="a", max_tokens=-5), "max_tokens"),
    ("max_tokens above limit", dict(prompt="a", max_tokens=10**6), "max_tokens"),
    ("negative temperature", dict(prompt="a", temperature=-0.5), "temperature"),
    ("top_p zero", dict(prompt="a", top_p=0.0), "top_p"),
    ("top_p above one", dict(prompt="a", top_p=1.5), "top_p"),
    ("negative top_k", dict(prompt="a", top_k=-1), "top_k"),
    ("prompt beyond context", dict(prompt_token_ids=[5] * 5000), "prompt"),
    ("token id outside vocabulary", dict(prompt_token_ids=[10**6]), "prompt_token_ids"),
    ("too many draft tokens", dict(prompt="a", speculation=generation_pb2.SpeculationOptions(max_draft_tokens=999)), "max_draft_tokens"),
]


@pytest.mark.parametrize("fields,field_name", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_bad_input_is_invalid_argument_and_service_keeps_serving(stub, reference, fields, field_name, method):
    with pytest.raises(grpc.RpcError) as err:
        call = getattr(stub, method)(generation_pb2.GenerateRequest(**fields), timeout=30)
        if method == "GenerateStream":
            list(call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field_name in err.value.details()
    reply = stub.Generate(greedy_request(PROMPTS[4], MAX_TOKENS, 2), timeout=120)
    assert list(reply.token_ids) == reference[PROMPTS[4]]


def _prefix_of(tokens: list[int], reference: list[int]) -> bool:
    """Greedy output with stop_at_eos off continues past the reference's end of sequence: compare the overlap."""
    n = min(len(tokens), len(reference))
    return n > 0 and tokens[:n] == reference[:n]


def test_router_ends_a_request_at_its_deadline_and_releases_its_sessions(cluster, reference):
    """The router's own deadline check, with no gRPC client that could cancel the call instead: a router built
    in this process over the cluster's real verifier and drafter, a request whose deadline passes after its
    first round. It ends DEADLINE_EXCEEDED (not 1000 tokens later) and both servers drop its sessions."""
    import asyncio
    import time

    from router.api import ErrorKind, GenerationError, GenerationParams, SpeculationOptions
    from router.server import build
    from specfleet import config as config_mod
    from tests.operations import wait_released

    cfg = config_mod.load(cluster.config_path)
    cfg.router.speculation.pin_cost_model = True  # no start-up profiling: it would only cost time here
    params = GenerationParams(
        prompt=PROMPTS[6], max_tokens=1000, speculation=SpeculationOptions(max_draft_tokens=2), request_id="router-deadline", stop_at_eos=False
    )

    async def generate():
        front_door, scheduler, transports = await build(cfg)
        scheduler.start()
        try:
            generation = await front_door.submit(params)
            events = generation.events()
            tokens = list((await asyncio.wait_for(anext(events), 120)).token_ids)
            # Mid-generation (one round streamed, hundreds to go), the deadline passes.
            generation.state.deadline = time.monotonic()
            try:
                async for event in events:
                    tokens += event.token_ids
                end = event
            except GenerationError as err:
                end = err
            return tokens, end, scheduler.context.metrics, generation.state.spec.session_id
        finally:
            await scheduler.stop()
            for transport in transports:
                await transport.close()

    tokens, end, metrics, session_id = asyncio.run(generate())
    assert isinstance(end, GenerationError), f"the request ran to its end ({len(tokens)} tokens) past its deadline"
    assert end.kind == ErrorKind.DEADLINE_EXCEEDED and "deadline" in end.message
    assert _prefix_of(tokens, reference[PROMPTS[6]])
    assert (metrics.requests_failed, metrics.requests_finished) == (1, 0)
    held = wait_released(cluster, session_id)
    assert session_id not in held["verifier"] | held["drafter"], held


def test_deadline_passing_mid_stream_is_reported_and_releases_its_sessions(cluster, stub, reference):
    """Through gRPC: the client's deadline passes while the verifier is paused after the first streamed round,
    so the request provably cannot finish in time. The client gets DEADLINE_EXCEEDED after a correct prefix;
    the router, told by the cancelled call, drops the request's sessions once the verifier resumes."""
    from tests.operations import host_pid, paused, session_of, wait_released

    request = greedy_request(PROMPTS[6], 1000, 2, request_id="client-deadline", stop_at_eos=False)
    stream = stub.GenerateStream(request, timeout=6)
    tokens = list(next(stream).token_ids)
    with paused(host_pid(cluster, "verifier")):  # the router's process too, where the verifier runs in it
        with pytest.raises(grpc.RpcError) as err:
            for chunk in stream:
                tokens += chunk.token_ids
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _prefix_of(tokens, reference[PROMPTS[6]])
    session_id = session_of(cluster, request.request_id)
    held = wait_released(cluster, session_id)
    assert session_id not in held["verifier"] | held["drafter"], held


def test_cancelled_stream_releases_its_sessions(cluster, stub):
    """A client that cancels mid-generation: the router stops the request and drops its sessions."""
    from tests.operations import session_of, wait_released

    request = greedy_request(PROMPTS[7], 1000, 2, request_id="client-cancel", stop_at_eos=False)
    stream = stub.GenerateStream(request, timeout=120)
    next(stream)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    session_id = session_of(cluster, request.request_id)
    held = wait_released(cluster, session_id)
    assert session_id not in held["verifier"] | held["drafter"], held


def test_logprobs_are_cut_with_the_tokens_a_stop_string_or_eos_cuts(random_family):
    """A round's tokens past a stop string or the end of sequence are dropped, and so are their logprobs."""
    from router.request import RequestSpec, RequestState
    from specfleet.tokenizer import load_tokenizer
    from specfleet.sampling import SamplingParams
    from specfleet.v1 import generation_pb2

    tokenizer = load_tokenizer(str(random_family["target"]))
    ids = tokenizer.encode(" hello world again", add_special_tokens=False)
    assert len(ids) >= 3
    stop_after = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).strip())  # tokens whose text is the stop string
    stop = tokenizer.decode(ids[:stop_after])
    eos = tokenizer.eos_token_id
    for stops, tokens, kept in (([stop], ids, stop_after), ([], [ids[0], eos, ids[1]], 2)):
        spec = RequestSpec("r", "s", [ids[0]], 16, SamplingParams(), stops, True, 0, "", logprobs=True)
        state = RequestState(spec=spec, tokenizer=tokenizer, eos_token_id=eos, max_context=64, deadline=None)
        state.commit(tokens, [generation_pb2.TokenLogprobs(token_id=t, logprob=-1.0) for t in tokens])
        assert state.finished
        assert [lp.token_id for lp in state.logprobs] == state.output_ids == tokens[:kept]


def test_a_request_arriving_mid_round_starts_at_once_and_cuts_the_round_s_plain_steps_short(random_family, tmp_path):
    """One lane, rounds of 64 plain steps: a request that arrives while the lane's round runs takes its first round at
    once beside it (router/scheduler.py `_admit_at_once`), and the verifier ends the running call's plain steps after
    the pass under way, so the long request streams a chunk shorter than its rounds; every output stays the target's.
    Waiting for the round to end instead, the new request would join the lane and every chunk but the last would hold
    64 tokens. A short request follows each of the long stream's first chunks, each arriving in a round just begun;
    one that reaches the verifier after the running call's last pass (a loaded machine delays it) cuts nothing, so
    several try."""
    steps, long_tokens, tries = 64, 1 + 64 * 12, 6
    config = cluster_config(random_family, router={"pipeline_depth": 1, "plain_steps": steps})
    cluster = Cluster(config, tmp_path, "admission").start()
    try:
        with cluster.channel() as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            plain = generation_pb2.SpeculationOptions(disabled=True)
            long_request = generation_pb2.GenerateRequest(
                prompt=PROMPTS[0], max_tokens=long_tokens, temperature=0.0, speculation=plain, stop_at_eos=False
            )
            chunks, short, prompts = [], [], [PROMPTS[1 + i % 3] for i in range(tries)]
            for chunk in stub.GenerateStream(long_request, timeout=300):
                chunks.append(list(chunk.token_ids))
                if len(short) < tries:
                    request = greedy_request(prompts[len(short)], 8)
                    request.speculation.disabled = True
                    short.append(list(stub.Generate(request, timeout=120).token_ids))
        path = str(random_family["target"])
        assert short == [target_greedy(path, p, 8) for p in prompts]
        assert sum(len(c) for c in chunks) == long_tokens and chunks[0] and len(chunks[0]) == 1
        assert any(len(c) < steps for c in chunks[1:-1]), [len(c) for c in chunks]
    finally:
        cluster.stop()
