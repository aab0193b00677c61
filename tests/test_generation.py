"""End to end through real gRPC: specfleet's output is the target model's own output."""

from __future__ import annotations

import concurrent.futures
import re

import grpc
import pytest

from specfleet.v1 import common_pb2, drafter_pb2_grpc, generation_pb2, generation_pb2_grpc, verifier_pb2_grpc
from tests.conftest import Cluster, cluster_config
from tests.helpers import PROMPTS, greedy_request, target_greedy

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
    assert reply.speculation.rounds == len(reply.token_ids)


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


def test_sampling_is_reproducible_with_a_seed(stub):
    """Alone, then among other requests and after them: load and what the router learned change
    the adaptive plan's draft lengths, and with them which draws would decide each token."""
    request = generation_pb2.GenerateRequest(prompt=PROMPTS[2], max_tokens=32, temperature=0.9, top_p=0.95, seed=1234)
    first = stub.Generate(request, timeout=120)
    others = [generation_pb2.GenerateRequest(prompt=p, max_tokens=48, temperature=0.9) for p in PROMPTS[:4] * 2]
    with concurrent.futures.ThreadPoolExecutor(len(others) + 1) as pool:
        busy = [pool.submit(stub.Generate, r, timeout=300) for r in others]
        second = pool.submit(stub.Generate, request, timeout=300).result()
        for f in busy:
            f.result()
    assert list(first.token_ids) == list(second.token_ids)
    assert first.speculation.draft_tokens > 0


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
    """Drop the verifier's and drafter's state for a request while it runs: output is unchanged."""
    prompt = PROMPTS[3]
    request = greedy_request(prompt, MAX_TOKENS, 3, request_id=f"evict-{keep_tokens}")
    stream = stub.GenerateStream(request, timeout=120)
    tokens = list(next(stream).token_ids)
    # The router names its own session ids (request_id is only a label); its log ties the two.
    session_id = re.search(rf"request {request.request_id} \(session (\w+)\)", cluster.log_path.read_text()).group(1)
    release = common_pb2.ReleaseRequest(session_ids=[session_id], keep_tokens=keep_tokens)
    with cluster.channel(cluster.verifier) as vch, cluster.channel(cluster.drafter) as dch:
        released = verifier_pb2_grpc.VerifierStub(vch).ReleaseSessions(release, timeout=10).released
        released += drafter_pb2_grpc.DrafterStub(dch).ReleaseSessions(release, timeout=10).released
    tokens += [t for chunk in stream for t in chunk.token_ids]
    assert released >= 1, "the request finished before its sessions could be released"
    assert tokens == reference[prompt]


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


def test_deadline_exceeded_is_reported(stub):
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(greedy_request(PROMPTS[5], 2000, 4), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
