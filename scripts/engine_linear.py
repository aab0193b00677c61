"""CPU time of one forward pass of the demo target with each `linear` mode (specfleet/engine/cpu_linear.py:
plain, auto, transposed, packed) and `2 rows` (laid out, W^T for passes of at most two rows: the fixed
threshold `auto` had before it was calibrated), B sessions x n new tokens after 128 cached positions.

    PYTHONPATH=. .venv/bin/python scripts/engine_linear.py [ROUNDS]

The models are loaded side by side and each shape runs on each in turn, the order reversed every other round,
ROUNDS times (default 5); each cell is the median over rounds of the median of 15 passes after 3
warm-up passes, in `time.thread_time()` (this thread's CPU time, one torch thread), which a shared
machine's load inflates less than wall time. Prints what `auto` calibrated and a markdown table.
"""

import pathlib
import statistics
import sys
import time

import torch

from specfleet.engine import ForwardItem, Session, forward_batch, load_model

MODEL = pathlib.Path(__file__).resolve().parent.parent / "models" / "demo" / "target"
CONTEXT = 128
SHAPES = [(1, 1), (1, 5), (2, 1), (2, 5), (4, 1), (4, 5), (8, 1), (16, 1), (16, 5), (32, 5)]
MODES = ("plain", "auto", "transposed", "packed", "2 rows")


def pass_ms(loaded, b: int, n: int) -> float:
    sessions = []
    for _ in range(b):
        session = Session(token_ids=[1] * CONTEXT)
        session.reserve(loaded.pool, CONTEXT + n, loaded.max_context)
        session.kv_len = CONTEXT
        sessions.append(session)
    items = [ForwardItem(s, [2] * n, list(range(CONTEXT, CONTEXT + n))) for s in sessions]
    times = []
    for i in range(18):
        t0 = time.thread_time()
        forward_batch(loaded, items, host=False)
        if i >= 3:
            times.append(1e3 * (time.thread_time() - t0))
    for s in sessions:
        s.evict_kv()
    return statistics.median(times)


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    torch.set_num_threads(1)
    models = {mode: load_model("target", MODEL, linear="auto" if mode == "2 rows" else mode) for mode in MODES}
    for loaded in models.values():
        loaded.prepare(1 << 30, 64)
    for w in [
        models["2 rows"].model.lm_head,
        *(getattr(layer, n) for layer in models["2 rows"].model.layers for n in ("qkv", "out", "gate_up", "down")),
    ]:
        w.transposed_rows = 2
    auto = models["auto"].model
    print(
        "auto calibrated (rows W^T serves):",
        {n: getattr(auto.layers[0], n).transposed_rows for n in ("qkv", "out", "gate_up", "down")},
        "lm_head",
        auto.lm_head.transposed_rows,
    )
    results: dict[tuple, list[float]] = {}
    for r in range(rounds):
        for b, n in SHAPES:
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                results.setdefault((b, n, mode), []).append(pass_ms(models[mode], b, n))
    print("| sessions x tokens | " + " | ".join(f"{m}, ms" for m in MODES) + " | 2 rows / auto |")
    print("|---|" + "---|" * (len(MODES) + 1))
    for b, n in SHAPES:
        ms = {m: statistics.median(results[(b, n, m)]) for m in MODES}
        print(f"| {b} x {n} | " + " | ".join(f"{ms[m]:.2f}" for m in MODES) + f" | {ms['2 rows'] / ms['auto']:.2f}x |")


if __name__ == "__main__":
    main()
