"""A chat-like workload whose requests share one system prompt: tools/bench/workloads/shared-prefix.jsonl.

    PYTHONPATH=. .venv/bin/python scripts/shared_prefix_workload.py [--system-tokens 380] [--requests 32]

The system prompt is the first held-out English windows (tools/bench/workloads/en.jsonl) up to
--system-tokens tokens of the demo tokenizer; each request adds a question of its own (the first 40
tokens of a window of tools/bench/workloads/mixed.jsonl). Sized for the demo target's 512 positions with 64 new tokens.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from specfleet.tokenizer import load_tokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORKLOADS = ROOT / "tools" / "bench" / "workloads"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system-tokens", type=int, default=380)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--out", default=str(WORKLOADS / "shared-prefix.jsonl"))
    args = ap.parse_args()
    tokenizer = load_tokenizer(ROOT / "models" / "demo" / "tokenizer")
    rows = [json.loads(line) for line in (WORKLOADS / "en.jsonl").read_text().splitlines() if line.strip()]
    system_ids: list[int] = []
    used = 0
    while len(system_ids) < args.system_tokens:
        system_ids += tokenizer.encode(rows[used]["text"] + "\n", add_special_tokens=False)
        used += 1
    system = tokenizer.decode(system_ids[: args.system_tokens])
    with open(args.out, "w", encoding="utf-8") as out:
        questions = [json.loads(line) for line in (WORKLOADS / "mixed.jsonl").read_text().splitlines() if line.strip()]
        for i, row in enumerate(questions[: args.requests]):
            question = tokenizer.decode(tokenizer.encode(row["text"], add_special_tokens=False)[:40])
            line = {"id": f"shared-{i:02d}", "domain": "en", "text": f"{system}\n\nQuestion: {question}", "prompt_tokens": 0}
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}: {args.requests} requests sharing a {args.system_tokens}-token system prompt")


if __name__ == "__main__":
    main()
