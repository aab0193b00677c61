"""A batch queue's round trip beyond its pass, on asyncio's event loop and on uvloop's, interleaved.

    taskset -c 1 .venv/bin/python scripts/event_loop_handoff.py [--runs 5] [--calls 300] [--pass-ms 3]

Each run awaits `--calls` calls of a BatchQueue (specfleet/batching.py) whose model thread computes for `--pass-ms`
(matrix products, one torch thread), and takes the median of each call's wall time less its pass: the call's hand-off
to the model thread and its answer's way back through the event loop, what a colocated round pays per call
(docs/benchmarks/event-loop.md). Runs alternate between the two loops; prints each loop's run medians.
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import uvloop  # noqa: E402

from specfleet.batching import BatchQueue  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--pass-ms", type=float, default=3.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    a = torch.randn(256, 256)

    def work(items: list) -> list:
        started = time.perf_counter()
        while time.perf_counter() - started < args.pass_ms / 1e3:
            a @ a
        return items

    async def run() -> float:
        queue = BatchQueue("handoff", work, 64, 0.0)
        beyond = []
        for _ in range(args.calls):
            started = time.perf_counter()
            _, stats = await queue.submit([1])
            beyond.append((time.perf_counter() - started) * 1e3 - stats.compute_ms)
        queue.close()
        return statistics.median(beyond)

    medians: dict[str, list[float]] = {"asyncio": [], "uvloop": []}
    for _ in range(args.runs):
        medians["asyncio"].append(asyncio.run(run()))
        medians["uvloop"].append(uvloop.run(run()))
    for loop, values in medians.items():
        print(f"{loop}: ms beyond the pass, run medians {[round(v, 3) for v in values]}, median {statistics.median(values):.3f}")


if __name__ == "__main__":
    main()
