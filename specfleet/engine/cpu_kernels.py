"""Kernels for a CPU that torch lacks, compiled on the machine that runs them and loaded with ctypes.

`linear_bf16`: y = x W^T with float32 x and W's values bfloat16 (csrc/bf16_linear.cpp). A decode or verify pass
on a CPU is bound by the bytes of weights it reads; a checkpoint stored in bfloat16 and served in float32 holds
weights that bfloat16 represents exactly, so reading them as bfloat16 and widening them in registers halves the
bytes and changes no value. The sums run in float32, in their own order (as every BLAS's blocking does), so
outputs match F.linear's to float rounding, which tests/engine/test_cpu_kernels.py and the greedy tests against
transformers bound. Where a weight is not exactly bfloat16, `pack_bf16` declines it and F.linear's paths serve.

The library is built once per machine (`-march=native`: the CPU's vector width) into a cache directory
(SPECFLEET_KERNEL_CACHE, else ~/.cache/specfleet/kernels), named by a hash of the source, flags, compiler and the
CPU's feature flags, and written under a temporary name first, so concurrent processes may build it at once.
Without a C++ compiler, or if the build fails, `library()` is None, a warning says why, and `cpu_linear` uses
torch's kernels alone.
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

SOURCE = pathlib.Path(__file__).parent / "csrc" / "bf16_linear.cpp"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC")
BLOCK = 32  # output columns of a packed block; csrc/bf16_linear.cpp's BLOCK
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


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernels of this machine, built on first use; None where they cannot be built (logged)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        log.warning("no C++ compiler (c++, g++, clang++ or $CXX): linear layers run on torch's kernels alone, reading float32 weights")
        return None
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS).encode(), compiler.encode(), _cpu_signature()])).hexdigest()[:16]
    path = cache_dir() / f"bf16_linear-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        building = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(building)], check=True, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            os.replace(building, path)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", None) or str(exc)
            log.warning("building %s with %s failed, so linear layers read float32 weights: %s", SOURCE.name, compiler, detail.strip()[-500:])
            building.unlink(missing_ok=True)
            return None
    lib = ctypes.CDLL(str(path))
    lib.specfleet_linear_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3
    lib.specfleet_linear_bf16.restype = None
    return lib


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
        raise RuntimeError(f"the bfloat16 linear kernel is not built on this machine ({SOURCE.name}; see the warning logged)")
    *leading, width = x.shape
    if x.dtype != torch.float32 or packed.dim() != 3 or packed.shape[1] != width or packed.shape[0] * BLOCK < out_features:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit a packed weight {tuple(packed.shape)} of {out_features} outputs")
    rows = x.numel() // width
    x = x.reshape(rows, width).contiguous()
    y = torch.empty(rows, out_features, dtype=torch.float32, device=x.device)
    lib.specfleet_linear_bf16(x.data_ptr(), packed.data_ptr(), y.data_ptr(), rows, out_features, width)
    return y.view(*leading, out_features)
