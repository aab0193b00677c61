"""Draft latency of 8 drafting streams while a 4,000-token prompt arrives at their drafter, with and without
chunked prefill (`drafters[].max_prefill_tokens`).

    PYTHONPATH=. .venv/bin/python scripts/drafter_chunked_prefill.py [--budgets 0,512,2048,4096] [--repeat 3]

At the drafter (`drafter_service.drafter.draft_batch`, greedy, 4 draft tokens a call): a random Llama allowing
16,384 positions (2 layers, hidden 128, float32, one thread; a drafter an eighth of scripts/chunked_prefill.py's
target), 8 sessions with 200-token prompts drafting every call; at call 5 a session with a 4,000-token prompt
joins. Each call's wall time is what the 8 streams wait for their drafts. Per budget, interleaved within each
repeat: the streams' p50 and worst over 30 calls, and the long prompt's time to its first draft. One JSON object.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import torch

from drafter_service.drafter import DraftItem, DraftModel, draft_batch
from scripts.kv_memory import long_model
from specfleet.engine import SessionStore, load_model
from specfleet.sampling import SamplingParams


def run(path: pathlib.Path, budget: int, calls: int = 30, arrives: int = 5) -> dict:
    model = DraftModel(load_model("d", path), SessionStore(1 << 32, 100), proposal_top_k=8)
    models, greedy = {"d": model}, SamplingParams()
    gen = torch.Generator().manual_seed(1)
    prompts = {f"s{i}": torch.randint(1, 12288, (200,), generator=gen).tolist() for i in range(8)}
    long = torch.randint(1, 12288, (4000,), generator=gen).tolist()
    draft_batch(models, [("d", DraftItem(sid, 0, p, num_draft_tokens=4, sampling=greedy)) for sid, p in prompts.items()], budget)
    times, first_draft_s, arrived, long_sent = [], None, None, False
    for c in range(calls):
        # Each stream keeps its prompt (its drafts rejected), so every call drafts the same 4 positions.
        items = [("d", DraftItem(sid, len(p), [], num_draft_tokens=4, sampling=greedy)) for sid, p in prompts.items()]
        if c >= arrives and first_draft_s is None:
            items.append(("d", DraftItem("long", len(long) if long_sent else 0, [] if long_sent else long, num_draft_tokens=4, sampling=greedy)))
            long_sent, arrived = True, arrived or time.perf_counter()
        started = time.perf_counter()
        results = draft_batch(models, items, budget)
        times.append(time.perf_counter() - started)
        if len(results) > 8 and results[8].token_ids:
            first_draft_s = time.perf_counter() - arrived
    return {"draft_p50_ms": statistics.median(times) * 1e3, "draft_max_ms": max(times) * 1e3, "long_first_draft_ms": first_draft_s * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="0,512,2048,4096")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    budgets = [int(b) for b in args.budgets.split(",")]
    out = {b: [] for b in budgets}
    with tempfile.TemporaryDirectory() as tmp:
        path = long_model(pathlib.Path(tmp) / "d", layers=2, hidden=128)
        for r in range(args.repeat):
            for b in budgets if r % 2 == 0 else budgets[::-1]:
                out[b].append(run(path, b))
    print(json.dumps({b: {k: [round(x[k], 1) for x in runs] for k in runs[0]} for b, runs in out.items()}))


if __name__ == "__main__":
    main()
