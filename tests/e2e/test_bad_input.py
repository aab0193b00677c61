"""Hostile or malformed input at every service: INVALID_ARGUMENT naming the field, no request touching another, the services keep serving."""

from __future__ import annotations

import math
import threading
import time

import grpc
import pytest

from specfleet.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, generation_pb2, generation_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.helpers import PROMPTS, greedy_request, target_greedy
from tests.operations import service_pid

NAN, INF = math.nan, math.inf


def verify_session(sid: str, sampling: dict, probs: list[float] = (1.0,)) -> verifier_pb2.VerifySession:
    return verifier_pb2.VerifySession(
        sync=common_pb2.SessionSync(session_id=sid, new_token_ids=[5, 6, 7]),
        tree=verifier_pb2.TokenTree(token_ids=[8], parents=[-1], proposals=[common_pb2.SparseDistribution(token_ids=[8], probs=probs)]),
        sampling=common_pb2.SamplingParams(**{"temperature": 1.0, "top_p": 1.0, **sampling}),
    )


@pytest.mark.parametrize("top_logprobs", [-1, 21])
def test_verifier_refuses_top_logprobs_out_of_range_and_returns_logprobs_only_when_asked(cluster, top_logprobs):
    with cluster.channel(cluster.verifier) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        bad = verify_session(f"bad-top-{top_logprobs}", {})
        bad.logprobs, bad.top_logprobs = True, top_logprobs
        with pytest.raises(grpc.RpcError) as err:
            stub.Verify(verifier_pb2.VerifyRequest(sessions=[bad]), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "top_logprobs" in err.value.details()
        asked = verify_session(f"asked-{top_logprobs}", {})
        asked.logprobs, asked.top_logprobs = True, 3
        reply = stub.Verify(verifier_pb2.VerifyRequest(sessions=[asked, verify_session(f"not-asked-{top_logprobs}", {})]), timeout=30)
        with_logprobs, without = reply.sessions
        assert len(with_logprobs.logprobs) == len(with_logprobs.token_ids) and all(lp <= 0 for lp in with_logprobs.logprobs)
        assert len(with_logprobs.top_token_ids) == len(with_logprobs.top_logprobs) == 3 * len(with_logprobs.token_ids)
        assert list(with_logprobs.top_logprobs[:3]) == sorted(with_logprobs.top_logprobs[:3], reverse=True)
        assert not without.logprobs and not without.top_token_ids
        stub.ReleaseSessions(common_pb2.ReleaseRequest(session_ids=[f"asked-{top_logprobs}", f"not-asked-{top_logprobs}"]), timeout=30)


@pytest.mark.parametrize(
    "sampling,probs,field",
    [
        ({"temperature": NAN}, [1.0], "temperature"),
        ({"temperature": INF}, [1.0], "temperature"),
        ({"top_p": NAN}, [1.0], "top_p"),
        ({}, [NAN], "proposals"),
        ({}, [INF], "proposals"),
        ({}, [-0.5], "proposals"),
    ],
)
def test_verifier_refuses_non_finite_numbers(cluster, sampling, probs, field):
    with cluster.channel(cluster.verifier) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Verify(verifier_pb2.VerifyRequest(sessions=[verify_session("bad-numbers", sampling, probs)]), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()
        # Still serving: a good call on the same channel.
        reply = stub.Verify(verifier_pb2.VerifyRequest(sessions=[verify_session("good-numbers", {})]), timeout=30)
        assert reply.sessions[0].status == common_pb2.SESSION_OK


@pytest.mark.parametrize("sampling,field", [({"temperature": NAN}, "temperature"), ({"top_k": -3}, "top_k")])
def test_drafter_refuses_non_finite_numbers(cluster, sampling, field):
    model = cluster.config["drafters"][0]["models"][0]["name"]

    def session(sid, extra, stop_below=0.0):
        return drafter_pb2.DraftSession(
            sync=common_pb2.SessionSync(session_id=sid, new_token_ids=[5, 6, 7]),
            model=model,
            num_draft_tokens=2,
            sampling=common_pb2.SamplingParams(**{"temperature": 1.0, "top_p": 1.0, **extra}),
            stop_below_confidence=stop_below,
        )

    with cluster.channel(cluster.drafter) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        for bad, name in [(session("bad", sampling), field), (session("bad-stop", {}, stop_below=NAN), "stop_below_confidence")]:
            with pytest.raises(grpc.RpcError) as err:
                stub.Draft(drafter_pb2.DraftRequest(sessions=[bad]), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert name in err.value.details()
        reply = stub.Draft(drafter_pb2.DraftRequest(sessions=[session("good", {})]), timeout=30)
        assert len(reply.sessions[0].token_ids) == 2


def test_a_vanishing_temperature_is_greedy(cluster, random_family):
    """logits / 1e-40 overflows float32: such a request samples greedily instead of returning end-of-sequence."""
    prompt = PROMPTS[0]
    with cluster.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        request = greedy_request(prompt, 24, 3, stop_at_eos=False)
        request.temperature = 1e-40
        reply = stub.Generate(request, timeout=120)
    assert list(reply.token_ids) == target_greedy(str(random_family["target"]), prompt, 24)[:24]


def test_requests_sharing_a_request_id_do_not_touch_each_other(cluster, random_family):
    """request_id is the client's label: the router makes its own session ids."""
    path = str(random_family["target"])
    prompts = PROMPTS[:6]
    with cluster.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        futures = {p: stub.Generate.future(greedy_request(p, 48, 3, request_id="same-label"), timeout=300) for p in prompts}
        for prompt, future in futures.items():
            reply = future.result()
            assert reply.request_id == "same-label"
            assert list(reply.token_ids) == target_greedy(path, prompt, 48), prompt


@pytest.mark.parametrize("field,value", [("request_id", "a\nb"), ("request_id", "x" * 129), ("domain", "code\r\n"), ("domain", "d" * 500)])
def test_labels_must_be_short_and_printable(cluster, field, value):
    with cluster.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(generation_pb2.GenerateRequest(prompt="a", max_tokens=2, **{field: value}), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in err.value.details()


def test_huge_prompts_are_refused_before_tokenizing_while_others_are_served(cluster, random_family):
    """A prompt that cannot fit the context is refused by its size alone, and a stream in flight keeps going."""
    long = generation_pb2.GenerateRequest(prompt="word " * 600_000, max_tokens=4)  # 3 MB: under router.max_request_bytes
    with cluster.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        stream = stub.GenerateStream(greedy_request(PROMPTS[1], 64, 2, stop_at_eos=False), timeout=300)
        tokens = list(next(stream).token_ids)
        for _ in range(5):
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(long, timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "prompt: 3000000 characters cannot fit" in err.value.details()
        tokens += [t for chunk in stream for t in chunk.token_ids]
    assert tokens == target_greedy(str(random_family["target"]), PROMPTS[1], 64)[:64]


def test_requests_over_the_size_limit_are_refused_fast_without_growing_the_router(cluster, random_family):
    """Twenty 10 MB prompts while eight streams are generating: each refused within seconds (gRPC refuses a
    message over router.max_request_bytes, 4 MB, before reading it into memory), the streams keep receiving
    tokens (no gap of 3 s; the refusals took 12-17 s each when prompts were tokenized on the event loop),
    the router's RSS stays within 100 MB of where it was (it grew 170 MB when such prompts were read),
    and every stream's output is the target's."""
    huge = generation_pb2.GenerateRequest(prompt="word " * 2_000_000, max_tokens=4)  # 10 MB
    prompts, max_tokens = PROMPTS[:8], 300
    router = service_pid(cluster, "router")
    tokens = {p: [] for p in prompts}
    arrivals = {p: [] for p in prompts}
    started = threading.Barrier(len(prompts) + 1)

    def client(prompt):
        with cluster.channel() as channel:
            request = greedy_request(prompt, max_tokens, 2, stop_at_eos=False)
            for i, chunk in enumerate(generation_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=600)):
                tokens[prompt] += chunk.token_ids
                arrivals[prompt].append(time.monotonic())
                if i == 0:
                    started.wait(timeout=300)

    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    started.wait(timeout=300)
    rss_before = rss_mb(router)
    with cluster.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        began = time.monotonic()
        for _ in range(20):
            sent = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(huge, timeout=60)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "larger than max" in err.value.details()
            assert time.monotonic() - sent < 5.0
        ended = time.monotonic()
    rss_after = rss_mb(router)
    for t in threads:
        t.join(timeout=600)
    assert rss_after - rss_before <= 100, f"router RSS {rss_before:.0f} -> {rss_after:.0f} MB"
    for prompt in prompts:
        # From the first refusal to the first chunk after the last one (or the stream's end, if sooner).
        times = [began] + [t for t in arrivals[prompt] if t > began]
        times = times[: next((i + 1 for i, t in enumerate(times) if t > ended), len(times))]
        assert max((b - a for a, b in zip(times, times[1:])), default=0) < 3.0, f"stream {prompt!r} stalled while huge prompts were refused"
        assert tokens[prompt] == target_greedy(str(random_family["target"]), prompt, max_tokens), prompt


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise LookupError(pid)
