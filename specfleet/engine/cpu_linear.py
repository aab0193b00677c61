"""Linear layers laid out for a CPU's matmul kernels (the `linear: auto` of a service's config).

`F.linear` on a checkpoint's [out, in] weight hands a CPU's BLAS a layout it serves slowly at the
shapes a decode pass has: a few rows against a wide weight (the output layer above all, [V, E]).
Measured on the demo target (docs/benchmarks/engine-forward-pass.md): `x @ W^T` with W^T stored
contiguous serves one or two rows fastest, and oneDNN's own blocked layout of W (what
torch.compile's CPU backend feeds its linear kernels with frozen weights) serves three rows and up
fastest; `torch.compile` of the dense parts of a layer, weights passed as arguments, measured no
faster than eager. So each weight is laid out both ways once, at load, and each call takes the layout
for its number of rows. That costs a second copy of every linear weight in memory; float32 only.

The math is a matrix product either way: rows of a pass never mix, and a row's result does not
depend on which layout computed it beyond float rounding, which greedy tests against transformers'
forward pass bound (tests/engine/test_cpu_linear.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Passes of at most this many rows take the transposed copy; wider ones oneDNN's blocked layout.
TRANSPOSED_ROWS = 2
LINEAR_MODES = ("auto", "plain")


def available(dtype: torch.dtype) -> bool:
    """Whether this torch build can lay weights out for oneDNN (x86 and most ARM builds), for this dtype."""
    return dtype == torch.float32 and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@dataclass
class CpuWeight:
    """One linear layer's weight [out, in], held as W^T contiguous and in oneDNN's blocked layout."""

    transposed: torch.Tensor  # [in, out]
    packed: torch.Tensor  # oneDNN's layout of [out, in]; only its linear kernel reads it

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
        if rows <= TRANSPOSED_ROWS:
            y = x @ self.transposed
            return y if bias is None else y + bias
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, width), self.packed, bias, "none", [], "")
        return y.view(*x.shape[:-1], y.shape[-1])


def lay_out(model) -> int:
    """Replace `model`'s linear weights (every layer's and the output layer) with `CpuWeight`s; bytes added.

    `model` is a `llama.LlamaModel` on a CPU, not a stack (a stack's layers run per model, on slices)."""
    added = 0
    for layer in model.layers:
        for name in ("qkv", "out", "gate_up", "down"):
            weight = getattr(layer, name)
            setattr(layer, name, CpuWeight.of(weight))
            added += weight.numel() * weight.element_size()
    head = model.lm_head
    # A tied output layer is the embedding's storage, which stays: both copies are new.
    tied = head.data_ptr() == model.embed.data_ptr()
    model.lm_head = CpuWeight.of(head)
    return added + head.numel() * head.element_size() * (2 if tied else 1)
