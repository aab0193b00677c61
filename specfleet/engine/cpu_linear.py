"""Linear layers laid out for a CPU's matmul kernels (the `linear: auto` of a service's config).

`F.linear` on a checkpoint's [out, in] weight hands a CPU's BLAS a layout it serves slowly at the
shapes a decode pass has: a few rows against a wide weight (the output layer above all, [V, E]).
Measured on the demo target (docs/benchmarks/engine-forward-pass.md): `x @ W^T` with W^T stored
contiguous serves one or two rows fastest, and oneDNN's own blocked layout of W (what
torch.compile's CPU backend feeds its linear kernels with frozen weights) serves three rows and up
fastest; `torch.compile` of the dense parts of a layer, weights passed as arguments, measured no
faster than eager. So each weight is laid out both ways once, at load, and each call takes the layout
for its number of rows. That costs a second copy of every linear weight in memory; float32 only.

Where one layout stops being the faster one depends on the CPU (an AMD EPYC: oneDNN's from 3 rows; an Intel
Xeon with AVX-512: W^T up to the 128 rows timed, docs/benchmarks/linear-calibrated.md), so `lay_out` times
both on each of the model's weight shapes at load and keeps, per shape, the most rows the transposed copy
served faster (`calibrate`, `choose`).

The math is a matrix product either way: rows of a pass never mix, and a row's result does not
depend on which layout computed it beyond float rounding, which greedy tests against transformers'
forward pass bound (tests/engine/test_cpu_linear.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# Until calibrated: passes of at most this many rows take the transposed copy; wider ones oneDNN's blocked layout.
TRANSPOSED_ROWS = 2
# auto: each weight shape calibrated; transposed, packed: every call takes that copy; plain: not laid out.
LINEAR_MODES = ("auto", "transposed", "packed", "plain")
ALWAYS = 1 << 62  # the row count of `transposed`: every call
# The row counts `calibrate` times, and how long it may spend on one row count of one shape.
CALIBRATION_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
CALIBRATION_BUDGET_S = 0.02


def available(dtype: torch.dtype) -> bool:
    """Whether this torch build can lay weights out for oneDNN (x86 and most ARM builds), for this dtype."""
    return dtype == torch.float32 and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@dataclass
class CpuWeight:
    """One linear layer's weight [out, in], held as W^T contiguous and in oneDNN's blocked layout."""

    transposed: torch.Tensor  # [in, out]
    packed: torch.Tensor  # oneDNN's layout of [out, in]; only its linear kernel reads it
    transposed_rows: int = TRANSPOSED_ROWS  # calls of at most this many rows take `transposed`

    @staticmethod
    def of(weight: torch.Tensor) -> "CpuWeight":
        return CpuWeight(weight.t().contiguous(), torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None))

    @property
    def weight(self) -> torch.Tensor:
        """The [out, in] weight, as a view."""
        return self.transposed.t()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        width = x.shape[-1]
        rows = x.numel() // width
        if rows <= self.transposed_rows:
            y = x @ self.transposed
            return y if bias is None else y + bias
        return self.by_packed(x.reshape(rows, width), bias).view(*x.shape[:-1], -1)

    def by_packed(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] through oneDNN's layout."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def lay_out(model, mode: str = "auto") -> tuple[int, dict[tuple[int, ...], int]]:
    """Replace `model`'s linear weights (every layer's and the output layer) with `CpuWeight`s, each with the
    row count its shape was calibrated to on this CPU (mode auto; transposed: every call takes the transposed
    copy, packed: oneDNN's layout); the bytes added and {shape: rows}.

    `model` is a `llama.LlamaModel` on a CPU, not a stack (a stack's layers run per model, on slices)."""
    added = 0
    calibrated: dict[tuple[int, ...], int] = {}

    def laid_out(weight: torch.Tensor) -> CpuWeight:
        w = CpuWeight.of(weight)
        if weight.shape not in calibrated:
            calibrated[weight.shape] = calibrate(w) if mode == "auto" else ALWAYS if mode == "transposed" else 0
        w.transposed_rows = calibrated[weight.shape]
        return w

    for layer in model.layers:
        for name in ("qkv", "out", "gate_up", "down"):
            weight = getattr(layer, name)
            setattr(layer, name, laid_out(weight))
            added += weight.numel() * weight.element_size()
    head = model.lm_head
    # A tied output layer is the embedding's storage, which stays: both copies are new.
    tied = head.data_ptr() == model.embed.data_ptr()
    model.lm_head = laid_out(head)
    return added + head.numel() * head.element_size() * (2 if tied else 1), calibrated


def calibrate(weight: CpuWeight) -> int:
    """The most rows for which `weight`'s transposed copy computed faster than oneDNN's layout, timed here on
    each of CALIBRATION_ROWS (the fastest of calls taking turns within a small budget, so that another process
    taking the core for a moment moves neither much)."""
    x = torch.randn(max(CALIBRATION_ROWS), weight.transposed.shape[0], device=weight.transposed.device)
    timings = {}
    for rows in CALIBRATION_ROWS:
        rows_x = x[:rows]
        paths = {
            "transposed": lambda: rows_x @ weight.transposed,
            "packed": lambda: weight.by_packed(rows_x),
        }
        best = dict.fromkeys(paths, float("inf"))
        deadline = time.perf_counter() + CALIBRATION_BUDGET_S
        for attempt in range(7):
            for name in list(paths) if attempt % 2 == 0 else list(reversed(paths)):
                started = time.perf_counter()
                paths[name]()
                best[name] = min(best[name], time.perf_counter() - started)
            if attempt >= 2 and time.perf_counter() > deadline:
                break
        timings[rows] = (best["transposed"], best["packed"])
    return choose(timings)


def choose(timings: dict[int, tuple[float, float]]) -> int:
    """From {rows: (seconds with the transposed copy, seconds with oneDNN's layout)}: the most rows the transposed
    copy was faster at (0: never)."""
    return max((rows for rows, (transposed, packed) in timings.items() if transposed < packed), default=0)
