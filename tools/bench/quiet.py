"""Waiting until the cores a measurement runs on are idle before it starts.

An interleaved run keeps every system up at once, so a system measured right after another shares its cores with
whatever that one still does after its last reply: vLLM's CPU worker keeps about half a core busy for a second
after it has served (docs/benchmarks/compare.md), which cost the system measured next up to 45% of its tokens/s in
an 8-request point. The bench treats systems as black boxes, so it does not ask them whether they are done; it
reads the cores' idle time from /proc/stat, as `top` does, and starts when one short window is idle enough.
"""

from __future__ import annotations

import asyncio
import os
import time

IDLE_SHARE = 0.95  # a core counts as settled when at least this share of a window was idle
WINDOW_S = 0.2
TIMEOUT_S = 15.0


def _ticks(cpus: list[int] | None) -> tuple[int, int]:
    """(idle, total) clock ticks so far, summed over `cpus` (every CPU when None); (0, 0) where /proc/stat is absent."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0, 0
    wanted = None if cpus is None else {f"cpu{c}" for c in cpus}
    idle = total = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or (wanted is not None and name not in wanted):
            continue
        ticks = [int(x) for x in fields[:8]]  # user nice system idle iowait irq softirq steal
        idle += ticks[3] + ticks[4]
        total += sum(ticks)
    return idle, total


def idle_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of the ticks between two `_ticks` readings that were idle; 1.0 when no tick passed."""
    total = after[1] - before[1]
    return 1.0 if total <= 0 else (after[0] - before[0]) / total


async def until_idle(cpus: list[int] | None, share: float = IDLE_SHARE, window_s: float = WINDOW_S, timeout_s: float = TIMEOUT_S) -> float:
    """Wait until one `window_s` window of `cpus` is at least `share` idle, at most `timeout_s`; the seconds waited
    (`timeout_s` or more where the cores never settled). Returns at once where the machine has no /proc/stat."""
    if not os.path.exists("/proc/stat"):
        return 0.0
    t0 = time.monotonic()
    while True:
        before = _ticks(cpus)
        await asyncio.sleep(window_s)
        if idle_share(before, _ticks(cpus)) >= share or time.monotonic() - t0 >= timeout_s:
            return time.monotonic() - t0
