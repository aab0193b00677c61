"""specfleet/engine/cpu_kernels.py and csrc/bf16_linear.cpp: the bfloat16 linear kernel computes what F.linear
computes from the same (bfloat16-exact) weights at every row count and width, a row's result is bit for bit the
same whatever else is in its call, weights bfloat16 does not hold exactly are declined, and a machine that cannot
build the kernel serves with torch's kernels alone. Whole passes against transformers: tests/engine/test_llama.py."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from specfleet.engine import cpu_kernels

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


def test_without_a_compiler_the_model_serves_with_torch_s_kernels(tmp_path):
    """No C++ compiler ($CXX a program that fails): a warning says so, the demo target lays out its float32 copies
    only, and its pass computes what it computes with the kernel."""
    script = textwrap.dedent(
        """
        import logging, torch
        logging.basicConfig(level=logging.WARNING)
        from specfleet.engine import cpu_kernels, load_model, prefill, Session
        from specfleet.engine.cpu_linear import CpuWeight
        assert cpu_kernels.library() is None
        loaded = load_model("t", "models/demo/target", linear="auto")
        loaded.prepare(1 << 30, 8)
        weights = [loaded.model.lm_head, *(getattr(l, n) for l in loaded.model.layers for n in ("qkv", "out", "gate_up", "down"))]
        assert all(isinstance(w, CpuWeight) and w.bf16 is None and w.bf16_rows == 0 for w in weights)
        scores = prefill(loaded, [Session(token_ids=[5, 6, 7, 8])], keep_last=1, score=True)
        print("served")
        """
    )
    env = {**os.environ, "CXX": "false", "SPECFLEET_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "served" in done.stdout
    assert "building bf16_linear.cpp with false failed, so linear layers read float32 weights" in done.stderr


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="-mno-avx512f is an x86 flag")
def test_the_kernel_without_avx512_computes_f_linear(tmp_path):
    """The generic vector form `widen` falls back to where the CPU has no AVX-512 (compiled here with it turned
    off, into a cache of its own) computes what the AVX-512 form and F.linear compute."""
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
        print("computed")
        """
    )
    env = {**os.environ, "SPECFLEET_KERNEL_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "computed" in done.stdout and list(tmp_path.glob("bf16_linear-*.so"))
