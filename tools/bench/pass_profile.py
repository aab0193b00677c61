"""Where one forward pass of `specfleet bench engine` spends its time (`--profile`): torch.profiler over a few passes,
the dearest operations per pass."""

from __future__ import annotations

from tools.bench.floor import sync


def profile_row(text: str | None) -> tuple[int, int] | None:
    """--profile's B,N."""
    if text is None:
        return None
    try:
        b, n = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--profile: B,N (sessions, new tokens), got {text!r}") from None
    return b, n


# Operations a profiled pass lists, the dearest first (`total_ms` sums them all).
PROFILE_TOP = 12


def profile_pass(fn, device) -> dict:
    """Where one pass's time goes: the operations with the most device time (CPU time on a CPU) over three passes of
    fn, per pass, and their total. On a GPU the kernels alone: the operators that launch them carry the same time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    passes = 3
    with profile(activities=activities) as prof:
        for _ in range(passes):
            fn()
        sync(device)

    def self_us(event) -> float:
        if not cuda:
            return event.self_cpu_time_total
        return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)

    events = list(prof.key_averages())
    if cuda:
        kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
        events = kernels or events
    events.sort(key=self_us, reverse=True)
    total = sum(self_us(e) for e in events)
    return {
        "clock": "device" if cuda else "cpu",
        "total_ms": round(total / 1e3 / passes, 3),
        "ops": [{"op": e.key, "ms": round(self_us(e) / 1e3 / passes, 3), "calls": e.count // passes} for e in events[:PROFILE_TOP]],
    }
