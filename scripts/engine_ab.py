"""One forward pass of the demo target in two checkouts, interleaved: CPU time of each, and their ratio.

    PYTHONPATH=. .venv/bin/python scripts/engine_ab.py --old OLD_CHECKOUT [--new .] [--attention auto] [--rounds 15] [--cpu 1]

Passes of B sessions after 128 cached positions each, `linear: auto`, one torch thread: each session feeding n new
tokens ("16x5"), or ragged, as a verify pass with a few drafted sessions among plain ones ("1x5+15x1"). Each checkout
runs in a worker process of its own (pinned to --cpu) that keeps its sessions; the driver asks the
two in turn, round after round (5 passes each, their median), so that a shared machine's drift falls
on both alike, and reports per shape the median of each and the median of the per-round ratios.
Works with checkouts from before the paged KV pool (fixed slots) too.
"""

from __future__ import annotations

import argparse
import inspect
import json
import pathlib
import statistics
import subprocess
import sys
import time

MODEL = pathlib.Path(__file__).resolve().parent.parent / "models" / "demo" / "target"
CONTEXT = 128
# Each shape: (sessions, new tokens) groups of one pass.
SHAPES = [
    ((1, 1),),
    ((1, 5),),
    ((4, 1),),
    ((4, 5),),
    ((1, 5), (3, 1)),
    ((16, 1),),
    ((16, 5),),
    ((1, 5), (15, 1)),
    ((4, 5), (12, 1)),
    ((32, 1),),
    ((32, 5),),
]


def label(shape) -> str:
    return "+".join(f"{b}x{n}" for b, n in shape)


def worker(attention: str) -> None:
    """Answer "SHAPE reps" lines (`label`'s form) with the median CPU ms of `reps` passes, on whatever code PYTHONPATH
    holds."""
    import torch

    from specfleet.engine import ForwardItem, Session, forward_batch, load_model

    torch.set_num_threads(1)
    loaded = load_model("target", MODEL, attention=attention, linear="auto")
    loaded.prepare(1 << 30, 4096)
    paged = "limit" in inspect.signature(Session.reserve).parameters
    items = {}
    print("ready", flush=True)
    for line in sys.stdin:
        shape, reps = line.split()
        if shape not in items:
            widths = [int(n) for group in shape.split("+") for b, n in [group.split("x")] for _ in range(int(b))]
            sessions = [Session(token_ids=[1] * CONTEXT) for _ in widths]
            for s, n in zip(sessions, widths):
                s.reserve(loaded.pool, CONTEXT + n, *([loaded.max_context] if paged else []))
                s.kv_len = CONTEXT
            items[shape] = [ForwardItem(s, [2] * n, list(range(CONTEXT, CONTEXT + n))) for s, n in zip(sessions, widths)]
        times = []
        for _ in range(int(reps)):
            started = time.thread_time()
            forward_batch(loaded, items[shape], host=False)
            times.append(1e3 * (time.thread_time() - started))
        print(json.dumps(statistics.median(times)), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="the checkout to compare against")
    ap.add_argument("--new", default=".", help="the checkout under test")
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--cpu", default="1", help="the core both workers are pinned to")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.attention)

    def start(root: str) -> subprocess.Popen:
        root = str(pathlib.Path(root).resolve())
        cmd = [
            "taskset",
            "-c",
            args.cpu,
            sys.executable,
            str(pathlib.Path(__file__).resolve()),
            "--old",
            "-",
            "--worker",
            "--attention",
            args.attention,
        ]
        proc = subprocess.Popen(
            cmd, cwd=root, env={"PYTHONPATH": root, "PATH": "/usr/bin:/bin"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout.readline().strip() == "ready", f"the worker in {root} did not start"
        return proc

    def ask(proc: subprocess.Popen, shape: str) -> float:
        proc.stdin.write(f"{shape} 5\n")
        proc.stdin.flush()
        return float(proc.stdout.readline())

    old, new = start(args.old), start(args.new)
    out = {}
    for shape in map(label, SHAPES):
        ask(old, shape), ask(new, shape)  # warm-up
        rounds = [(ask(old, shape), ask(new, shape)) for _ in range(args.rounds)]
        out[shape] = {
            "old_ms": round(statistics.median(o for o, _ in rounds), 2),
            "new_ms": round(statistics.median(w for _, w in rounds), 2),
            "new_over_old": round(statistics.median(w / o for o, w in rounds), 3),
        }
        print(f"{shape}: {out[shape]}", file=sys.stderr, flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
