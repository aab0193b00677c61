"""A CPU pass's decoder layers in one call (csrc/layers.cpp), where every layer runs on the CPU kernels.

`llama.forward` on a CPU calls a kernel for each step of each layer (`cpu_kernels`: the norms, the bfloat16
projections, RoPE with the KV write, attention, the MLP's gate), a dozen calls a layer, each with its Python,
ctypes and tensor bookkeeping. On the demo target a one-token pass spent about as long between those calls as in
them. `specfleet_layers` runs the same kernels in the same order on the same rows in one call, so a pass's values
are the ones the calls one by one give, bit for bit (tests/engine/test_cpu_pass.py).

It serves a pass where each of those calls would take the kernel: a float32 model on a CPU with the kernels built,
attention on the kernel with RoPE fused (no per-head query and key norms), one model (not a stack), one rank, and
every projection laid out with a bfloat16 copy that serves the pass's rows (`cpu_linear`: the rows a copy was
calibrated to serve in such a pass, `PASS_SLACK`). Elsewhere `prepare` returns None or `serves` says no, and the
layers run one call at a time.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from specfleet.engine import cpu_kernels
from specfleet.engine.cpu_linear import Bf16Weight, CpuWeight


class _LayerWeights(ctypes.Structure):
    """csrc/layers.cpp's `LayerWeights`."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("input_norm", "qkv", "qkv_bias", "out", "out_bias", "mlp_norm", "gate_up", "down")]


class _Layers(ctypes.Structure):
    """csrc/layers.cpp's `Layers`."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter")),
        ("eps", ctypes.c_float),
        ("weights", ctypes.POINTER(_LayerWeights)),
        *((name, ctypes.c_void_p) for name in ("norm", "cos", "sin")),
    ]


@dataclass
class CpuPass:
    """A model's layers as `specfleet_layers` reads them, built once (`prepare`); it holds what its pointers point into."""

    layers: _Layers
    max_rows: int  # the most rows every projection's bfloat16 copy serves in such a pass (`bf16_pass_rows`)
    keep: tuple


def _packed(weight) -> tuple[torch.Tensor, int] | None:
    """A projection's bfloat16 copy and the most rows it serves, if it has one."""
    if isinstance(weight, CpuWeight) and weight.bf16 is not None:
        return weight.bf16, weight.bf16_pass_rows
    if isinstance(weight, Bf16Weight):
        return weight.bf16, weight.rows
    return None


def prepare(model) -> CpuPass | None:
    """The model's layers for `specfleet_layers`, or None where the pass cannot run them in one call (module docstring)."""
    if model.parallel is not None or model.device.type != "cpu" or model.dtype != torch.float32 or cpu_kernels.library() is None:
        return None
    if not cpu_kernels.takes_head_dim(model.head_dim):
        return None
    weights, keep, limits = [], [], []
    for layer in model.layers:
        if layer.q_norm is not None:
            return None
        packed = [_packed(getattr(layer, name)) for name in ("qkv", "out", "gate_up", "down")]
        if any(p is None for p in packed):
            return None
        limits += [rows for _, rows in packed]
        (qkv, _), (out, _), (gate_up, _), (down, _) = packed
        tensors = (layer.input_norm, qkv, layer.qkv_bias, out, layer.out_bias, layer.mlp_norm, gate_up, down)
        if any(t is not None and not t.is_contiguous() for t in tensors):
            return None
        keep.append(tensors)
        weights.append(_LayerWeights(*(None if t is None else t.data_ptr() for t in tensors)))
    inter = _out_features(model.layers[0].gate_up) // 2 if model.layers else 0
    array = (_LayerWeights * len(weights))(*weights)
    cos, sin = model.cos.contiguous(), model.sin.contiguous()
    layers = _Layers(
        len(model.layers), model.embed.shape[1], model.heads, model.kv_heads, model.head_dim, inter, model.eps,
        ctypes.cast(array, ctypes.POINTER(_LayerWeights)), model.norm.data_ptr(), cos.data_ptr(), sin.data_ptr(),
    )  # fmt: skip
    return CpuPass(layers, min(limits, default=0), (keep, array, cos, sin, model.norm))


def _out_features(weight) -> int:
    return weight.transposed.shape[1] if isinstance(weight, CpuWeight) else weight.weight.shape[0]


def serves(cpu_pass: CpuPass | None, rows: int) -> bool:
    """Whether a pass of this many real rows runs its layers in one call: every projection takes its bfloat16 copy."""
    return cpu_pass is not None and 0 < rows <= cpu_pass.max_rows


def run_layers(
    cpu_pass: CpuPass, x: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, kv: torch.Tensor, where, rows: torch.Tensor | None, logits: bool
) -> None:
    """Every layer of the pass: x (the residual stream, contiguous [..., E]) updated in place, h (its first layer's
    input norm) left as the final norm's output with logits. positions [B, N] long; kv the pool; `where` the pass's
    `cpu_kernels.AttendPlan`; rows the real rows' places in the padded layout (`llama._real_rows`), or None."""
    batch, width = positions.shape
    count = x.numel() // x.shape[-1]
    if not (x.is_contiguous() and h.is_contiguous() and kv.is_contiguous() and x.dtype == torch.float32):
        raise ValueError("run_layers takes contiguous float32 activations and pool")
    index = None if rows is None else rows.to(torch.long).contiguous()
    positions = positions.contiguous()
    cpu_kernels.library().specfleet_layers(
        ctypes.addressof(cpu_pass.layers), where.ref, batch, width, count, None if index is None else index.data_ptr(), positions.data_ptr(),
        kv.data_ptr(), kv[0].numel(), x.data_ptr(), h.data_ptr(), int(logits),
    )  # fmt: skip
