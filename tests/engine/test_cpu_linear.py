"""specfleet/engine/cpu_linear.py: a weight laid out for a CPU's kernels computes what F.linear computes, at
every number of rows (both layouts), with and without a bias; `LoadedModel.prepare` lays out what `linear: auto`
asks for and nothing else. Whole passes against transformers: tests/engine/test_llama.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specfleet.engine import cpu_linear, load_model
from specfleet.engine.cpu_linear import CpuWeight

pytestmark = pytest.mark.skipif(not cpu_linear.available(torch.float32), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 80])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_both_layouts_compute_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 64, generator=gen)
    bias = torch.randn(300, generator=gen) if with_bias else None
    x = torch.randn(1, rows, 64, generator=gen)  # [B, N, E], as a pass hands it
    laid_out = CpuWeight.of(weight)
    torch.testing.assert_close(laid_out(x, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    assert laid_out.weight.shape == weight.shape and torch.equal(laid_out.weight, weight)


def test_prepare_lays_out_with_auto_only(tmp_path):
    plain = load_model("t", "models/demo/target", linear="plain")
    plain.prepare(1 << 30, 64)
    assert isinstance(plain.model.lm_head, torch.Tensor) and isinstance(plain.model.layers[0].qkv, torch.Tensor)
    auto = load_model("t", "models/demo/target", linear="auto")
    assert isinstance(auto.model.lm_head, torch.Tensor), "laid out at load, before prepare"
    auto.prepare(1 << 30, 64)
    assert isinstance(auto.model.lm_head, CpuWeight)
    assert all(isinstance(getattr(layer, n), CpuWeight) for layer in auto.model.layers for n in ("qkv", "out", "gate_up", "down"))
    # The embedding the output layer was tied to stays a plain tensor, for the embedding lookup.
    assert isinstance(auto.model.embed, torch.Tensor)


def test_an_unknown_linear_mode_is_refused_by_name():
    with pytest.raises(ValueError, match="model 't': linear must be one of"):
        load_model("t", "models/demo/target", linear="fast")
