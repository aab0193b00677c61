"""The time `shaping.shape` (p as each sampled session asked) takes inside the verifier's verify passes, per logits
shape: `scripts/verify_pass_cost.py` at temperature 1 and four sessions, `shape` timed, on whatever code PYTHONPATH
holds (run it in two checkouts to compare them).

    PYTHONPATH=. taskset -c 0 .venv/bin/python scripts/shape_cost.py
"""

from __future__ import annotations

import runpy
import statistics
import sys
import time

from specfleet.engine import shaping


def main() -> None:
    times: dict[tuple, list[float]] = {}
    real = shaping.shape

    def timed(params, logits):
        started = time.perf_counter()
        out = real(params, logits)
        times.setdefault(tuple(logits.shape), []).append(time.perf_counter() - started)
        return out

    shaping.shape = timed  # the verifier calls it as shaping.shape
    sys.argv = ["verify_pass_cost.py", "--temperature", "1", "--reps", "100", "--sessions", "4"]
    runpy.run_path("scripts/verify_pass_cost.py", run_name="__main__")
    for shape, seconds in sorted(times.items()):
        print(f"shape of logits {list(shape)}: {statistics.median(seconds) * 1e6:.0f} us (median of {len(seconds)})")


if __name__ == "__main__":
    main()
