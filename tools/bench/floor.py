"""The floor `specfleet bench engine` sets a pass against: the device's memory bandwidth and peak FLOP/s, from the
vendors' data sheets for known GPUs, else measured."""

from __future__ import annotations

import math
import time

# Memory bandwidth (bytes/s) and dense bf16/fp16 peak (FLOP/s) from the vendors' data sheets; the
# first name contained in torch.cuda.get_device_name() wins, so the more specific names come first.
KNOWN_DEVICES = [
    ("H100 PCIe", 2.0e12, 756e12),
    ("H100", 3.35e12, 989e12),
    ("H200", 4.8e12, 989e12),
    ("A100-PCIE-40GB", 1.555e12, 312e12),
    ("A100", 2.0e12, 312e12),
    ("L40S", 0.864e12, 362e12),
    ("L4", 0.3e12, 121e12),
    ("A10", 0.6e12, 125e12),
]


def hardware(device, dtype, bandwidth_gbs: float | None, peak_tflops: float | None) -> tuple[float, float, str]:
    """(bytes/s, FLOP/s, where they came from) for the floor."""
    import torch

    known = None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = next(((bw, pk) for key, bw, pk in KNOWN_DEVICES if key in name), None)
        if known and dtype == torch.float32:
            known = (known[0], known[1] / 2)  # TF32 tensor-core rate, about half the bf16 one (fp32 matmul only with TF32 on)
    bandwidth, bandwidth_source = _number(
        "bandwidth", bandwidth_gbs and bandwidth_gbs * 1e9, known and known[0], lambda: _measure_bandwidth(device), "copy"
    )
    peak, peak_source = _number("peak", peak_tflops and peak_tflops * 1e12, known and known[1], lambda: _measure_peak(device, dtype), "matmul")
    return bandwidth, peak, f"{bandwidth_source}, {peak_source}"


def _number(what: str, given: float | None, known: float | None, measure, how: str) -> tuple[float, str]:
    """One of the floor's numbers and where it came from: as given, else the data sheet's, else measured."""
    if given:
        return given, f"{what}: given"
    if known:
        return known, f"{what}: data sheet"
    return measure(), f"{what}: measured ({how})"


def _measure_bandwidth(device) -> float:
    import torch

    x = torch.empty(64 * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)  # 64 MiB, past the caches
    y = torch.empty_like(x)
    best = math.inf
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        y.copy_(x)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * x.numel() * 4 / best  # read and write


def _measure_peak(device, dtype) -> float:
    import torch

    size = 1024 if device.type == "cpu" else 8192
    a = torch.randn(size, size, dtype=dtype, device=device)
    best = math.inf
    for _ in range(3):
        sync(device)
        t0 = time.perf_counter()
        a @ a
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
