"""Batched and auto attention over the KV pool by where a pass's slots lie, against per-session attention.

    PYTHONPATH=. .venv/bin/python scripts/pool_layouts.py

Demo target, 128 cached positions, CPU time (`time.thread_time`) of one pass, median of 15, ms;
each cell the median of three rounds that take every configuration in turn.
Adjacent slots are read as one view; every other slot (two pipeline lanes whose sessions
alternate) as a view over twice the rows; every fifth slot is gathered (a copy). `auto` (the
services' default) chooses per pass. Prints Markdown.
"""

import pathlib
import statistics
import time

import torch

from specfleet.engine import ForwardItem, Session, forward_batch, load_model

MODEL = pathlib.Path(__file__).resolve().parent.parent / "models" / "demo" / "target"
CONTEXT = 128
STRIDES = {"adjacent": 1, "every other": 2, "every fifth": 5}
ROUNDS = 3


def run(loaded, b: int, n: int, layout: str, mode: str) -> float:
    pool = loaded.pool
    taken = [pool.acquire() for _ in range(b * STRIDES[layout])]
    sessions = []
    for s in range(b):
        session = Session(token_ids=[1] * CONTEXT, kv_len=CONTEXT, pool=pool, slot=taken[s * STRIDES[layout]])
        sessions.append(session)
    items = [ForwardItem(s, [2] * n, list(range(CONTEXT, CONTEXT + n))) for s in sessions]
    loaded.model.attention = mode
    times = []
    for i in range(18):
        t0 = time.thread_time()
        forward_batch(loaded, items, host=False)
        if i >= 3:
            times.append(1e3 * (time.thread_time() - t0))
    for slot in taken:
        pool.release(slot)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    loaded = load_model("target", MODEL)
    modes = [(lay, mode) for mode in ("batched", "auto") for lay in STRIDES]
    print("| sessions x tokens | per-session | " + " | ".join(f"{mode}, {lay} slots" for lay, mode in modes) + " |")
    print("|---|---|" + "---|" * len(modes))
    configs = [("adjacent", "per-session")] + modes
    for b, n in [(4, 1), (16, 1), (16, 5), (32, 1), (32, 5)]:
        # Rounds through every configuration, so that a change in the machine's load reaches each alike.
        rounds = [[run(loaded, b, n, lay, mode) for lay, mode in configs] for _ in range(ROUNDS)]
        row = [statistics.median(r[i] for r in rounds) for i in range(len(configs))]
        print(f"| {b} x {n} | " + " | ".join(f"{x:.2f}" for x in row) + " |", flush=True)


if __name__ == "__main__":
    main()
