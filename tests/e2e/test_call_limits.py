"""Per-call limits of the verifier and drafters: a call over them is refused before any forward pass,
and the router splits its own calls so that none is."""

from __future__ import annotations

import grpc
import pytest

from specfleet import limits
from specfleet.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, generation_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from tests.harness import Cluster, cluster_config
from tests.helpers import PROMPTS, greedy_request, target_greedy


def test_split_packs_units_in_order_within_the_limits():
    size = lambda entry: entry  # noqa: E731  (an entry is its token count)
    calls = limits.split([[3], [3], [2, 2], [5], [1]], size, limits.CallLimits(sessions=3, tokens=7))
    assert calls == [[3, 3], [2, 2], [5, 1]]
    # A unit alone over the limits still gets a call (the server's refusal says why).
    assert limits.split([[9], [1]], size, limits.CallLimits(sessions=3, tokens=7)) == [[9], [1]]


def verify_session(sid: str, context: int) -> verifier_pb2.VerifySession:
    return verifier_pb2.VerifySession(
        sync=common_pb2.SessionSync(session_id=sid, new_token_ids=[5] * context),
        sampling=common_pb2.SamplingParams(temperature=0.0, top_p=1.0),
    )


@pytest.mark.parametrize("sessions,context,limit", [(257, 4, "verifier.max_call_sessions"), (100, 400, "verifier.max_call_tokens")])
def test_a_verify_call_over_the_limits_is_refused_before_any_pass(cluster, sessions, context, limit):
    """The defaults: 256 sessions and 32,768 context tokens a call. Refused sessions are never created
    (a pass would have left them in the verifier's store)."""
    ids = [f"over-{limit}-{i}" for i in range(sessions)]
    with cluster.channel(cluster.verifier) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Verify(verifier_pb2.VerifyRequest(sessions=[verify_session(sid, context) for sid in ids]), timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert limit in err.value.details()
        held = set(stub.GetStats(common_pb2.InfoRequest(), timeout=30).session_ids)
        assert not held & set(ids)
        # Still serving.
        reply = stub.Verify(verifier_pb2.VerifyRequest(sessions=[verify_session("under-limits", 4)]), timeout=30)
        assert reply.sessions[0].status == common_pb2.SESSION_OK


def test_a_draft_call_over_the_limits_is_refused_before_any_pass(cluster):
    model = cluster.config["drafters"][0]["models"][0]["name"]
    ids = [f"over-draft-{i}" for i in range(257)]
    sessions = [
        drafter_pb2.DraftSession(sync=common_pb2.SessionSync(session_id=sid, new_token_ids=[5, 6]), model=model, num_draft_tokens=2) for sid in ids
    ]
    with cluster.channel(cluster.drafter) as channel:
        stub = drafter_pb2_grpc.DrafterStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Draft(drafter_pb2.DraftRequest(sessions=sessions), timeout=60)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "drafters[drafters].max_call_sessions" in err.value.details()
        assert not set(stub.GetStats(common_pb2.InfoRequest(), timeout=30).session_ids) & set(ids)


def test_the_router_splits_its_calls_to_fit_small_limits(random_family, tmp_path):
    """Two sessions and one context's worth of tokens per call: eight concurrent requests still get the
    target's output, in more, smaller calls."""
    small = {"max_call_sessions": 2, "max_call_tokens": 1024}  # the random models' context
    config = cluster_config(random_family, verifier=small, drafter_service=small)
    cluster = Cluster(config, tmp_path, "small-calls").start()
    try:
        with cluster.channel() as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            prompts = PROMPTS[:8]
            futures = {p: stub.Generate.future(greedy_request(p, 24, 3), timeout=300) for p in prompts}
            for prompt, future in futures.items():
                assert list(future.result().token_ids) == target_greedy(str(random_family["target"]), prompt, 24), prompt
    finally:
        cluster.stop()
    assert "RESOURCE_EXHAUSTED" not in cluster.log_path.read_text()


def test_long_prompts_prefilled_in_chunks_give_the_targets_output(random_family, tmp_path):
    """max_prefill_tokens: 16 positions of prefill a batch, on the verifier and the drafter service, so every prompt
    here is prefilled over several rounds (the verifier answers SESSION_PREFILLING meanwhile, the drafter proposes
    nothing until it has the prompt) while the others decode beside it; with drafting, in the verifier's own
    process (over gRPC), each output is still the target's, and the drafter drafts once each prompt is in."""
    # Without the prefix cache, a router that took SESSION_PREFILLING for a lost session would resend the
    # prompt and restart its prefill every round, never to finish.
    # k = 3 asked in every round (no adaptive speculation): adaptive, a request the cost model keeps at k = 0 drafts
    # only in probe rounds, and whether one of those comes after its prompt is in depends on this machine's speed.
    config = cluster_config(
        random_family,
        verifier={"max_prefill_tokens": 16, "colocate": False, "enable_prefix_caching": False},
        drafter_service={"max_prefill_tokens": 16, "enable_prefix_caching": False},
        router={"adaptive_speculation": False},
    )
    cluster = Cluster(config, tmp_path, "chunked-prefill").start()
    prompts = [p * 6 for p in PROMPTS[:4]]  # 30-90 tokens each
    try:
        with cluster.channel() as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            futures = {p: stub.Generate.future(greedy_request(p, 16, 3), timeout=120) for p in prompts}
            for prompt, future in futures.items():
                reply = future.result()
                assert list(reply.token_ids) == target_greedy(str(random_family["target"]), prompt, 16), prompt
                assert reply.speculation.draft_tokens > 0, prompt
    finally:
        cluster.stop()


def test_a_20000_token_prompt_is_served_through_the_whole_system(random_family, tmp_path):
    """No cap of ours on a model's context, end to end: a random model allowing 32,768 positions (target and drafter)
    serves a 20,000-token prompt through the router, prefilled in chunks on the verifier and the drafter service,
    its KV in blocks; the greedy output is the target's, and the drafter drafts once the prompt is in."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer_dir = random_family["target"]
    vocab = LlamaConfig.from_pretrained(tokenizer_dir).vocab_size
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=32768, initializer_range=0.3, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(7)
    model = LlamaForCausalLM(config).eval()
    path = tmp_path / "long"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    prompt = torch.randint(0, vocab, (20000,), generator=torch.Generator().manual_seed(8)).tolist()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    expected = out[0, len(prompt) :].tolist()
    # k as asked (a drafter as large as its target never pays for itself, so adaptive speculation would not draft).
    config = cluster_config({"target": path, "drafter-copy": path}, drafter="drafter-copy", router={"adaptive_speculation": False})
    cluster = Cluster(config, tmp_path, "long-prompt").start()
    try:
        with cluster.channel() as channel:
            request = greedy_request("", 16, 3, stop_at_eos=False)
            request.ClearField("prompt")
            request.prompt_token_ids.extend(prompt)
            reply = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=300)
        assert list(reply.token_ids) == expected
        assert reply.speculation.draft_tokens > 0, reply.speculation
    finally:
        cluster.stop()


def test_a_drafter_is_not_scored_for_the_calls_it_spends_prefilling(random_family, tmp_path):
    """The drafter service prefills a 90-token prompt 16 positions a call and proposes nothing meanwhile, saying so:
    those rounds are verified plainly and do not count as its misses (adaptive speculation would otherwise stop
    asking a drafter that has not yet seen the prompt, and its prefill would never finish). Adaptive speculation off:
    it is asked in every round that may draft, so the rounds it is scored in are those after its prefill."""
    config = cluster_config(
        random_family,
        router={"adaptive_speculation": False},
        verifier={"colocate": False, "enable_prefix_caching": False},
        drafter_service={"max_prefill_tokens": 16, "enable_prefix_caching": False},
    )
    cluster = Cluster(config, tmp_path, "drafter-prefilling").start()
    prompt = PROMPTS[0] * 6
    try:
        with cluster.channel() as channel:
            reply = generation_pb2_grpc.GenerationStub(channel).Generate(greedy_request(prompt, 16, 3), timeout=120)
    finally:
        cluster.stop()
    assert list(reply.token_ids) == target_greedy(str(random_family["target"]), prompt, 16)
    (drafter,) = reply.speculation.drafters
    assert 0 < drafter.rounds <= reply.speculation.rounds - 4 and drafter.draft_tokens > 0, reply.speculation
