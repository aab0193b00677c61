"""specfleet/engine/cpu_linear.py: a weight laid out for a CPU's kernels computes what F.linear computes, at
every number of rows (both layouts), with and without a bias; the copy a call takes (bfloat16, transposed,
oneDNN's) follows its row count and the timings of the calibration; `LoadedModel.prepare` lays out what
`linear: auto` asks for and nothing else. Whole passes against transformers: tests/engine/test_llama.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specfleet.engine import cpu_linear, load_model
from specfleet.engine.cpu_linear import PASS_SLACK, CpuWeight

pytestmark = pytest.mark.skipif(not cpu_linear.available(torch.float32), reason="this torch build has no oneDNN")


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 80])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("layout", ["transposed", "packed"])
def test_both_layouts_compute_f_linear(rows, with_bias, layout):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(300, 64, generator=gen)
    bias = torch.randn(300, generator=gen) if with_bias else None
    x = torch.randn(1, rows, 64, generator=gen)  # [B, N, E], as a pass hands it
    laid_out = CpuWeight.of(weight)
    laid_out.transposed_rows = 1 << 20 if layout == "transposed" else 0
    torch.testing.assert_close(laid_out(x, bias), F.linear(x, weight, bias), atol=1e-4, rtol=1e-5)
    assert laid_out.weight.shape == weight.shape and torch.equal(laid_out.weight, weight)


def test_a_call_takes_the_transposed_copy_up_to_its_weight_s_row_count():
    """Each copy made from a different weight, so the answer says which one served the call."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(96, 32, generator=gen), torch.randn(96, 32, generator=gen)
    mixed = CpuWeight(a.t().contiguous(), CpuWeight.of(b).packed, transposed_rows=5)
    for rows, served_by in [(1, a), (5, a), (6, b), (40, b)]:
        x = torch.randn(1, rows, 32, generator=gen)
        torch.testing.assert_close(mixed(x, None), F.linear(x, served_by), atol=1e-4, rtol=1e-5)


def test_the_transposed_copy_serves_up_to_the_most_rows_it_was_faster_at():
    """`choose` reads the calibration's timings: the transposed copy up to the largest row count it won (even past a
    row count it lost by noise), oneDNN's layout beyond, and never the transposed copy where it never won."""
    assert cpu_linear.choose({1: (1.0, 2.0), 2: (1.0, 2.0), 4: (3.0, 2.0), 8: (3.0, 2.0)}) == 2
    assert cpu_linear.choose({1: (1.0, 2.0), 2: (3.0, 2.0), 4: (1.0, 2.0), 8: (3.0, 2.0)}) == 4
    assert cpu_linear.choose({1: (1.0, 2.0), 16: (1.0, 2.0)}) == 16
    assert cpu_linear.choose({1: (3.0, 2.0), 2: (3.0, 2.0)}) == 0
    # With a slack (a pass of every layer in one call): up to the most rows the copy was within it of the alternative.
    timings = {32: (0.9, 1.0), 64: (1.05, 1.0), 128: (1.08, 1.0), 256: (1.2, 1.0)}
    assert cpu_linear.choose(timings) == 32
    assert cpu_linear.choose(timings, cpu_linear.PASS_SLACK) == 128


def test_a_call_takes_the_bf16_copy_up_to_its_row_count_then_the_others():
    """Each copy made from a different weight, so the answer says which one served the call."""
    from specfleet.engine import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip("no C++ compiler here to build the bfloat16 kernel")
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randn(96, 32, generator=gen).to(torch.bfloat16).float() for _ in range(3))
    mixed = CpuWeight(a.t().contiguous(), CpuWeight.of(b).packed, transposed_rows=5, bf16=cpu_kernels.pack_bf16(c), bf16_rows=2)
    for rows, served_by in [(1, c), (2, c), (3, a), (5, a), (6, b)]:
        x = torch.randn(1, rows, 32, generator=gen)
        torch.testing.assert_close(mixed(x, None), F.linear(x, served_by), atol=1e-4, rtol=1e-5)


def test_a_pass_of_every_layer_in_one_call_takes_a_bfloat16_copy_within_the_slack(monkeypatch):
    """A copy a few percent slower than oneDNN's layout at every row count serves no call alone and every calibrated
    row count in a pass of every layer in one call; it is timed at every row count (it never lost by the slack)."""
    weight = CpuWeight.of(torch.randn(64, 32).to(torch.bfloat16).float(), bf16=True)
    if weight.bf16 is None:
        pytest.skip("no C++ compiler here to build the bfloat16 kernel")
    timed = []

    def fastest(weights, paths, inputs, key):
        rows = len(inputs(weights[0]))
        timed.append((rows, "bf16" in paths))
        seconds = {"transposed": 2.0, "packed": 1.0, "bf16": 1.0 + (PASS_SLACK - 1) / 2}
        return {(key(w), name): seconds[name] for w in weights for name in paths}

    monkeypatch.setattr(cpu_linear, "_fastest", fastest)
    ((_, bf16_rows, pass_rows),) = cpu_linear.calibrate([weight]).values()
    assert (bf16_rows, pass_rows) == (0, max(cpu_linear.CALIBRATION_ROWS))
    assert all(with_bf16 for _, with_bf16 in timed)


def test_calibration_times_every_copy_and_lay_out_applies_it_per_shape():
    loaded = load_model("t", "models/demo/target", linear="plain")
    _, rows = cpu_linear.lay_out(loaded.model)
    head, qkv = loaded.model.lm_head, loaded.model.layers[0].qkv
    assert set(rows) == {
        tuple(head.weight.shape),
        *(tuple(getattr(loaded.model.layers[0], n).weight.shape) for n in ("qkv", "out", "gate_up", "down")),
    }
    choices = (0, *cpu_linear.CALIBRATION_ROWS)
    assert all(t in choices and b in choices and p in choices for t, b, p in rows.values())
    # A pass of every layer in one call takes the bfloat16 copy wherever a call alone would, and within its slack.
    assert all(p >= b for _, b, p in rows.values())
    assert (head.transposed_rows, head.bf16_rows, head.bf16_pass_rows) == rows[tuple(head.weight.shape)]
    assert (qkv.transposed_rows, qkv.bf16_rows, qkv.bf16_pass_rows) == rows[tuple(qkv.weight.shape)]
    assert all(
        (layer.qkv.transposed_rows, layer.qkv.bf16_rows, layer.qkv.bf16_pass_rows) == rows[tuple(qkv.weight.shape)] for layer in loaded.model.layers
    )
    # The demo checkpoint is stored in bfloat16: every weight has its bfloat16 copy where the kernel builds.
    from specfleet.engine import cpu_kernels

    assert all((w.bf16 is not None) == (cpu_kernels.library() is not None) for w in (head, qkv))
    # Layouts other than auto take their one copy for every call.
    other = load_model("t", "models/demo/target", linear="plain")
    _, packed_rows = cpu_linear.lay_out(other.model, "packed")
    assert set(packed_rows.values()) == {(0, 0, 0)} and other.model.lm_head.bf16 is None


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


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_a_stack_s_weights_take_each_member_s_bf16_copy_up_to_its_rows(with_bias):
    """`StackedWeights`: each model's rows (`llama.Runs`) through its own member's `Bf16Weight`, which takes the
    kernel up to its row count and F.linear on the float32 weight beyond; with each member's bias."""
    from specfleet.engine import cpu_kernels
    from specfleet.engine.cpu_linear import Bf16Weight, StackedWeights
    from specfleet.engine.llama import Runs

    if cpu_kernels.library() is None:
        pytest.skip("no C++ compiler here to build the bfloat16 kernel")
    gen = torch.Generator().manual_seed(3)
    weights = torch.randn(3, 40, 24, generator=gen).to(torch.bfloat16).float()  # [G, out, in]
    biases = torch.randn(3, 40, generator=gen) if with_bias else None
    stacked = StackedWeights([Bf16Weight(w, cpu_kernels.pack_bf16(w), rows=2) for w in weights])
    members = [2, 0, 0, 0, 1, 1]  # runs of 1, 3 (past the kernel's 2 rows) and 2 rows
    order = sorted(range(len(members)), key=members.__getitem__)
    runs = Runs.of([members[i] for i in order], torch.device("cpu"))
    x = torch.randn(len(members), 1, 24, generator=gen)[order]
    expected = torch.stack([F.linear(x[i], weights[g], None if biases is None else biases[g]) for i, g in enumerate(runs.members.tolist())])
    torch.testing.assert_close(stacked(x, biases, runs), expected, atol=1e-4, rtol=1e-5)


def test_a_shape_without_bf16_copies_is_never_calibrated_onto_the_kernel():
    """A model whose weights are bfloat16 values in some shapes only: the kernel is timed for those, and a shape
    whose weights have no bfloat16 copy serves no row count on it (it has no copy to read)."""
    from specfleet.engine import cpu_kernels

    if cpu_kernels.library() is None:
        pytest.skip("no C++ compiler here to build the bfloat16 kernel")
    gen = torch.Generator().manual_seed(4)
    exact = CpuWeight.of(torch.randn(64, 32, generator=gen).to(torch.bfloat16).float(), bf16=True)
    inexact = CpuWeight.of(torch.randn(96, 32, generator=gen), bf16=True)
    assert exact.bf16 is not None and inexact.bf16 is None
    rows = cpu_linear.calibrate([exact, inexact])
    assert rows[(96, 32), False][1] == 0
    assert rows[(64, 32), True][1] in (0, *cpu_linear.CALIBRATION_ROWS)
