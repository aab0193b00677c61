"""Kernels for a CPU that torch lacks, compiled on the machine that runs them and loaded with ctypes.

`linear_bf16`: y = x W^T with float32 x and W's values bfloat16 (csrc/bf16_linear.cpp). A decode or verify pass
on a CPU is bound by the bytes of weights it reads; a checkpoint stored in bfloat16 and served in float32 holds
weights that bfloat16 represents exactly, so reading them as bfloat16 and widening them in registers halves the
bytes and changes no value. The sums run in float32, in their own order (as every BLAS's blocking does), so
outputs match F.linear's to float rounding, which tests/engine/test_cpu_kernels.py and the greedy tests against
transformers bound. Where a weight is not exactly bfloat16, `pack_bf16` declines it and F.linear's paths serve.

`race` (csrc/race.cpp): the exponential race of seeded sessions over the whole vocabulary in one pass a row, where
the tensor form's dozen [rows, V] temporaries and V logarithms took a sixth of the verifier's time serving four
seeded sampled clients.

`mask_bits` (csrc/bitmask.cpp): structured output's grammar mask applied to a row's logits in one pass, where
unpacking the bits with torch takes a handful of small operations a row.

`rope_write`, `attend`, `add_rms_norm` and `silu_mul` (csrc/attention.cpp): a layer's queries and keys rotated
and its new keys and values written into the KV pool, its attention for every session of a pass, RMSNorm with
the residual add before it, and the MLP's gate, one call each. A pass of a few rows spends more on dispatching
torch's small operations (an attention call per session and layer, a norm's five kernels, RoPE's four) than on
their arithmetic; one call each does the same float32 arithmetic, every row on its own.

The library (every csrc/*.cpp) is built once per machine (`-march=native`: the CPU's vector width) into a cache
directory (SPECFLEET_KERNEL_CACHE, else ~/.cache/specfleet/kernels), named by a hash of the sources, flags,
compiler and the CPU's feature flags, and written under a temporary name first, so concurrent processes may build
it at once. Without a C++ compiler, or if the build fails, `library()` is None, a warning says why, and the
engine uses torch's kernels alone.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(sorted((pathlib.Path(__file__).parent / "csrc").glob("*.cpp")))
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
BLOCK = 32  # output columns of a packed block; csrc/bf16_linear.cpp's BLOCK
MAX_HEAD_DIM = 256  # csrc/attention.cpp's MAX_HEAD_DIM
BUILD_TIMEOUT_S = 120


def cache_dir() -> pathlib.Path:
    configured = os.environ.get("SPECFLEET_KERNEL_CACHE")
    if configured:
        return pathlib.Path(configured)
    return pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache") / "specfleet" / "kernels"


def _cpu_signature() -> bytes:
    """What `-march=native` compiles for: the CPU's feature flags (Linux), else what platform says of it."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.encode()
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}".encode()


def takes_head_dim(head_dim: int) -> bool:
    """Whether `attend` and `rope_write` take heads of this size: a multiple of 16 (every vector width's lanes), at
    most MAX_HEAD_DIM (csrc/attention.cpp keeps a head in registers)."""
    return head_dim % 16 == 0 and head_dim <= MAX_HEAD_DIM


class Pass(ctypes.Structure):
    """csrc/attention.cpp's `Pass`: where one pass's sessions lie (`AttendPlan`)."""

    _fields_ = [
        *((name, ctypes.c_int64) for name in ("batch", "width", "heads", "kv_heads", "head_dim", "capacity")),
        *((name, ctypes.c_void_p) for name in ("kv_lens", "new_lens", "starts", "indices", "masks")),
        ("scale", ctypes.c_float),
    ]


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels of this machine, built on first use; None where they cannot be built (logged)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        log.warning("no C++ compiler (c++, g++, clang++ or $CXX): passes run on torch's kernels alone, linear layers reading float32 weights")
        return None
    parts = [*(source.read_bytes() for source in SOURCES), " ".join(FLAGS).encode(), compiler.encode(), _cpu_signature()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    path = cache_dir() / f"specfleet_kernels-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        building = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            command = [compiler, *FLAGS, *map(str, SOURCES), "-o", str(building)]
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            os.replace(building, path)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", None) or str(exc)
            names = ", ".join(source.name for source in SOURCES)
            log.warning("building %s with %s failed, so passes run on torch's kernels alone: %s", names, compiler, detail.strip()[-500:])
            building.unlink(missing_ok=True)
            return None
    lib = ctypes.CDLL(str(path))
    lib.specfleet_linear_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.specfleet_linear_bf16.restype = None
    lib.specfleet_attend.argtypes = [ctypes.POINTER(Pass), ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_void_p]
    lib.specfleet_attend.restype = None
    lib.specfleet_add_rms_norm.argtypes = [*[ctypes.c_void_p] * 4, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    lib.specfleet_add_rms_norm.restype = None
    lib.specfleet_rope_write.argtypes = [ctypes.POINTER(Pass), *[ctypes.c_void_p] * 6]
    lib.specfleet_rope_write.restype = None
    lib.specfleet_silu_mul.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.specfleet_silu_mul.restype = None
    # cpu_pass.run_layers: the model's layers, the pass, batch, width, rows, row index, positions, pool, its layer's
    # floats, x, h, logits.
    lib.specfleet_layers.argtypes = [ctypes.c_void_p, ctypes.POINTER(Pass), *[ctypes.c_int64] * 3, *[ctypes.c_void_p] * 3, ctypes.c_int64]
    lib.specfleet_layers.argtypes += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32]
    lib.specfleet_layers.restype = None
    lib.specfleet_race.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.specfleet_race.restype = None
    lib.specfleet_mask_bits.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    lib.specfleet_mask_bits.restype = None
    return lib


def race(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[R] each row's exponential race winner over its whole vocabulary (`sampling.race` of `sampling.race_noise`)
    for probs [R, V] float32 and keys [R] on the CPU: one pass over each row (csrc/race.cpp)."""
    probs, keys = probs.contiguous(), keys.contiguous()
    winners = torch.empty(probs.shape[0], dtype=torch.long)
    library().specfleet_race(probs.data_ptr(), probs.shape[0], probs.shape[1], keys.data_ptr(), winners.data_ptr())
    return winners


def mask_bits(rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Every token whose bit is clear in bitmask [R, words] int32 given logit -inf in rows [R, V] float32 (contiguous,
    on the CPU), in place (csrc/bitmask.cpp)."""
    bitmask = bitmask.contiguous()
    library().specfleet_mask_bits(rows.data_ptr(), rows.shape[0], rows.shape[1], bitmask.data_ptr(), bitmask.shape[1])


def pack_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [N, K] (float32, on the CPU) as bfloat16 blocks [ceil(N / BLOCK), K, BLOCK], zero-padded; None unless
    every value is exactly a bfloat16 (then reading it as one changes nothing)."""
    narrow = weight.detach().to(torch.bfloat16)
    if not torch.equal(narrow.to(weight.dtype), weight):
        return None
    n, k = narrow.shape
    blocks = -(-n // BLOCK)
    padded = torch.zeros(blocks * BLOCK, k, dtype=torch.bfloat16, device=weight.device)
    padded[:n] = narrow
    return padded.view(blocks, BLOCK, k).transpose(1, 2).contiguous()


def linear_bf16(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [..., K] float32 times the weight `pack_bf16` packed, transposed: [..., out_features] float32."""
    lib = library()
    if lib is None:
        raise RuntimeError("the CPU kernels are not built on this machine (csrc/; see the warning logged)")
    *leading, width = x.shape
    if x.dtype != torch.float32 or packed.dim() != 3 or packed.shape[1] != width or packed.shape[0] * BLOCK < out_features:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit a packed weight {tuple(packed.shape)} of {out_features} outputs")
    rows = x.numel() // width
    x = x.reshape(rows, width).contiguous()
    y = torch.empty(rows, out_features, dtype=torch.float32, device=x.device)
    lib.specfleet_linear_bf16(x.data_ptr(), packed.data_ptr(), y.data_ptr(), rows, out_features, width)
    return y.view(*leading, out_features)


class AttendPlan:
    """Where one pass's sessions lie and what their new tokens see, for `rope_write` and `attend`: built once a pass,
    read by every layer. `places`, `kv_lens`, `new_lens` and `attends` as `llama.forward` takes them (a range's start
    or every position's index; cached and new lengths; an [n, n] bool pattern or None: all new tokens visible);
    `pool` the KV pool [layers, 2, KV, C, D] (float32, contiguous), `heads` the model's query heads."""

    def __init__(self, places: list, kv_lens: list[int], new_lens: list[int], attends: list, width: int, pool: torch.Tensor, heads: int):
        _, _, kv_heads, capacity, head_dim = pool.shape
        if pool.dtype != torch.float32 or not pool.is_contiguous() or not takes_head_dim(head_dim):
            raise ValueError(
                f"the attention kernel reads a contiguous float32 pool of head size 16, 32, ... {MAX_HEAD_DIM}, got {pool.dtype} {tuple(pool.shape)}"
            )
        batch = len(places)
        self.batch, self.width, self.heads, self.head_dim = batch, width, heads, head_dim
        self.layer_shape = pool.shape[1:]  # what `attend` and `rope_write` may be handed: one layer of this pool
        indices = [None if isinstance(p, int) else p.to(torch.long).contiguous() for p in places]
        masks = [None if a is None else a.to(torch.uint8).contiguous() for a in attends]
        arrays = (
            (ctypes.c_int64 * batch)(*kv_lens),
            (ctypes.c_int64 * batch)(*new_lens),
            (ctypes.c_int64 * batch)(*(p if isinstance(p, int) else -1 for p in places)),
            (ctypes.c_void_p * batch)(*(None if i is None else i.data_ptr() for i in indices)),
            (ctypes.c_void_p * batch)(*(None if m is None else m.data_ptr() for m in masks)),
        )
        self._keep = (indices, masks, arrays)  # what the pointers point into
        self.ref = ctypes.byref(
            Pass(batch, width, heads, kv_heads, head_dim, capacity, *(ctypes.addressof(a) for a in arrays), head_dim**-0.5)
        )  # fmt: skip


def attend(q: torch.Tensor, pool_layer: torch.Tensor, plan: AttendPlan) -> torch.Tensor:
    """[B, N, H, D] float32: each session's new tokens' attention over its positions in `pool_layer` (one layer of
    the pool `plan` was built for, [2, KV, C, D]) as `plan` says, for queries q [B, H, N, D] (float32, its last
    dimension contiguous); rows past a session's new tokens are zero. scaled_dot_product_attention's arithmetic,
    in one call."""
    if q.dtype != torch.float32 or q.stride(-1) != 1 or q.shape != (plan.batch, plan.heads, plan.width, plan.head_dim):
        raise ValueError(f"attend takes float32 queries [{plan.batch}, {plan.heads}, {plan.width}, {plan.head_dim}], got {q.dtype} {tuple(q.shape)}")
    _check_layer(pool_layer, plan)
    out = torch.empty(plan.batch, plan.width, plan.heads, plan.head_dim, dtype=torch.float32)
    library().specfleet_attend(plan.ref, q.data_ptr(), *q.stride()[:3], pool_layer.data_ptr(), out.data_ptr())
    return out


def rope_write(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool_layer: torch.Tensor, plan: AttendPlan
) -> torch.Tensor:
    """Queries [B, N, H, D] from qkv [B, N, (H + 2 KV) D] (contiguous float32), q and k rotated by RoPE at `positions`
    [B, N] with the model's `cos` and `sin` tables ([positions, D], float32); each new token's key and value written
    into `pool_layer` (one layer of the pool `plan` was built for) where `plan` places it, padding tokens' nowhere."""
    if qkv.dtype != torch.float32 or not qkv.is_contiguous() or positions.dtype != torch.long or cos.dtype != torch.float32:
        raise ValueError(f"rope_write takes contiguous float32 qkv and long positions, got {qkv.dtype} {tuple(qkv.shape)}, {positions.dtype}")
    _check_layer(pool_layer, plan)
    positions = positions.contiguous()
    q = torch.empty(plan.batch, plan.width, plan.heads, plan.head_dim, dtype=torch.float32)
    library().specfleet_rope_write(
        plan.ref, qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), pool_layer.data_ptr()
    )
    return q


def _check_layer(pool_layer: torch.Tensor, plan: AttendPlan) -> None:
    """The kernels index `pool_layer` by the plan's places: it must be one (contiguous) layer of the plan's pool."""
    if pool_layer.shape != plan.layer_shape or not pool_layer.is_contiguous():
        raise ValueError(f"a pool layer of {tuple(plan.layer_shape)}, contiguous, was planned for; got {tuple(pool_layer.shape)}")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x + delta over the last dimension, scaled by `weight`; x (contiguous float32) becomes x + delta in
    place where delta is given (the residual stream's add before each norm of a layer)."""
    width = x.shape[-1]
    if x.dtype != torch.float32 or not x.is_contiguous() or weight.dtype != torch.float32:
        raise ValueError(f"add_rms_norm takes contiguous float32 rows, got {x.dtype} {tuple(x.shape)}")
    if delta is not None:
        delta = delta.contiguous()
        if delta.shape != x.shape or delta.dtype != torch.float32:
            raise ValueError(f"add_rms_norm's delta {tuple(delta.shape)} {delta.dtype} does not match x {tuple(x.shape)}")
    out = torch.empty_like(x)
    library().specfleet_add_rms_norm(
        x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // width, width, eps
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 I] (contiguous float32), gate its first half: [..., I]."""
    inter = gate_up.shape[-1] // 2
    if gate_up.dtype != torch.float32 or not gate_up.is_contiguous():
        raise ValueError(f"silu_mul takes contiguous float32 rows, got {gate_up.dtype} {tuple(gate_up.shape)}")
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=torch.float32)
    library().specfleet_silu_mul(gate_up.data_ptr(), gate_up.numel() // gate_up.shape[-1], inter, out.data_ptr())
    return out
