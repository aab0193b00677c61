"""Linear layers laid out for a CPU's matmul kernels (the `linear: auto` of a service's config).

`F.linear` on a checkpoint's [out, in] weight hands a CPU's BLAS a layout it serves slowly at the
shapes a decode pass has: a few rows against a wide weight (the output layer above all, [V, E]).
Measured on the demo target (docs/benchmarks/engine-forward-pass.md): `x @ W^T` with W^T stored
contiguous serves one or two rows fastest, and oneDNN's own blocked layout of W (what
torch.compile's CPU backend feeds its linear kernels with frozen weights) serves three rows and up
fastest; `torch.compile` of the dense parts of a layer, weights passed as arguments, measured no
faster than eager. So each weight is laid out both ways once, at load, and each call takes the layout
for its number of rows. That costs a second copy of every linear weight in memory; float32 only.

A checkpoint stored in bfloat16 and served in float32 has weights bfloat16 holds exactly: for those, `auto` keeps a
third copy in bfloat16 for csrc/bf16_linear.cpp (`cpu_kernels.py`), which reads half the bytes and widens them to
float32 in registers, and calibrates it like the other two; passes of few rows, bound by the bytes they read, take it.
A stack of draft models (`stack.py`) keeps its float32 weights in the checkpoints' layout, one copy for every
member's passes; where they are bfloat16 values it gains the bfloat16 copies alone (`lay_out_stack`).

Where one layout stops being the faster one depends on the CPU (an AMD EPYC: oneDNN's from 3 rows; an Intel
Xeon with AVX-512: W^T up to the 128 rows timed, docs/benchmarks/linear-calibrated.md), so `lay_out` times
both on each of the model's weight shapes at load and keeps, per shape, the most rows the transposed copy
served faster (`calibrate`, `choose`).

The math is a matrix product either way: rows of a pass never mix, and a row's result does not
depend on which layout computed it beyond float rounding, which greedy tests against transformers'
forward pass bound (tests/engine/test_cpu_linear.py).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

import torch

from specfleet.engine import cpu_kernels

# Until calibrated: passes of at most this many rows take the transposed copy; wider ones oneDNN's blocked layout.
TRANSPOSED_ROWS = 2
# auto: each weight shape calibrated; transposed, packed: every call takes that copy; plain: not laid out.
LINEAR_MODES = ("auto", "transposed", "packed", "plain")
ALWAYS = 1 << 62  # the row count of `transposed`: every call
# The row counts `calibrate` times, and how long it may spend on one row count of one shape.
CALIBRATION_ROWS = (1, 2, 4, 8, 12, 16, 20, 24, 32, 48, 64, 128)
CALIBRATION_BUDGET_S = 0.04
# A pass of every layer in one call (cpu_pass.py) takes each projection's bfloat16 copy up to the most rows at which
# that copy computed within this factor of the faster float32 layout: the call saves a dozen calls a layer, which
# pays for a copy a few percent slower. Past a few dozen rows the copy and oneDNN's layout are within a few percent
# of each other on an AMD EPYC, so which won a calibration was chance, and with it whether a 64-token prefill of
# the demo target ran in one call (10% faster) or not (docs/benchmarks/verify-overhead.md).
PASS_SLACK = 1.10


def available(dtype: torch.dtype) -> bool:
    """Whether this torch build can lay weights out for oneDNN (x86 and most ARM builds), for this dtype."""
    return dtype == torch.float32 and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@dataclass
class CpuWeight:
    """One linear layer's weight [out, in], held as W^T contiguous and in oneDNN's blocked layout."""

    transposed: torch.Tensor  # [in, out]
    packed: torch.Tensor  # oneDNN's layout of [out, in]; only its linear kernel reads it
    transposed_rows: int = TRANSPOSED_ROWS  # calls of at most this many rows take `transposed`
    bf16: torch.Tensor | None = None  # `cpu_kernels.pack_bf16`'s copy, where the weight is exactly bfloat16
    bf16_rows: int = 0  # calls of at most this many rows take `bf16` (before `transposed`)
    bf16_pass_rows: int = 0  # a pass of every layer in one call takes `bf16` up to this many rows (`PASS_SLACK`)

    @staticmethod
    def of(weight: torch.Tensor, bf16: bool = False) -> "CpuWeight":
        """Both float32 layouts; with bf16, also the bfloat16 copy where the weight is exactly bfloat16 and the
        kernel is built here (its rows stay 0 until calibrated)."""
        packed_bf16 = cpu_kernels.pack_bf16(weight) if bf16 and cpu_kernels.library() is not None else None
        return CpuWeight(weight.t().contiguous(), torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None), bf16=packed_bf16)

    @property
    def weight(self) -> torch.Tensor:
        """The [out, in] weight, as a view."""
        return self.transposed.t()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        width = x.shape[-1]
        rows = x.numel() // width
        if rows <= self.bf16_rows:
            y = cpu_kernels.linear_bf16(x, self.bf16, self.transposed.shape[1])
        elif rows <= self.transposed_rows:
            y = x @ self.transposed
        else:
            return self.by_packed(x.reshape(rows, width), bias).view(*x.shape[:-1], -1)
        return y if bias is None else y + bias

    def by_packed(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] through oneDNN's layout."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


def lay_out(model, mode: str = "auto") -> tuple[int, dict[tuple[int, ...], tuple[int, int, int]]]:
    """Replace `model`'s linear weights (every layer's and the output layer) with `CpuWeight`s, each with the
    row counts its shape was calibrated to on this CPU (mode auto, which also keeps a bfloat16 copy of each weight
    bfloat16 holds exactly; transposed: every call takes the transposed copy, packed: oneDNN's layout); the bytes
    added and {shape: (rows the transposed copy serves, rows the bfloat16 copy serves, rows it serves in a pass of
    every layer in one call)}.

    `model` is a `llama.LlamaModel` on a CPU, not a stack (a stack's layers run per model, on slices)."""
    head = model.lm_head
    # A tied output layer is the embedding's storage, which stays: both copies are new.
    added = head.numel() * head.element_size() * (1 if head.data_ptr() == model.embed.data_ptr() else 0)
    weights: list[CpuWeight] = []
    for layer in model.layers:
        for name in ("qkv", "out", "gate_up", "down"):
            weight = CpuWeight.of(getattr(layer, name), bf16=mode == "auto")
            setattr(layer, name, weight)
            weights.append(weight)
    model.lm_head = CpuWeight.of(head, bf16=mode == "auto")
    weights.append(model.lm_head)
    if mode == "auto":
        calibrated = calibrate(weights)
    else:
        calibrated = {_key(w): (ALWAYS if mode == "transposed" else 0, 0, 0) for w in weights}
    for w in weights:
        w.transposed_rows, w.bf16_rows, w.bf16_pass_rows = calibrated[_key(w)]
        added += w.transposed.numel() * w.transposed.element_size() + (0 if w.bf16 is None else w.bf16.numel() * w.bf16.element_size())
    return added, {shape: rows for (shape, _), rows in calibrated.items()}


def _key(weight: CpuWeight) -> tuple[tuple[int, ...], bool]:
    return tuple(weight.weight.shape), weight.bf16 is not None


def calibrate(weights: list[CpuWeight]) -> dict[tuple[tuple[int, ...], bool], tuple[int, int, int]]:
    """Per weight shape (and whether it has a bfloat16 copy): (the most rows for which the transposed copy
    computed faster than oneDNN's layout, the most rows for which the bfloat16 copy computed faster than both, the
    most rows for which it computed within `PASS_SLACK` of the faster; 0 without one), timed here on each of
    CALIBRATION_ROWS.

    Each path is timed as a pass runs it: over every weight in turn, so that each call finds its weight where a
    pass finds it (in memory, not in a cache the call before warmed), the paths taking turns within a small
    budget, and the fastest of the turns kept, so that another process taking the core for a moment moves none
    much."""
    inputs = _inputs([w.transposed for w in weights], dim=0)
    transposed: dict[tuple, dict[int, tuple[float, float]]] = {_key(w): {} for w in weights}
    bf16: dict[tuple, dict[int, tuple[float, float]]] = {_key(w): {} for w in weights}
    bf16_losses = 0  # row counts in a row at which no shape's bfloat16 copy was the fastest
    for rows in CALIBRATION_ROWS:
        paths = {
            "transposed": lambda w, x: x @ w.transposed,
            "packed": lambda w, x: w.by_packed(x),
        }
        # The kernel is bound by arithmetic past a few rows, so once it has lost twice, even by the pass's slack, it is
        # not timed at more.
        if bf16_losses < 2 and any(w.bf16 is not None for w in weights):
            paths["bf16"] = lambda w, x: w.bf16 is not None and cpu_kernels.linear_bf16(x, w.bf16, w.transposed.shape[1])
        best = _fastest(weights, paths, lambda w: inputs[w.transposed.shape[0]][:rows], _key)
        for key in transposed:
            transposed[key][rows] = (best[key, "transposed"], best[key, "packed"])
            # A shape whose weights have no bfloat16 copy ran nothing on the kernel: it never wins.
            kernel = best.get((key, "bf16"), float("inf")) if key[1] else float("inf")
            bf16[key][rows] = (kernel, min(best[key, "transposed"], best[key, "packed"]))
        within = any(copy < alternative * PASS_SLACK for by_rows in bf16.values() for copy, alternative in [by_rows[rows]])
        bf16_losses = 0 if within else bf16_losses + 1
    return {key: (choose(transposed[key]), choose(bf16[key]), choose(bf16[key], PASS_SLACK)) for key in transposed}


def _inputs(weights: list[torch.Tensor], dim: int) -> dict[int, torch.Tensor]:
    """Random inputs of the most calibrated rows, one per width (each weight's size along `dim`)."""
    widths = {w.shape[dim] for w in weights}
    return {width: torch.randn(max(CALIBRATION_ROWS), width, device=weights[0].device) for width in widths}


def _fastest(weights: list, paths: dict, inputs, key) -> dict[tuple, float]:
    """{(key(weight), path name): seconds}: each path run over every weight in turn (on `inputs(weight)`), its time
    summed per key, the paths taking turns (in reversed order every other turn) within CALIBRATION_BUDGET_S, at
    least three turns, and the fastest turn kept, so that another process taking the core for a moment moves none
    much."""
    best: dict[tuple, float] = collections.defaultdict(lambda: float("inf"))
    deadline = time.perf_counter() + CALIBRATION_BUDGET_S
    for attempt in range(7):
        for name in list(paths) if attempt % 2 == 0 else list(reversed(paths)):
            spent: dict[tuple, float] = collections.defaultdict(float)
            for w in weights:
                x = inputs(w)
                started = time.perf_counter()
                paths[name](w, x)
                spent[key(w)] += time.perf_counter() - started
            for k, seconds in spent.items():
                best[k, name] = min(best[k, name], seconds)
        if attempt >= 2 and time.perf_counter() > deadline:
            break
    return dict(best)


def choose(timings: dict[int, tuple[float, float]], slack: float = 1.0) -> int:
    """From {rows: (seconds with a copy, seconds with the alternative)}: the most rows the copy was faster at, or
    within `slack` times the alternative's seconds (0: never)."""
    return max((rows for rows, (copy, alternative) in timings.items() if copy < alternative * slack), default=0)


@dataclass
class Bf16Weight:
    """One linear weight [out, in] of a stacked model (`stack.py`), with its bfloat16 copy: calls of at most `rows`
    rows take the kernel, wider ones F.linear on the float32 weight (a view of the stack's, so nothing is copied)."""

    weight: torch.Tensor  # [out, in] float32
    bf16: torch.Tensor  # `cpu_kernels.pack_bf16`'s copy
    rows: int = 0

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.numel() // x.shape[-1] > self.rows:
            return torch.nn.functional.linear(x, self.weight, bias)
        y = cpu_kernels.linear_bf16(x, self.bf16, self.weight.shape[0])
        if bias is not None:
            y = y + bias
        return y


@dataclass
class StackedWeights:
    """A stack's linear weight [G, out, in] as its members' `Bf16Weight`s: each model's rows (`llama.Runs`) through its own."""

    members: list[Bf16Weight]

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None, runs) -> torch.Tensor:
        return torch.cat([self.members[g](x[lo:hi], None if bias is None else bias[g]) for g, lo, hi in runs.runs])


def lay_out_stack(stack) -> dict[tuple[int, ...], int]:
    """Give a stack (`stack.py`) of models whose weights bfloat16 holds exactly the kernel for passes of few rows:
    its linear weights become `StackedWeights` and each member's views `Bf16Weight`s over the same float32
    storage, each shape calibrated like `calibrate` (the kernel against F.linear, over every weight in turn).
    Changes nothing, and returns {}, where some weight is not exactly bfloat16 or the kernel is not built here.
    A stack keeps its float32 weights in the checkpoint's layout (one copy for all members' passes), so the
    float32 layouts of `lay_out` are not made."""
    if cpu_kernels.library() is None:
        return {}
    model = stack.model

    def owner(of, layer: int | None):  # a model's layer, or the model itself for its output layer
        return of if layer is None else of.layers[layer]

    places = [(i, name) for i in range(len(model.layers)) for name in ("qkv", "out", "gate_up", "down")] + [(None, "lm_head")]
    weights: list[list[Bf16Weight]] = []  # per place, per member
    for layer, name in places:
        members = []
        for w in getattr(owner(model, layer), name):
            packed = cpu_kernels.pack_bf16(w)
            if packed is None:
                return {}
            members.append(Bf16Weight(w, packed))
        weights.append(members)
    rows = _calibrate_bf16([w for members in weights for w in members])
    for (layer, name), members in zip(places, weights):
        for w in members:
            w.rows = rows[tuple(w.weight.shape)]
        setattr(owner(model, layer), name, StackedWeights(members))
        # The members' own passes (a step with one member's rows) take their own copies.
        for g, loaded in enumerate(stack.members):
            setattr(owner(loaded.model, layer), name, members[g])
    return rows


def _calibrate_bf16(weights: list[Bf16Weight]) -> dict[tuple[int, ...], int]:
    """Per weight shape: the most of CALIBRATION_ROWS at which the kernel computed faster than F.linear, timed over
    every weight in turn as `calibrate` times its copies."""
    inputs = _inputs([w.weight for w in weights], dim=1)
    timings: dict[tuple[int, ...], dict[int, tuple[float, float]]] = {tuple(w.weight.shape): {} for w in weights}
    for rows in CALIBRATION_ROWS:
        paths = {
            "bf16": lambda w, x: cpu_kernels.linear_bf16(x, w.bf16, w.weight.shape[0]),
            "plain": lambda w, x: torch.nn.functional.linear(x, w.weight),
        }
        best = _fastest(weights, paths, lambda w: inputs[w.weight.shape[1]][:rows], lambda w: tuple(w.weight.shape))
        for shape in timings:
            timings[shape][rows] = (best[shape, "bf16"], best[shape, "plain"])
    return {shape: choose(by_rows) for shape, by_rows in timings.items()}
