"""CPU time of one forward pass of the demo target, B sessions x n new tokens after 128 cached positions.

    PYTHONPATH=. .venv/bin/python scripts/engine_cpu_time.py per-session|batched|auto

Measures `time.thread_time()` (this thread's CPU time, torch on one thread), not wall time, so
that other processes' load on a shared machine inflates it far less than `specfleet bench
engine`'s wall-clock medians. Prints JSON {"B x n": median ms}. It also runs from a checkout that
predates `specfleet/engine/` (its `specfleet.runtime`), to compare with the code before the KV pool:
`cd OLD && PYTHONPATH=OLD python NEW/scripts/engine_cpu_time.py per-session`.
"""

import inspect
import json
import pathlib
import statistics
import sys
import time

import torch

try:
    from specfleet.engine import ForwardItem, Session, forward_batch, load_model

    POOL = True
except ImportError:  # a checkout from before the KV pool
    from specfleet.runtime import ForwardItem, Session, forward_batch, load_model

    POOL = False

MODEL = pathlib.Path(__file__).resolve().parent.parent / "models" / "demo" / "target"
CONTEXT = 128
SHAPES = [(1, 1), (1, 5), (4, 1), (4, 5), (16, 1), (16, 5), (32, 1), (32, 5)]


def main() -> None:
    torch.set_num_threads(1)
    loaded = load_model("target", MODEL, attention=sys.argv[1])
    out = {}
    for b, n in SHAPES:
        sessions = []
        for _ in range(b):
            session = Session(token_ids=[1] * CONTEXT)
            if not POOL:  # a checkout from before the KV pool
                session.reserve(loaded.model, CONTEXT + n)
            elif "limit" in inspect.signature(Session.reserve).parameters:  # the paged pool
                session.reserve(loaded.pool, CONTEXT + n, loaded.max_context)
            else:  # a checkout with fixed slots
                session.reserve(loaded.pool, CONTEXT + n)
            session.kv_len = CONTEXT
            sessions.append(session)
        items = [ForwardItem(s, [2] * n, list(range(CONTEXT, CONTEXT + n))) for s in sessions]
        times = []
        for i in range(25):
            t0 = time.thread_time()
            forward_batch(loaded, items, host=False)
            if i >= 5:
                times.append(1e3 * (time.thread_time() - t0))
        out[f"{b} x {n}"] = round(statistics.median(times), 2)
        if POOL:
            for s in sessions:
                s.evict_kv()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
