"""specfleet/engine/cpu_pass.py and csrc/layers.cpp: every layer of a CPU pass in one call gives the logits and the KV
pool's contents the layers' kernels give one call at a time, bit for bit, for chains, trees and ragged passes (rows
padded and not), with each family's biases, with and without logits; the pass really takes the one call (the only
projection left to Python is the output layer's); and it is declined where some layer could not take the kernels
(per-head query and key norms, weights bfloat16 does not hold, linear layers not laid out). Whole passes against
transformers: tests/engine/test_llama.py."""

from __future__ import annotations

import pytest
import torch

from specfleet.engine import ForwardItem, Session, cpu_kernels, cpu_pass, forward_batch, load_model, prefill
from specfleet.engine.cpu_linear import CpuWeight
from tests.engine.test_llama import _configs, _save

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C++ compiler here to build the kernels")

ONE_CALL = ["llama-gqa", "llama3-rope-bias", "qwen2-bias", "mistral"]


def _loaded(tmp_path, name: str, bf16_values: bool = True, linear: str = "auto"):
    _save(tmp_path, _configs()[name], name, bf16_values=bf16_values)
    loaded = load_model(name, tmp_path / name, linear=linear, kv_block_size=4)
    loaded.prepare(1 << 30, 64)
    if loaded.model.cpu_pass is not None:
        # Every layer's copies serve every pass below, whatever this machine's calibration found for such small shapes.
        for layer in loaded.model.layers:
            for weight in (layer.qkv, layer.out, layer.gate_up, layer.down):
                weight.bf16_rows = weight.bf16_pass_rows = 1 << 20
        loaded.model.cpu_pass = cpu_pass.prepare(loaded.model)
    return loaded


def _items(gen: torch.Generator, loaded, shape: str) -> list[ForwardItem]:
    """Sessions prefilled to three lengths, then fed: "ragged" a chain of 4, a tree of 5 and one token (rows pad);
    "uniform" three chains of 3 (none pads)."""
    prompts = [torch.randint(0, 8192, (n,), generator=gen).tolist() for n in (9, 4, 30)]
    sessions = [Session(token_ids=list(p)) for p in prompts]
    prefill(loaded, sessions, keep_last=1)
    roots = [len(p) - 1 for p in prompts]
    if shape == "uniform":
        return [ForwardItem(s, [p[-1], 7, 8], [r, r + 1, r + 2]) for s, p, r in zip(sessions, prompts, roots)]
    (a, b, c), (pa, pb, pc), (ra, rb, rc) = sessions, prompts, roots
    attend = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 0, 0, 1]], dtype=torch.bool)
    return [
        ForwardItem(a, [pa[-1], 11, 12, 13], list(range(ra, ra + 4))),
        ForwardItem(b, [pb[-1], 21, 22, 23, 24], [rb, rb + 1, rb + 2, rb + 2, rb + 1], attend),
        ForwardItem(c, [pc[-1]], [rc]),
    ]


@pytest.mark.parametrize("shape", ["ragged", "uniform"])
@pytest.mark.parametrize("name", ONE_CALL)
def test_the_layers_in_one_call_compute_what_the_calls_one_by_one_compute(tmp_path, name, shape):
    loaded = _loaded(tmp_path, name)
    assert loaded.model.cpu_pass is not None, "every weight of this family is laid out with a bfloat16 copy"
    items = _items(torch.Generator().manual_seed(1), loaded, shape)
    assert cpu_pass.serves(loaded.model.cpu_pass, sum(len(item.input_ids) for item in items))
    one_call = forward_batch(loaded, items)
    pool_one_call = loaded.pool.kv.clone()
    # A pass commits nothing: the same pass again writes the same positions, now one kernel call at a time.
    prepared, loaded.model.cpu_pass = loaded.model.cpu_pass, None
    by_calls = forward_batch(loaded, items)
    assert torch.equal(one_call, by_calls)
    assert torch.equal(pool_one_call, loaded.pool.kv), "the new keys and values land where, and as, the calls write them"
    loaded.model.cpu_pass = prepared
    assert forward_batch(loaded, items, logits=False) is None
    assert torch.equal(pool_one_call, loaded.pool.kv), "a pass without logits writes the same KV"


def test_a_pass_of_few_rows_leaves_only_the_output_layer_to_python(tmp_path, monkeypatch):
    loaded = _loaded(tmp_path, "llama3-rope-bias")
    items = _items(torch.Generator().manual_seed(2), loaded, "ragged")
    calls = []
    real = CpuWeight.__call__
    monkeypatch.setattr(CpuWeight, "__call__", lambda weight, x, bias: calls.append(weight) or real(weight, x, bias))
    forward_batch(loaded, items)
    assert calls == [loaded.model.lm_head], "one call ran the layers; the output layer's projection is the only one from Python"
    # Wider than some projection's bfloat16 copy serves: the layers go one call at a time, on the paths calibrated.
    calls.clear()
    loaded.model.cpu_pass.max_rows = 2
    forward_batch(loaded, items)
    assert len(calls) > 1


def test_the_pass_serves_the_rows_each_copy_was_calibrated_to_serve_in_it(tmp_path):
    """Its rows are the fewest any projection's bfloat16 copy serves in such a pass (`bf16_pass_rows`, within the
    calibration's slack), not the rows a call of the copy alone serves (`bf16_rows`)."""
    loaded = _loaded(tmp_path, "llama3-rope-bias")
    weights = [getattr(layer, n) for layer in loaded.model.layers for n in ("qkv", "out", "gate_up", "down")]
    for i, weight in enumerate(weights):
        weight.bf16_rows, weight.bf16_pass_rows = 2, 128 - i
    assert cpu_pass.prepare(loaded.model).max_rows == 128 - len(weights) + 1


@pytest.mark.parametrize(
    "name, bf16_values, linear",
    [("qwen3-qk-norm", True, "auto"), ("llama-gqa", False, "auto"), ("llama-gqa", True, "plain")],
    ids=["per-head-norms", "float32-values", "not-laid-out"],
)
def test_models_whose_layers_could_not_all_take_the_kernels_run_them_call_by_call(tmp_path, name, bf16_values, linear):
    loaded = _loaded(tmp_path, name, bf16_values=bf16_values, linear=linear)
    assert loaded.model.cpu_pass is None
    assert not cpu_pass.serves(loaded.model.cpu_pass, 1)
