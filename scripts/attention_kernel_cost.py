"""Time csrc/attention.cpp (`cpu_kernels.attend`) on one core at decode, verify and prefill shapes, grouped-query and
not, and save its outputs, so that two checkouts' kernels compare in time and bit for bit.

    PYTHONPATH=. taskset -c 0 python scripts/attention_kernel_cost.py --out /tmp/attention-A.pt   # in each checkout
    python scripts/attention_kernel_cost.py --compare /tmp/attention-A.pt /tmp/attention-B.pt

Numbers: docs/benchmarks/engine-forward-pass.md."""

from __future__ import annotations

import argparse
import time

import torch

from specfleet.engine import cpu_kernels

# (name, query heads, key/value heads, head size, cached positions, sessions, new tokens a session)
SHAPES = [
    ("decode, 14 / 2 heads (Qwen2.5-0.5B), 4,000 cached, 4 sessions", 14, 2, 64, 4000, 4, 1),
    ("decode, 32 / 8 heads (Llama 3.2 1B), 4,000 cached, 4 sessions", 32, 8, 64, 4000, 4, 1),
    ("decode, 4 / 4 heads (the demo target), 500 cached, 4 sessions", 4, 4, 64, 500, 4, 1),
    ("verify a chain of 5, 4 / 4 heads, 500 cached, 4 sessions", 4, 4, 64, 500, 4, 5),
    ("prefill 512, 4 / 2 heads of 16, 8,000 cached", 4, 2, 16, 8000, 1, 512),
    ("prefill a 512-token prompt, 4 / 4 heads of 64, nothing cached", 4, 4, 64, 0, 1, 512),
]


def measure() -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    outputs = {}
    for name, heads, kv_heads, dim, cached, sessions, width in SHAPES:
        capacity = sessions * (cached + width) + 64
        pool = torch.randn(2, kv_heads, capacity, dim, generator=gen)
        places = [s * (cached + width) for s in range(sessions)]
        causal = None if width == 1 else torch.tril(torch.ones(width, width, dtype=torch.bool))
        plan = cpu_kernels.AttendPlan(places, [cached] * sessions, [width] * sessions, [causal] * sessions, width, pool[None], heads)
        q = torch.randn(sessions, heads, width, dim, generator=gen)
        outputs[name] = cpu_kernels.attend(q, pool, plan)
        reps = max(3, int(2e8 / (sessions * width * heads * (cached + width) * dim)))
        times = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(reps):
                cpu_kernels.attend(q, pool, plan)
            times.append((time.perf_counter() - started) / reps)
        print(f"{name}: {sorted(times)[2] * 1e3:.3f} ms (median of 5)")
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="save the outputs here")
    parser.add_argument("--compare", nargs=2, metavar="FILE", help="whether two saved runs' outputs are bit for bit equal")
    args = parser.parse_args()
    if args.compare:
        a, b = (torch.load(path) for path in args.compare)
        for name in a:
            print(f"{name}: {'identical' if torch.equal(a[name], b[name]) else 'DIFFERENT'}")
        return
    outputs = measure()
    if args.out:
        torch.save(outputs, args.out)


if __name__ == "__main__":
    main()
