"""Inter-token latency of 8 decoding streams while a 4,000-token prompt arrives, with and without chunked prefill.

    PYTHONPATH=. .venv/bin/python scripts/chunked_prefill.py [--budgets 0,512,2048] [--repeat 3]

At the verifier (`verifier_service.verifier.Verifier`, greedy, no drafts): a random Llama allowing 16,384
positions (4 layers, hidden 256, 4 heads, 2 KV heads, float32, one thread), 8 sessions with 200-token
prompts decoding a token per batch; at batch 5 a session with a 4,000-token prompt joins. Each batch's wall
time is the 8 streams' inter-token latency. Per budget (`verifier.max_prefill_tokens`, 0: none), the
budgets interleaved within each repeat: the streams' ITL p50 and worst over the 30 batches, and the long
prompt's time to first token. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time

import torch

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="0,512,2048")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    budgets = [int(b) for b in args.budgets.split(",")]
    out = {b: [] for b in budgets}
    with tempfile.TemporaryDirectory() as tmp:
        path = long_model(pathlib.Path(tmp) / "m", layers=4, hidden=256)
        for r in range(args.repeat):
            for b in budgets if r % 2 == 0 else budgets[::-1]:
                out[b].append(run(path, b))
    print(json.dumps({b: {k: [round(x[k], 1) for x in runs] for k in runs[0]} for b, runs in out.items()}))


if __name__ == "__main__":
    main()
