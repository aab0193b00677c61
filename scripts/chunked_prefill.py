"""Inter-token latency of 8 decoding streams while a 4,000-token prompt arrives, with and without chunked prefill.

    PYTHONPATH=. .venv/bin/python scripts/chunked_prefill.py [--budgets 0,512,2048] [--repeat 3] [--at verifier|drafter]

At the verifier (`verifier_service.verifier.Verifier`, greedy, no drafts): a random Llama allowing 16,384
positions (4 layers, hidden 256, 4 heads, 2 KV heads, float32, one thread), 8 sessions with 200-token
prompts decoding a token per batch; at batch 5 a session with a 4,000-token prompt joins. Each batch's wall
time is the 8 streams' inter-token latency. Per budget (`verifier.max_prefill_tokens`, 0: none), the
budgets interleaved within each repeat: the streams' ITL p50 and worst over the 30 batches, and the long
prompt's time to first token. Prints one JSON object.

With --at drafter, the same at a drafter service (`drafter_service.drafter.draft_batch`, greedy, 4 draft tokens a
call, `drafters[].max_prefill_tokens`): a random Llama drafter of 2 layers, hidden 128; 8 sessions drafting every
call, each keeping its 200-token prompt (its drafts rejected); at call 5 the 4,000-token prompt joins. A call's
wall time is what the streams wait for their drafts; the long prompt's time to its first draft.
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
from verifier_service.verifier import Verifier, VerifyItem


def run(path: pathlib.Path, budget: int, batches: int = 30, arrives: int = 5) -> dict:
    verifier = Verifier(load_model("m", path), SessionStore(1 << 32, 100), max_prefill_tokens=budget)
    gen = torch.Generator().manual_seed(1)
    prompts = {f"s{i}": torch.randint(1, 12288, (200,), generator=gen).tolist() for i in range(8)}
    long = torch.randint(1, 12288, (4000,), generator=gen).tolist()
    held = dict.fromkeys(prompts, 0)
    verifier.verify_batch([VerifyItem(sid, 0, p, SamplingParams()) for sid, p in prompts.items()])
    held = {sid: len(verifier.store.get(sid).token_ids) for sid in prompts}
    times, first_token_s, long_held, arrived = [], None, 0, None
    for b in range(batches):
        items = [VerifyItem(sid, held[sid], [], SamplingParams()) for sid in prompts]
        if b >= arrives and first_token_s is None:
            items.append(VerifyItem("long", long_held, [] if long_held else long, SamplingParams()))
            arrived = arrived or time.perf_counter()
        started = time.perf_counter()
        results = verifier.verify_batch(items)
        times.append(time.perf_counter() - started)
        held = {sid: len(verifier.store.get(sid).token_ids) for sid in prompts}
        if len(results) > 8:
            long_held = len(verifier.store.get("long").token_ids)
            if not results[8].prefilling:
                first_token_s = time.perf_counter() - arrived
    return {"itl_p50_ms": statistics.median(times) * 1e3, "itl_max_ms": max(times) * 1e3, "long_ttft_ms": first_token_s * 1e3}


def run_drafter(path: pathlib.Path, budget: int, calls: int = 30, arrives: int = 5) -> dict:
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
    ap.add_argument("--budgets", default="0,512,2048")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--at", choices=["verifier", "drafter"], default="verifier")
    args = ap.parse_args()
    torch.set_num_threads(1)
    budgets = [int(b) for b in args.budgets.split(",")]
    out = {b: [] for b in budgets}
    with tempfile.TemporaryDirectory() as tmp:
        measure, size = (run, dict(layers=4, hidden=256)) if args.at == "verifier" else (run_drafter, dict(layers=2, hidden=128))
        path = long_model(pathlib.Path(tmp) / "m", **size)
        for r in range(args.repeat):
            for b in budgets if r % 2 == 0 else budgets[::-1]:
                out[b].append(measure(path, b))
    print(json.dumps({b: {k: [round(x[k], 1) for x in runs] for k in runs[0]} for b, runs in out.items()}))


if __name__ == "__main__":
    main()
