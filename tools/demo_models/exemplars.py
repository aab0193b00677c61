"""Routing exemplars for the demo drafters: a few typical training texts per domain.

The router's prompt classifier compares a prompt with each drafter's
exemplars (`exemplars.jsonl` in the drafter's directory, one {"text": ...}
a line). They come from the training split, never the held-out ones, so
benchmarks on held-out prompts do not flatter the classifier.
"""

from __future__ import annotations

import json
from pathlib import Path

from .corpus import DOMAINS, load_split

PER_DOMAIN = 48
CHARS = 400


def write_exemplars(corpus: Path, drafters_dir: Path, per_domain: int = PER_DOMAIN) -> dict[str, int]:
    written = {}
    for domain in DOMAINS:
        target = drafters_dir / domain
        if not target.is_dir():
            continue
        docs = [d for d in load_split(corpus, domain, "train") if d.strip()]
        step = max(1, len(docs) // per_domain)
        texts = [doc[:CHARS] for doc in docs[::step][:per_domain]]
        with open(target / "exemplars.jsonl", "w") as f:
            for text in texts:
                f.write(json.dumps({"text": text}) + "\n")
        written[domain] = len(texts)
    return written


if __name__ == "__main__":
    import sys

    corpus_dir, drafters = (Path(a) for a in sys.argv[1:3])
    print(write_exemplars(corpus_dir, drafters))
