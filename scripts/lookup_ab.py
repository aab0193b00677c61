"""The verifier's lookup (`lookup_tokens`) against plain passes, on the verifier alone: sessions of a workload's
prompts decode `--max-tokens` greedy tokens in calls of `--plain-steps`, with lookup off and on in turn; prints the
model thread's time per token and tokens per pass of each, and checks that both decode the same tokens.

    PYTHONPATH=. .venv/bin/python scripts/lookup_ab.py --workload mixed --sessions 1,4 --lookup 4 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

from specfleet import config as config_mod
from specfleet.sampling import SamplingParams
from tools.bench import workload
from verifier_service.server import load_core
from verifier_service.verifier import VerifyItem


def decode(verifier, prompts: list[list[int]], max_tokens: int, plain_steps: int, lookup: int, tag: str):
    """Every prompt decoded together to max_tokens; (tokens per session, seconds on the model thread, passes)."""
    out = {f"{tag}{i}": [] for i in range(len(prompts))}
    held = {sid: 0 for sid in out}
    seconds, passes, first = 0.0, 0, True
    while any(len(t) < max_tokens for t in out.values()):
        items = []
        for i, sid in enumerate(out):
            left = max_tokens - len(out[sid])
            if left <= 0:
                continue
            context = prompts[i] + out[sid]
            new = context[held[sid] :]
            items.append(VerifyItem(sid, held[sid], new, SamplingParams(), plain_steps=1 if first else min(plain_steps, left), lookup_tokens=lookup))
        started = time.perf_counter()
        results = verifier.verify_batch(items)
        seconds += time.perf_counter() - started
        passes += max(r.steps for r in results)
        for item, r in zip(items, results):
            held[item.session_id] = item.prefix_length + len(item.new_token_ids)
            out[item.session_id].extend(r.token_ids)
        first = False
    verifier.store.release(list(out), keep_tokens=False)
    return [t[:max_tokens] for t in out.values()], seconds, passes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="mixed")
    parser.add_argument("--sessions", default="1,4")
    parser.add_argument("--lookup", type=int, default=4)
    parser.add_argument("--plain-steps", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    cfg = config_mod.default_config(config_mod.REPO / ".cache")
    core = load_core(cfg.verifier, threads=1)
    verifier = core.verifier
    from specfleet.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(cfg.verifier.model)
    rows = workload.read_jsonl(workload.WORKLOAD_DIR / f"{args.workload}.jsonl")
    requests = workload.make_requests(rows, args.requests, 64, args.max_tokens, 0)
    prompts = [tokenizer.encode(r.text, add_special_tokens=False)[:64] for r in requests]
    for sessions in [int(s) for s in args.sessions.split(",")]:
        ratios, per_pass = [], []
        for rnd in range(args.rounds):
            times = {}
            for lookup in [0, args.lookup] if rnd % 2 == 0 else [args.lookup, 0]:
                total, tokens_out, passes_all = 0.0, [], 0
                for start in range(0, len(prompts), sessions):
                    group = prompts[start : start + sessions]
                    tokens, seconds, passes = decode(verifier, group, args.max_tokens, args.plain_steps, lookup, f"l{lookup}r{rnd}s{start}-")
                    total += seconds
                    tokens_out += tokens
                    passes_all += passes
                times[lookup] = (total, tokens_out, passes_all)
            assert times[0][1] == times[args.lookup][1], "lookup changed the tokens"
            ratios.append(times[0][0] / times[args.lookup][0])
            n = sum(len(t) for t in times[0][1])
            per_pass.append(n / times[args.lookup][2] / sessions)
            plain_ms, lookup_ms = times[0][0] / n * 1e3, times[args.lookup][0] / n * 1e3
            print(f"{sessions} sessions, round {rnd}: plain {plain_ms:.3f} ms/token, lookup {lookup_ms:.3f} ms/token")
        spread = ", ".join(f"{r:.2f}" for r in ratios)
        print(
            f"{sessions} sessions: lookup {args.lookup} over plain {statistics.median(ratios):.2f}x (rounds {spread}); "
            f"tokens a pass a session {statistics.median(per_pass):.2f}"
        )


if __name__ == "__main__":
    main()
