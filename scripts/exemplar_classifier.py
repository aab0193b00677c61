"""How well and how fast the exemplar classifier places the bench's prompts (router/routing.py `DomainClassifier`).

An experiment, not part of the serving path. For each workload: how many prompts the bundled demo exemplars place
for sure at each margin (`router.exemplar_margin`) and how many of those are the labelled domain, how often the
best guess is, and the classifier's time a prompt on this machine's one thread. Prompts are cut to their first 64
tokens, as `specfleet bench` sends them. Results and the command are in docs/benchmarks/exemplar-margin.md.

    taskset -c 1 .venv/bin/python scripts/exemplar_classifier.py mixed heldout
"""

from __future__ import annotations

import argparse
import json
import time

from router.domains import best_label, sure_label
from router.server import build_drafter_router
from specfleet.config import DEMO_MODELS, REPO, default_config
from specfleet.tokenizer import load_tokenizer
from tools.bench.workload import WORKLOAD_DIR

PROMPT_TOKENS = 64
MARGINS = (0.015, 0.02, 0.025)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="+", help="names under tools/bench/workloads/ (mixed, heldout, ...)")
    parser.add_argument("--repeat", type=int, default=20, help="times each prompt is classified for its time")
    args = parser.parse_args()
    cfg = default_config(REPO / ".cache")
    classifier = build_drafter_router(cfg, [m.name for svc in cfg.drafters for m in svc.models]).classifier
    tokenizer = load_tokenizer(DEMO_MODELS / "target")
    print("| workload | prompts | " + " | ".join(f"margin {m}: placed, right" for m in MARGINS) + " | best guess right | ms a prompt |")
    print("|---|---|" + "---|" * len(MARGINS) + "---|---|")
    for name in args.workloads:
        rows = [json.loads(line) for line in (WORKLOAD_DIR / f"{name}.jsonl").read_text().splitlines() if line.strip()]
        texts = [tokenizer.decode(tokenizer.encode(row["text"])[:PROMPT_TOKENS]) for row in rows]
        scores = [classifier.scores(text) for text in texts]
        cells = []
        for margin in MARGINS:
            placed = [(sure_label(s, margin), row["domain"]) for s, row in zip(scores, rows)]
            cells.append(f"{sum(1 for p, _ in placed if p)}, {sum(1 for p, d in placed if p == d)}")
        right = sum(best_label(s) == row["domain"] for s, row in zip(scores, rows))
        started = time.perf_counter()
        for _ in range(args.repeat):
            for text in texts:
                classifier.scores(text)
        ms = (time.perf_counter() - started) * 1e3 / (args.repeat * len(texts))
        print(f"| {name} | {len(rows)} | " + " | ".join(cells) + f" | {right} | {ms:.3f} |")


if __name__ == "__main__":
    main()
