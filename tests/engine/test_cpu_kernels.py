"""specfleet/engine/cpu_kernels.py and csrc/: the bfloat16 linear kernel computes what F.linear computes from the same
(bfloat16-exact) weights at every row count and width, a row's result is bit for bit the same whatever else is in its
call, weights bfloat16 does not hold exactly are declined; the exponential race picks the tensor race's winners;
attention over the KV pool computes what scaled_dot_product_attention computes for every session's row (ragged
lengths, trees, scattered blocks, grouped heads), a session's rows bit for bit the same whatever else is in the pass;
RoPE with the pool's writes, the norm and the MLP's gate compute what torch computes; and a machine that cannot build
the kernels serves with torch's alone, computing what transformers computes. Whole passes against transformers:
tests/engine/test_llama.py."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from specfleet.engine import cpu_kernels, llama
from specfleet.engine.sampling import race, race_keys, race_noise

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C++ compiler here to build the kernel")


def _exact(n: int, k: int, seed: int) -> torch.Tensor:
    """A float32 weight whose values are bfloat16s, as a bfloat16 checkpoint's are when served in float32."""
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16).float()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 12, 13, 25, 40])
@pytest.mark.parametrize("n, k", [(300, 64), (33, 65), (7, 256), (128, 8)])
def test_the_kernel_computes_f_linear(rows, n, k):
    weight = _exact(n, k, rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(n))
    packed = cpu_kernels.pack_bf16(weight)
    assert packed is not None and packed.dtype == torch.bfloat16 and packed.shape == (-(-n // cpu_kernels.BLOCK), k, cpu_kernels.BLOCK)
    y = cpu_kernels.linear_bf16(x, packed, n)
    expected = F.linear(x.double(), weight.double()).float()
    assert y.shape == (rows, n)
    torch.testing.assert_close(y, expected, atol=1e-4, rtol=1e-5)


def test_a_row_s_result_does_not_depend_on_the_rest_of_its_call():
    """Each output sums over its own row of x in one order, whatever the call's row count (several blocks at once
    for one or two rows, rows split into sweeps for more): batches cannot change a request's logits."""
    weight = _exact(1000, 96, 0)
    packed = cpu_kernels.pack_bf16(weight)
    x = torch.randn(30, 96, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([cpu_kernels.linear_bf16(x[i : i + 1], packed, 1000) for i in range(30)])
    for rows in range(2, 31):
        assert torch.equal(cpu_kernels.linear_bf16(x[:rows], packed, 1000), alone[:rows]), rows


def test_weights_bfloat16_does_not_hold_are_declined():
    assert cpu_kernels.pack_bf16(torch.randn(64, 32)) is None
    assert cpu_kernels.pack_bf16(_exact(64, 32, 0)) is not None


def test_a_call_that_does_not_fit_its_weight_is_refused_not_run():
    packed = cpu_kernels.pack_bf16(_exact(64, 32, 0))
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.linear_bf16(torch.randn(2, 31), packed, 64)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.linear_bf16(torch.randn(2, 32), packed, 65)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_kernels.linear_bf16(torch.randn(2, 32).double(), packed, 64)


def _sessions(gen: torch.Generator, capacity: int):
    """Places, cached and new lengths and patterns of five sessions: consecutive and scattered blocks, a cache of
    none, one new token, a chain, a tree (siblings 1 and 2 under 0, 3 under the root)."""
    scattered = torch.randperm(capacity, generator=gen)[:80]
    chain = torch.ones(4, 4, dtype=torch.bool).tril()
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    places = [0, scattered, 300, 150, torch.randperm(capacity, generator=gen)[:30]]
    kv_lens = [37, 70, 0, 12, 21]
    new_lens = [1, 4, 4, 4, 1]
    return places, kv_lens, new_lens, [None, chain, tree, tree, None]


def _reference_attention(q, pool, place, kv_len, n, attend):
    """scaled_dot_product_attention in float64 over one session's positions: [n, H, D]."""
    heads, kv_heads = q.shape[0], pool.shape[1]
    where = torch.arange(place, place + kv_len + n) if isinstance(place, int) else place[: kv_len + n]
    keys, values = (pool[j][:, where].repeat_interleave(heads // kv_heads, 0).double() for j in (0, 1))
    visible = torch.ones(n, kv_len + n, dtype=torch.bool)
    if attend is not None:
        visible[:, kv_len:] = attend
    return F.scaled_dot_product_attention(q[:, :n].double(), keys, values, attn_mask=visible).transpose(0, 1).float()


@pytest.mark.parametrize("heads, kv_heads, dim", [(4, 2, 64), (8, 8, 128), (4, 1, 80), (2, 2, 16), (14, 2, 64)])
def test_attention_computes_scaled_dot_product_attention(heads, kv_heads, dim):
    gen = torch.Generator().manual_seed(dim)
    pool = torch.randn(3, 2, kv_heads, 512, dim, generator=gen)  # three layers; the kernel reads the second
    places, kv_lens, new_lens, attends = _sessions(gen, 512)
    q = torch.randn(5, heads + kv_heads, 4, dim, generator=gen)[:, :heads]  # a view, as the pass's q is
    plan = cpu_kernels.AttendPlan(places, kv_lens, new_lens, attends, 4, pool, heads)
    out = cpu_kernels.attend(q, pool[1], plan)
    assert out.shape == (5, 4, heads, dim)
    for b, (place, kv_len, n, attend) in enumerate(zip(places, kv_lens, new_lens, attends)):
        torch.testing.assert_close(out[b, :n], _reference_attention(q[b], pool[1], place, kv_len, n, attend), atol=2e-6, rtol=2e-5)
        assert not out[b, n:].any()  # padding rows


def test_a_session_s_attention_does_not_depend_on_the_rest_of_its_pass():
    """Each row sums over its own positions in one order: alone, or beside any other sessions, bit for bit."""
    gen = torch.Generator().manual_seed(3)
    pool = torch.randn(1, 2, 2, 512, 64, generator=gen)
    places, kv_lens, new_lens, attends = _sessions(gen, 512)
    q = torch.randn(5, 4, 4, 64, generator=gen)
    together = cpu_kernels.attend(q, pool[0], cpu_kernels.AttendPlan(places, kv_lens, new_lens, attends, 4, pool, 4))
    for b in range(5):
        n = new_lens[b]
        plan = cpu_kernels.AttendPlan(places[b : b + 1], kv_lens[b : b + 1], [n], attends[b : b + 1], n, pool, 4)
        alone = cpu_kernels.attend(q[b : b + 1, :, :n], pool[0], plan)
        assert torch.equal(alone[0], together[b, :n]), b


def test_rope_write_rotates_as_the_model_does_and_writes_the_new_tokens_only():
    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, width = 4, 2, 32, 4
    pool = torch.zeros(2, 2, kv_heads, 256, dim)
    places, kv_lens, new_lens = [0, torch.randperm(256, generator=gen)[:40]], [5, 30], [4, 2]
    qkv = torch.randn(2, width, (heads + 2 * kv_heads) * dim, generator=gen)
    positions = torch.tensor([[5, 6, 7, 8], [30, 31, 31, 0]])  # a tree's depths; padding's position anything
    freqs = torch.outer(torch.arange(64).float(), torch.rand(dim // 2, generator=gen))
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([-freqs.sin(), freqs.sin()], -1)
    plan = cpu_kernels.AttendPlan(places, kv_lens, new_lens, [None, None], width, pool, heads)
    q = cpu_kernels.rope_write(qkv, positions, cos, sin, pool[1], plan)
    heads_of = qkv.view(2, width, heads + 2 * kv_heads, dim)
    rotated = llama._rotate(heads_of[:, :, : heads + kv_heads], cos[positions][:, :, None], sin[positions][:, :, None])
    torch.testing.assert_close(q, rotated[:, :, :heads], atol=1e-6, rtol=1e-6)
    expected = torch.zeros_like(pool[1])
    for b, (place, kv_len, n) in enumerate(zip(places, kv_lens, new_lens)):
        where = torch.arange(place + kv_len, place + kv_len + n) if isinstance(place, int) else place[kv_len : kv_len + n]
        expected[0][:, where] = rotated[b, :n, heads:].transpose(0, 1)
        expected[1][:, where] = heads_of[b, :n, heads + kv_heads :].transpose(0, 1)
    torch.testing.assert_close(pool[1], expected, atol=1e-6, rtol=1e-6)
    assert not pool[0].any()  # the other layer untouched


def test_the_norm_with_its_residual_add_and_the_gate_compute_torch_s():
    gen = torch.Generator().manual_seed(5)
    x, delta, weight = torch.randn(3, 5, 72, generator=gen), torch.randn(3, 5, 72, generator=gen), torch.randn(72, generator=gen)
    before = x.clone()
    h = cpu_kernels.add_rms_norm(x, delta, weight, 1e-6)
    torch.testing.assert_close(x, before + delta)  # the residual stream, in place
    torch.testing.assert_close(h, F.rms_norm(before + delta, (72,), weight, 1e-6), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(cpu_kernels.add_rms_norm(x, None, weight, 1e-6), h, atol=0, rtol=0)
    gate_up = torch.randn(4, 2, 2 * 96, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_kernels.silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("vocab", [5, 1000, 12288])
def test_the_race_kernel_picks_the_tensor_race_s_winners(vocab):
    """csrc/race.cpp's winner of every row is the tensor race's (`race` of `race_noise`), for flat and peaked rows,
    rows whose top-k left most tokens without mass, point masses and keys of every sign; the rows' winners spread
    over many tokens, so skipping the tokens that cannot win is tested where it matters."""
    gen = torch.Generator().manual_seed(11)
    rows = 600 if vocab < 12288 else 24
    scale = torch.tensor([0.1, 1.0, 4.0, 12.0]).repeat(rows // 4).unsqueeze(1)
    probs = (torch.randn(rows, vocab, generator=gen) * scale).softmax(dim=1)
    kept = torch.rand(rows, vocab, generator=gen) < torch.where(torch.arange(rows) % 3 == 0, 0.05, 1.0).unsqueeze(1)
    probs = torch.where(kept, probs, torch.zeros(()))
    probs[rows // 2] = 0.0
    probs[rows // 2, vocab // 2] = 1.0
    keys = race_keys(list(range(-rows // 2, rows // 2)), list(range(rows)))
    expected = race(probs, race_noise(keys, torch.arange(vocab)))
    assert torch.equal(cpu_kernels.race(probs, keys), expected)
    assert expected[rows // 2] == vocab // 2
    assert expected.unique().numel() > min(vocab, rows) // 3


def test_shapes_the_attention_kernel_does_not_take_are_refused():
    with pytest.raises(ValueError, match="head size 16, 32"):
        cpu_kernels.AttendPlan([0], [3], [1], [None], 1, torch.zeros(1, 2, 2, 64, 8), 2)
    plan = cpu_kernels.AttendPlan([0], [3], [1], [None], 1, torch.zeros(1, 2, 2, 64, 16), 2)
    with pytest.raises(ValueError, match="float32 queries"):
        cpu_kernels.attend(torch.zeros(1, 2, 2, 16), torch.zeros(2, 2, 64, 16), plan)


def test_without_a_compiler_the_model_serves_with_torch_s_kernels(tmp_path):
    """No C++ compiler ($CXX a program that fails): a warning says so, the demo target lays out its float32 copies
    only, and its pass (torch's attention, norms and gate) computes transformers' logits."""
    script = textwrap.dedent(
        """
        import logging, torch
        from transformers import AutoModelForCausalLM
        logging.basicConfig(level=logging.WARNING)
        from specfleet.engine import attention, cpu_kernels, load_model, prefill, Session
        from specfleet.engine.cpu_linear import CpuWeight
        assert cpu_kernels.library() is None
        loaded = load_model("t", "models/demo/target", linear="auto")
        assert not attention.kernels_serve(loaded.model) and not attention.attends_on_kernel(loaded.model)
        loaded.prepare(1 << 30, 8)
        weights = [loaded.model.lm_head, *(getattr(l, n) for l in loaded.model.layers for n in ("qkv", "out", "gate_up", "down"))]
        assert all(isinstance(w, CpuWeight) and w.bf16 is None and w.bf16_rows == 0 for w in weights)
        ids = [5, 6, 7, 8, 9, 10, 11, 12, 13]
        [(total, count)] = prefill(loaded, [Session(token_ids=ids)], keep_last=1, score=True)
        reference = AutoModelForCausalLM.from_pretrained("models/demo/target", dtype=torch.float32).eval()
        with torch.no_grad():
            log_probs = reference(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        expected = log_probs.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
        assert count == len(ids) - 1 and abs(total - expected) < 1e-3, (total, expected)
        print("served")
        """
    )
    env = {**os.environ, "CXX": "false", "SPECFLEET_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "served" in done.stdout
    assert "with false failed, so passes run on torch's kernels alone" in done.stderr


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="-mno-avx512f is an x86 flag")
def test_the_kernels_without_avx512_compute_torch_s(tmp_path):
    """The generic vector forms a CPU without AVX-512 takes (`widen`; attention's 8-lane vectors), compiled here
    with AVX-512 turned off, into a cache of its own, compute what F.linear and attention compute."""
    script = textwrap.dedent(
        """
        import torch, torch.nn.functional as F
        from specfleet.engine import cpu_kernels
        cpu_kernels.FLAGS = (*cpu_kernels.FLAGS, "-mno-avx512f")
        assert cpu_kernels.library() is not None
        gen = torch.Generator().manual_seed(0)
        for rows, n, k in [(1, 300, 64), (2, 33, 65), (13, 128, 8), (40, 70, 96)]:
            weight = torch.randn(n, k, generator=gen).to(torch.bfloat16).float()
            x = torch.randn(rows, k, generator=gen)
            y = cpu_kernels.linear_bf16(x, cpu_kernels.pack_bf16(weight), n)
            torch.testing.assert_close(y, F.linear(x.double(), weight.double()).float(), atol=1e-4, rtol=1e-5)
        from tests.engine.test_cpu_kernels import _reference_attention, _sessions
        pool = torch.randn(1, 2, 2, 512, 64, generator=gen)
        places, kv_lens, new_lens, attends = _sessions(gen, 512)
        q = torch.randn(5, 4, 4, 64, generator=gen)
        out = cpu_kernels.attend(q, pool[0], cpu_kernels.AttendPlan(places, kv_lens, new_lens, attends, 4, pool, 4))
        for b, (place, kv_len, n, attend) in enumerate(zip(places, kv_lens, new_lens, attends)):
            torch.testing.assert_close(out[b, :n], _reference_attention(q[b], pool[0], place, kv_len, n, attend), atol=2e-6, rtol=2e-5)
        print("computed")
        """
    )
    env = {**os.environ, "SPECFLEET_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "computed" in done.stdout and list(tmp_path.glob("specfleet_kernels-*.so"))
