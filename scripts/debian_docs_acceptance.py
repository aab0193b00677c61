"""Greedy acceptance of each demo drafter on Debian documentation the build never reads.

The demo build trains on Debian manpages, the Debian Reference, fortunes and the aptitude
manual; it never reads the Debian FAQ, the New Maintainers' Guide or the Developer's
Reference (``tools.demo_models.corpus``). This script downloads those (``apt-get
download``, into ``--work``), takes ``--prompts`` windows of each language's text and
measures, as ``specfleet models matrix`` does, how often each drafter's greedy token
equals the target's along the target's own greedy continuation. It is an evaluation
only: nothing it reads goes into training.

    .venv/bin/python scripts/debian_docs_acceptance.py --models models/demo
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PACKAGES = {
    "en": ["debian-faq", "maint-guide", "developers-reference"],
    "de": ["debian-faq-de", "maint-guide-de", "developers-reference-de"],
    "fr": ["debian-faq-fr", "maint-guide-fr", "developers-reference-fr"],
    "es": ["maint-guide-es"],
    "it": ["debian-faq-it", "maint-guide-it", "developers-reference-it"],
}


def language_texts(pkgs: Path, packages: list[str]) -> list[str]:
    from tools.demo_models.corpus import _html_docs

    texts = []
    for name in packages:
        texts.extend(text for _, text in _html_docs(pkgs / name, ("*.html", "*.html.gz")))
    return texts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="models/demo")
    ap.add_argument("--work", default=".cache/debian_docs")
    ap.add_argument("--prompts", type=int, default=192, help="windows per language (48 cannot tell a margin of 0.05 from 0.015)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--output", default=None, help="JSON file for the results")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from tools.demo_models.acceptance import DRAFTERS, _cont_logits, _greedy_continue, _load, _prompts, _token_map, drafter_logits
    from tools.demo_models.corpus import fetch_debs

    torch.set_num_threads(1)
    models = Path(args.models)
    pkgs = fetch_debs(Path(args.work), [p for ps in PACKAGES.values() for p in ps], log=print)
    tok = AutoTokenizer.from_pretrained(str(models / "tokenizer"))
    target = _load(models / "target", torch.float32)
    drafters = {n: _load(models / "drafters" / n, torch.float32) for n in DRAFTERS if (models / "drafters" / n).exists()}
    maps = {n: _token_map(n, models / "drafters" / n, m.config.vocab_size) for n, m in drafters.items()}
    result = {}
    for i, (lang, packages) in enumerate(PACKAGES.items()):
        texts = language_texts(pkgs, packages)
        prompts, _ = _prompts(tok, texts, args.prompts, args.prompt_len, seed=2000 + i)
        seq = _greedy_continue(target, torch.from_numpy(prompts), args.new_tokens)
        p_arg = _cont_logits(target, seq, args.prompt_len).argmax(-1)
        row = {}
        for n, m in drafters.items():
            q = drafter_logits(m, maps[n], seq, args.prompt_len)
            row[n] = round(float((q.argmax(-1) == p_arg).float().mean()), 3)
        result[lang] = {"chars": sum(map(len, texts)), "packages": packages, "greedy": row}
        own = row.get(lang)
        print(
            f"{lang} ({sum(map(len, texts)):,} chars): own {own} general {row.get('general')} "
            f"margin {own - row['general']:+.3f}  " + " ".join(f"{n} {v}" for n, v in row.items()),
            flush=True,
        )
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
