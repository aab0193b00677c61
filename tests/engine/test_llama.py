"""specfleet's own forward pass against transformers' on the same weights.

Every supported family (Llama with GQA, Llama 3 with its `llama3` RoPE scaling
and attention bias, linear RoPE scaling, Qwen2's QKV bias, Qwen3's per-head query/key norms,
Mistral), ragged batches of sessions with different cached lengths, chains and
trees, with attention per session, batched (one call per layer) and on the CPU's kernel, over sessions whose KV blocks
are consecutive (read as views) or scattered (gathered), crossing block boundaries: every logit our
pass gives must be the one the reference gives for that token's own path through the tree. SPECFLEET_TEST_DEVICE=cuda runs them on a
GPU (scripts/device-check).
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from specfleet.engine import cpu_kernels, runner
from specfleet.engine.cpu_linear import CpuWeight
from specfleet.engine.attention import ATTENTION_MODES
from specfleet.engine import ForwardItem, Session, SessionStore, forward_batch, load_model, prefill

DEVICE = os.environ.get("SPECFLEET_TEST_DEVICE", "cpu")
# float32 on both sides; a GPU's kernels sum in other orders.
TOLERANCE = dict(atol=2e-4, rtol=1e-4) if DEVICE == "cpu" else dict(atol=2e-3, rtol=1e-3)


def _save(tmp_path, config, name, bf16_values=False):
    """A random model of `config` saved under tmp_path / name (float32; with bf16_values, every value a bfloat16,
    as a bfloat16 checkpoint's are when served in float32), and the module."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    # Random norms and biases: at their initial ones and zeros a skipped norm or bias changes nothing.
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                param.normal_(1.0 if "norm" in pname else 0.0, 0.5)
            if bf16_values:
                param.copy_(param.to(torch.bfloat16).float())
    model.save_pretrained(tmp_path / name)
    # The tokenizer only has to load; reuse the demo one's files.
    shutil.copytree("models/demo/tokenizer", tmp_path / name, dirs_exist_ok=True)
    return model.to(DEVICE)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=8192, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128)
    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    return {
        "llama-gqa": LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common),
        "llama3-rope-bias": LlamaConfig(num_attention_heads=4, num_key_value_heads=2, rope_parameters=llama3_rope, attention_bias=True, **common),
        "llama-linear-rope": LlamaConfig(
            num_attention_heads=4, num_key_value_heads=4, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}, **common
        ),
        "qwen2-bias": Qwen2Config(num_attention_heads=4, num_key_value_heads=4, **common),
        "qwen3-qk-norm": Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=32, **common),
        "mistral": MistralConfig(num_attention_heads=4, num_key_value_heads=1, sliding_window=4096, **common),
    }


FAMILIES = list(_configs())


# Where the sessions' KV blocks lie on the pool's token axis (kv.KVPool): "consecutive", as the pool
# hands them out to a quiet pool (each session one range, read as a view), or "scattered": the pool's
# free blocks are every other one and sessions may not move, so every session is gathered by index.
LAYOUTS = ("consecutive", "scattered")
# The attention kernel is a CPU's (csrc/attention.cpp); `auto` takes it there.
CASES = [
    (attention, layout) for attention in ATTENTION_MODES for layout in LAYOUTS if attention != "kernel" or (DEVICE == "cpu" and cpu_kernels.library())
]
# Blocks of 4 positions: every session below spans several, and its new tokens cross their boundaries.
BLOCK = 4


def _scatter(pool) -> None:
    """Leave every other block of the pool free, and keep sessions where their blocks land."""
    taken = pool.allocate(pool.free_blocks)
    pool.release(taken[::2])
    pool.relocate = False


@pytest.mark.parametrize("attention, layout", CASES, ids=[f"{a}-{lay}" for a, lay in CASES])
@pytest.mark.parametrize("name", FAMILIES)
def test_forward_matches_transformers(tmp_path, name, attention, layout):
    _forward_matches_transformers(tmp_path, name, attention, layout, "plain")


@pytest.mark.parametrize("name", FAMILIES)
def test_forward_with_cpu_linear_layouts_matches_transformers(tmp_path, name):
    """`linear: auto` (specfleet/engine/cpu_linear.py): the pass of 10 rows below takes oneDNN's layout, the
    one-row pass after it the transposed copy; both with each family's biases."""
    _forward_matches_transformers(tmp_path, name, "auto", "consecutive", "auto")


@pytest.mark.skipif(DEVICE != "cpu" or cpu_kernels.library() is None, reason="the bfloat16 kernel is a CPU's, built by a C++ compiler")
@pytest.mark.parametrize("name", FAMILIES)
def test_forward_with_bfloat16_weights_on_the_kernel_matches_transformers(tmp_path, name):
    """Weights bfloat16 holds exactly (a bfloat16 checkpoint served in float32), every linear call on the bfloat16
    kernel (csrc/bf16_linear.cpp), against transformers' float32 forward of the same values."""
    _forward_matches_transformers(tmp_path, name, "auto", "consecutive", "auto", bf16_kernel=True)


def _forward_matches_transformers(tmp_path, name, attention, layout, linear, bf16_kernel=False):
    reference = _save(tmp_path, _configs()[name], name, bf16_values=bf16_kernel)
    loaded = load_model(name, tmp_path / name, device=DEVICE, attention=attention, linear=linear, kv_block_size=BLOCK)
    loaded.prepare(1 << 30, 64)
    if linear == "auto" and DEVICE == "cpu":
        assert isinstance(loaded.model.lm_head, CpuWeight) and all(isinstance(layer.qkv, CpuWeight) for layer in loaded.model.layers)
    if bf16_kernel:
        weights = [loaded.model.lm_head, *(getattr(layer, n) for layer in loaded.model.layers for n in ("qkv", "out", "gate_up", "down"))]
        assert all(w.bf16 is not None for w in weights)
        for w in weights:
            w.bf16_rows = 1 << 20
    if layout == "scattered":
        _scatter(loaded.pool)
    else:  # what a CPU's pool does; on a GPU sessions take any free blocks
        loaded.pool.relocate = True
    gen = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(0, 8192, (9,), generator=gen).tolist()
    prompt_b = torch.randint(0, 8192, (4,), generator=gen).tolist()
    prompt_c = torch.randint(0, 8192, (70,), generator=gen).tolist()

    # Session a: a chain of 3 after its prompt; session b: a tree after its prompt;
    # session c: one decode step after a longer prompt (three cached lengths, three widths;
    # c's cache outgrows the smallest buffer, so batched attention must grow a and b's to match).
    #   b's root r, nodes 0 -> 1 and 0 -> 2 (siblings), 3 a second child of the root.
    a, b, c = Session(token_ids=list(prompt_a)), Session(token_ids=list(prompt_b)), Session(token_ids=list(prompt_c))
    prefill(loaded, [a, b, c], keep_last=1)
    assert all(isinstance(s.place(), int) == (layout == "consecutive" or len(s.blocks) == 1) for s in (a, b, c))
    chain = [11, 12, 13]
    tree_tokens = [21, 22, 23, 24]  # parents -1, 0, 0, -1: the rows of `attend` below
    attend = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)
    root_a, root_b, root_c = len(prompt_a) - 1, len(prompt_b) - 1, len(prompt_c) - 1
    items = [
        ForwardItem(a, [prompt_a[-1], *chain], list(range(root_a, root_a + 4))),
        ForwardItem(b, [prompt_b[-1], *tree_tokens], [root_b, root_b + 1, root_b + 2, root_b + 2, root_b + 1], attend),
        ForwardItem(c, [prompt_c[-1]], [root_c]),
    ]
    logits = forward_batch(loaded, items)
    # A pass commits nothing, so the same pass again attends per session: the reference path.
    loaded.model.attention = "per-session"
    per_session = forward_batch(loaded, items)
    for b_, n in enumerate([4, 5, 1]):
        torch.testing.assert_close(logits[b_, :n], per_session[b_, :n], **TOLERANCE)

    def ref_logits(ids):
        with torch.no_grad():
            return reference(torch.tensor([ids], device=DEVICE)).logits[0, -1].float().cpu()

    for i in range(4):
        torch.testing.assert_close(logits[0, i], ref_logits(prompt_a + chain[:i]), **TOLERANCE)
    paths = {0: [], 1: [21], 2: [21, 22], 3: [21, 23], 4: [24]}
    for row, path in paths.items():
        torch.testing.assert_close(logits[1, row], ref_logits(prompt_b + path), **TOLERANCE)
    torch.testing.assert_close(logits[2, 0], ref_logits(prompt_c), **TOLERANCE)

    # Keep b's accepted path root -> 0 -> 2 and continue from it: the cache must hold exactly that path.
    b.commit([0, 1, 3])
    b.token_ids += [21, 23]
    next_logits = forward_batch(loaded, [ForwardItem(b, [31], [len(b.token_ids)])])
    torch.testing.assert_close(next_logits[0, 0], ref_logits(prompt_b + [21, 23, 31]), **TOLERANCE)


@pytest.mark.parametrize("attention", [a for a in ATTENTION_MODES if a != "kernel" or (DEVICE == "cpu" and cpu_kernels.library())])
def test_prefill_passes_group_similar_lengths_and_match_transformers(tmp_path, monkeypatch, attention):
    """Sessions of similar lengths share one prefill pass; each one's cache and scores are what its
    own full-context forward gives, and a very different length gets a pass of its own."""
    reference = _save(tmp_path, _configs()["llama-gqa"], "llama-gqa")
    loaded = load_model("llama-gqa", tmp_path / "llama-gqa", device=DEVICE, attention=attention)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 8192, (n,), generator=gen).tolist() for n in (11, 12, 13, 13, 40)]
    sessions = [Session(token_ids=list(p)) for p in prompts]
    passes = []
    monkeypatch.setattr(runner, "forward_batch", lambda lm, items, **kw: passes.append(len(items)) or forward_batch(lm, items, **kw))
    scores = prefill(loaded, sessions, keep_last=1, score=True)
    monkeypatch.undo()
    assert sorted(passes) == [1, 4]
    step = forward_batch(loaded, [ForwardItem(s, [s.token_ids[-1]], [len(s.token_ids) - 1]) for s in sessions])
    for b, prompt in enumerate(prompts):
        with torch.inference_mode():
            ref = reference(torch.tensor([prompt], device=DEVICE)).logits[0].float().cpu()
        torch.testing.assert_close(step[b, 0], ref[-1], **TOLERANCE)
        ref_score = ref[:-1].log_softmax(-1).gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).sum()
        assert scores[b][1] == len(prompt) - 1 and abs(scores[b][0] - float(ref_score)) < 1e-3


def test_kv_pool_rolls_back_whole_blocks_and_evicts_into_reused_blocks(tmp_path):
    """Inside the paged KV pool: a session takes blocks as it grows and rejecting drafts gives whole
    blocks back (the next pass writes over the rejected positions, inside a block or across one); the
    LRU budget counts blocks and takes them back, and new sessions reuse them (the pool does not grow);
    a cache rebuilt from the token ids gives the reference's logits."""
    reference = _save(tmp_path, _configs()["llama-gqa"], "llama-gqa")
    loaded = load_model("llama-gqa", tmp_path / "llama-gqa", device=DEVICE, attention="batched", kv_block_size=BLOCK)
    pool = loaded.pool
    blocks_of = lambda s: -(-s.kv_len // BLOCK)  # noqa: E731
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 8192, (10 + 7 * i,), generator=gen).tolist() for i in range(3)]
    store = SessionStore(max_cache_bytes=(2 + 7) * pool.block_bytes, max_sessions=3)  # s0's and s2's blocks below
    s0, s1, s2 = sessions = [store.sync(f"s{i}", 0, p) for i, p in enumerate(prompts)]
    prefill(loaded, sessions, keep_last=1)
    assert [len(s.blocks) for s in sessions] == [3, 4, 6], "9, 16 and 23 cached positions in blocks of 4"

    def ref_logits(ids):
        with torch.no_grad():
            return reference(torch.tensor([ids], device=DEVICE)).logits[0, -1].float().cpu()

    def step(batch):
        """A decode step: each session's cache lacks its last token; feed it, check, append the argmax."""
        logits = forward_batch(loaded, [ForwardItem(s, [s.token_ids[-1]], [len(s.token_ids) - 1]) for s in batch])
        for b, s in enumerate(batch):
            torch.testing.assert_close(logits[b, 0], ref_logits(s.token_ids), **TOLERANCE)
            s.commit([0])
            s.token_ids.append(int(logits[b, 0].argmax()))

    # s0 drafts a chain of three (9 + 4 positions: a fourth block); the target accepts the first and
    # corrects the second: 11 positions cached, the fourth block given back.
    root = len(prompts[0]) - 1
    forward_batch(loaded, [ForwardItem(s0, [prompts[0][-1], 11, 12, 13], list(range(root, root + 4)))])
    assert len(s0.blocks) == 4
    s0.commit([0, 1])
    s0.token_ids += [11, 40]
    assert s0.kv_len == len(prompts[0]) + 1 and len(s0.blocks) == 3
    step(sessions)  # one batched pass: three lengths
    # The client rolls s0 back past its last two tokens and appends another (inside a block)...
    store.sync("s0", len(prompts[0]) + 1, [50])
    assert s0.kv_len == len(prompts[0]) + 1 and len(s0.blocks) == 3
    step([s0, s1])
    # ... and then back to 6 tokens, across a block boundary (12 cached positions in 3 blocks, now 6 in 2).
    free = pool.free_blocks
    store.sync("s0", 6, [51])
    assert s0.kv_len == 6 and len(s0.blocks) == 2 and pool.free_blocks == free + 1
    step([s0, s2])

    # Room for s0's 2 blocks and s2's 7: the least recently synced (s1, 5 blocks) loses its blocks, keeps its tokens.
    assert [len(s.blocks) for s in sessions] == [2, 5, 7]
    store.enforce_budget()
    assert s1.blocks == [] and s1.kv_len == 0 and store.get("s1") is s1 and s2.blocks
    assert sum(s.kv_bytes() for s in sessions) <= store.max_cache_bytes
    # New sessions under both budgets, round after round: blocks come back and are reused, both those
    # of evicted caches and those of forgotten sessions.
    grown = pool.generation
    held_total = lambda: sum(len(store.get(sid).blocks) for sid in store._sessions)  # noqa: E731
    for i in range(6):
        new = store.sync(f"n{i}", 0, prompts[i % 3][:5])
        prefill(loaded, [new], keep_last=1)
        step([new, s0])
        store.enforce_budget(protect={f"n{i}", "s0"})
        held = [b for sid in store._sessions for b in store.get(sid).blocks]
        assert len(held) == len(set(held)) and 0 not in held, "no block is held twice, and none is the scratch block"
        assert held_total() + pool.free_blocks == pool.blocks - 1
    assert pool.generation == grown, "released blocks must be reused, not the pool grown"
    assert len(store) == 3 and store.get("s1") is None and store.get("s2") is None
    # s0's cache survived it all; a forgotten session comes back and rebuilds from its token ids.
    rebuilt = store.sync("s1", 0, s1.token_ids)
    prefill(loaded, [rebuilt], keep_last=1)
    step([rebuilt, s0])
    assert [blocks_of(s) for s in (rebuilt, s0)] == [len(rebuilt.blocks), len(s0.blocks)]


def _graphs_against_eager(tmp_path, attach_graphs, at_start_up: bool = False):
    """Greedy decoding of ragged sessions plus a tree pass, with and without graphs: the same
    tokens, logits within tolerance, and two graphs were used (padded sessions and tokens).
    With `at_start_up`, every graph is captured before the first pass and none after."""
    _save(tmp_path, _configs()["qwen3-qk-norm"], "qwen3")
    runs = {}
    for graphed in (False, True):
        loaded = load_model("qwen3", tmp_path / "qwen3", device=DEVICE, attention="batched")
        if graphed:
            attach_graphs(loaded, [[4, 1], [4, 8]])
            if at_start_up:
                loaded.prepare(max_cache_bytes=100 * loaded.pool.block_bytes, max_sessions=100)
                captured = dict(loaded.graphs._graphs)
                positions = loaded.graphs.positions()
                assert positions[0] == 64 and positions[-1] == loaded.max_context
                assert sorted(captured) == [(4, n, t) for n in (1, 8) for t in positions]
                assert loaded.pool.blocks == 101, "the pool holds the budget's 100 blocks and the scratch block"
        gen = torch.Generator().manual_seed(4)
        sessions = [Session(token_ids=torch.randint(0, 8192, (n,), generator=gen).tolist()) for n in (5, 17, 40)]
        prefill(loaded, sessions, keep_last=1)
        steps = []
        for _ in range(6):
            logits = forward_batch(loaded, [ForwardItem(s, [s.token_ids[-1]], [len(s.token_ids) - 1]) for s in sessions])
            steps.append(logits[:, 0])
            for b, s in enumerate(sessions):
                s.commit([0])
                s.token_ids.append(int(logits[b, 0].argmax()))
        a, b = sessions[0], sessions[1]
        root_a, root_b = len(a.token_ids) - 1, len(b.token_ids) - 1
        attend = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        tree = forward_batch(
            loaded,
            [
                ForwardItem(a, [a.token_ids[-1], 11, 12, 13], [root_a, root_a + 1, root_a + 1, root_a + 2], attend),
                ForwardItem(b, [b.token_ids[-1], 21, 22], list(range(root_b, root_b + 3))),
            ],
        )
        runs[graphed] = ([s.token_ids for s in sessions], steps, tree)
        if graphed and at_start_up:
            assert loaded.graphs._graphs == captured, "no graph is captured after start-up"
        elif graphed:
            assert sorted(loaded.graphs._graphs) == [(4, 1, 64), (4, 8, 64)]
    assert runs[True][0] == runs[False][0]
    for graphed_step, eager_step in zip(runs[True][1], runs[False][1]):
        torch.testing.assert_close(graphed_step, eager_step, **TOLERANCE)
    torch.testing.assert_close(runs[True][2][0, :4], runs[False][2][0, :4], **TOLERANCE)
    torch.testing.assert_close(runs[True][2][1, :3], runs[False][2][1, :3], **TOLERANCE)


@pytest.mark.skipif(not DEVICE.startswith("cuda"), reason="CUDA graphs need a CUDA device (scripts/device-check runs this)")
def test_cuda_graphs_change_no_output(tmp_path):
    from specfleet.engine import graphs

    _graphs_against_eager(tmp_path, lambda loaded, sizes: setattr(loaded, "graphs", graphs.CudaGraphs(loaded, sizes)))
    _graphs_against_eager(tmp_path, lambda loaded, sizes: setattr(loaded, "graphs", graphs.CudaGraphs(loaded, sizes)), at_start_up=True)
    assert load_model("qwen3", tmp_path / "qwen3", device=DEVICE, cuda_graph_sizes=[[1, 1]]).graphs is not None


def test_graph_padding_gives_the_eager_pass(tmp_path, monkeypatch):
    """What a CUDA graph replays, run eagerly on any device: the static pass padded to its bucket
    (padding sessions and tokens writing into the pool's scratch block) gives the unpadded pass's output."""
    from specfleet.engine import graphs

    class Eager(graphs._Graph):
        memory_pool = staticmethod(lambda: None)

        def _capture(self, memory):
            class Replay:
                def replay(_):
                    self.out = self._forward()

            return Replay()

    monkeypatch.setattr(graphs, "_Graph", Eager)
    _graphs_against_eager(tmp_path, lambda loaded, sizes: setattr(loaded, "graphs", graphs.CudaGraphs(loaded, sizes)))
    _graphs_against_eager(tmp_path, lambda loaded, sizes: setattr(loaded, "graphs", graphs.CudaGraphs(loaded, sizes)), at_start_up=True)


def test_cuda_graph_sizes_are_ignored_on_a_cpu(tmp_path):
    _save(tmp_path, _configs()["llama-gqa"], "llama-gqa")
    if DEVICE == "cpu":
        assert load_model("llama-gqa", tmp_path / "llama-gqa", cuda_graph_sizes=[[4, 1]]).graphs is None


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    from transformers import GPT2Config

    _save(tmp_path, GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=8192), "gpt2")
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        load_model("gpt2", tmp_path / "gpt2")


def test_unsupported_rope_scaling_is_refused_by_name(tmp_path):
    from transformers import LlamaConfig

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=128,
        rope_parameters=rope,
    )
    _save(tmp_path, config, "yarn")
    with pytest.raises(ValueError, match="RoPE scaling 'yarn' is not supported"):
        load_model("yarn", tmp_path / "yarn")


def test_a_sliding_window_bounds_the_context(tmp_path):
    """The pass attends to the whole prefix, which is a sliding window's answer only inside the window."""
    from transformers import MistralConfig

    config = MistralConfig(
        vocab_size=8192,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        sliding_window=48,
    )
    _save(tmp_path, config, "mistral-window")
    assert load_model("mistral-window", tmp_path / "mistral-window").max_context == 48


def test_a_long_context_model_serves_its_whole_context_in_blocks(tmp_path):
    """No cap of our own on a model's context: a 32k-position model serves a 20,000-token session,
    whose KV takes the blocks its positions need and no more; max_model_len narrows the context,
    and asking for more than the model allows is refused by name."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=8192, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=32768
    )
    reference = _save(tmp_path, config, "long")
    loaded = load_model("long", tmp_path / "long", device=DEVICE)
    assert loaded.max_context == loaded.info().max_context == 32768
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 8192, (20000,), generator=gen).tolist()
    session = Session(token_ids=list(prompt))
    prefill(loaded, [session], keep_last=1)
    assert len(session.blocks) == -(-19999 // loaded.pool.block_size)
    logits = forward_batch(loaded, [ForwardItem(session, [prompt[-1]], [len(prompt) - 1])])
    with torch.no_grad():
        expected = reference(torch.tensor([prompt], device=DEVICE)).logits[0, -1].float().cpu()
    torch.testing.assert_close(logits[0, 0], expected, **TOLERANCE)
    assert load_model("long", tmp_path / "long", max_model_len=4096).max_context == 4096
    with pytest.raises(ValueError, match="model 'long': max_model_len 40000 exceeds the 32768 positions the model allows"):
        load_model("long", tmp_path / "long", max_model_len=40000)
    with pytest.raises(ValueError, match="exceeds the model's 4096"):
        short = load_model("long", tmp_path / "long", max_model_len=4096)
        prefill(short, [Session(token_ids=prompt[:5000])], keep_last=1)


def test_auto_attention_is_the_kernel_on_a_cpu_and_batched_on_a_gpu(tmp_path, monkeypatch):
    """`auto` (the services' default) takes one call per layer: on a GPU batched; on a CPU the compiled kernel where
    the machine built it, else per session, where gathering every session's KV costs more than the calls it saves
    (docs/benchmarks/engine-forward-pass.md)."""
    from types import SimpleNamespace

    from specfleet.engine import attention

    on = lambda device, mode="auto": SimpleNamespace(attention=mode, device=torch.device(device))  # noqa: E731
    assert attention.runs_batched(on("cuda")) and not attention.runs_batched(on("cpu"))
    assert attention.runs_batched(on("cpu", "batched")) and not attention.runs_batched(on("cuda", "per-session"))

    _save(tmp_path, _configs()["llama-gqa"], "llama-gqa")
    loaded = load_model("llama-gqa", tmp_path / "llama-gqa", device=DEVICE)
    assert loaded.model.attention == "auto"
    assert attention.attends_on_kernel(loaded.model) == (DEVICE == "cpu" and cpu_kernels.library() is not None)
    plans = []
    real_plan = attention.batch_plan
    monkeypatch.setattr(attention, "batch_plan", lambda *args: plans.append(len(args[1])) or real_plan(*args))
    sessions = [Session(token_ids=[1, 2, 3]) for _ in range(3)]
    prefill(loaded, sessions, keep_last=1)
    forward_batch(loaded, [ForwardItem(s, [3], [2]) for s in sessions])
    assert plans == ([3, 3] if DEVICE != "cpu" else []), "prefill's one pass of three sessions, then the step"


def test_a_session_that_cannot_grow_in_place_moves_and_keeps_its_cache(tmp_path):
    """On a CPU a session whose next block is taken moves, cache and all, to a gap that holds it
    (attention then reads it as one range); its logits stay the reference's."""
    reference = _save(tmp_path, _configs()["llama-gqa"], "llama-gqa")
    loaded = load_model("llama-gqa", tmp_path / "llama-gqa", device=DEVICE, attention="per-session", kv_block_size=BLOCK)
    pool = loaded.pool
    prompt = torch.randint(0, 8192, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    session = Session(token_ids=list(prompt))
    prefill(loaded, [session], keep_last=1)
    blocker = pool.allocate(1, after=session.blocks[-1])  # another session's block, right after this one's
    assert blocker == [session.blocks[-1] + 1]
    chain = [11, 12, 13, 14]  # 8 cached + 5 new positions: two more blocks
    logits = forward_batch(loaded, [ForwardItem(session, [prompt[-1], *chain], list(range(8, 13)))])
    moved = pool.relocate
    assert isinstance(session.place(), int) == moved and len(session.blocks) == 4 and blocker[0] not in session.blocks
    assert pool.relocations == int(moved)
    for i in range(5):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt + chain[:i]], device=DEVICE)).logits[0, -1].float().cpu()
        torch.testing.assert_close(logits[0, i], expected, **TOLERANCE)


@pytest.mark.parametrize("relocate", [False, True], ids=["shared-in-place", "moved-on-a-cpu"])
def test_sessions_share_a_cached_prefix_and_compute_only_the_rest(tmp_path, monkeypatch, relocate):
    """Prefix caching (kv.KVPool): a session whose tokens start like a cached one takes its full blocks and
    computes only the rest; both give the reference's logits, a rollback into a shared block changes
    neither, blocks that start the same but follow different tokens are not shared, and idle cached
    blocks make room when the pool needs it (it does not grow). With `relocate` (a CPU's pool), a
    session that cannot grow past the shared blocks moves, copying them: the same logits."""
    reference = _save(tmp_path, _configs()["llama-gqa"], "llama-gqa")
    loaded = load_model("llama-gqa", tmp_path / "llama-gqa", device=DEVICE, kv_block_size=BLOCK, prefix_caching=True)
    pool = loaded.pool
    pool.relocate = relocate
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(0, 8192, (37,), generator=gen).tolist()  # 9 full blocks of 4, and one more token
    computed = []
    real_forward = runner.forward_batch
    monkeypatch.setattr(
        runner, "forward_batch", lambda lm, items, **kw: computed.append(sum(len(i.input_ids) for i in items)) or real_forward(lm, items, **kw)
    )

    def ref_logits(ids):
        with torch.no_grad():
            return reference(torch.tensor([ids], device=DEVICE)).logits[0, -1].float().cpu()

    def step(*sessions):
        logits = forward_batch(loaded, [ForwardItem(s, [s.token_ids[-1]], [len(s.token_ids) - 1]) for s in sessions])
        for b, s in enumerate(sessions):
            torch.testing.assert_close(logits[b, 0], ref_logits(s.token_ids), **TOLERANCE)
            s.commit([0])
            s.token_ids.append(int(logits[b, 0].argmax()))

    a = Session(token_ids=system + [101, 102, 103])
    prefill(loaded, [a], keep_last=1)
    assert computed == [39] and pool.hits == 0
    b = Session(token_ids=system + [201, 202])
    prefill(loaded, [b], keep_last=1)
    assert computed[-1] == 38 - 36 and pool.hits == 36, "b computes only what follows the 9 cached blocks"
    assert b.kv_len == 38 and (b.blocks[:9] == a.blocks[:9]) != relocate
    step(a, b)
    step(a, b)
    # b rolls back into the shared blocks (to 30 tokens, inside the eighth) and goes another way: it gives
    # that block up and recomputes its kept positions; a's cache is untouched.
    b.truncate(30)
    assert b.kv_len == (30 if relocate else 28) and (b.blocks == a.blocks[:7]) != relocate
    b.token_ids += [301, 302]
    prefill(loaded, [b], keep_last=1)
    step(a, b)
    # The same tokens after a different start are other blocks: c shares nothing with a, and f, which
    # starts like a and goes on like c, shares a's first block and not c's second.
    c = Session(token_ids=[7] * 4 + [9] * 4 + system[8:] + [401])
    prefill(loaded, [c], keep_last=1)
    assert not set(c.blocks) & set(a.blocks)
    hits = pool.hits
    f = Session(token_ids=system[:4] + [9] * 4 + [402, 403])
    prefill(loaded, [f], keep_last=1)
    assert pool.hits - hits == 4
    step(c, f)
    f.evict_kv()
    # b lets go of what it shares with a, then c of its own blocks: a still holds the shared ones, so
    # making room (idle cached blocks forgotten, least recently released first: more blocks asked for
    # than are free) hands out c's, never those.
    b.evict_kv()
    c.evict_kv()
    grown, idle = pool.generation, len(pool._idle)
    assert idle >= 1
    taken = pool.allocate(pool.free_blocks + 1)
    assert pool.generation == grown and not set(taken) & set(a.blocks) and len(pool._idle) < idle
    pool.kv[:, :, :, pool.index(taken, len(taken) * BLOCK)] = 1.0  # another session's keys and values
    step(a)
    pool.release(taken)
    # Released, the cached blocks stay for later prompts...
    hits = pool.hits
    a.evict_kv()
    d = Session(token_ids=system + [501])
    prefill(loaded, [d], keep_last=1)
    assert pool.hits - hits == 36
    step(d)
    d.evict_kv()
    # ... until the pool needs their room: taking every free block and more forgets idle ones, no growth.
    grown, hits = pool.generation, pool.hits
    taken = pool.allocate(pool.free_blocks + 3)
    assert pool.generation == grown
    pool.release(taken)
    e = Session(token_ids=system + [601])
    prefill(loaded, [e], keep_last=1)
    assert pool.hits - hits < 36
    step(e)
