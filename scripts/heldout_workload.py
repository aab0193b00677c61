"""Build `tools/bench/workloads/heldout.jsonl`: a mixed workload from sources no build reads.

Issue 27's bars are measured on prompts no demo model was trained, tuned or
checked on: eight domains, each from Debian packages that neither the demo
corpora (tools/demo_models/corpus.py: train, held-out and unseen splits) nor
the committed workloads use. Two of the domains are not a drafter's speciality
(English technical documentation and English narrative prose), so routing
meets text its labels do not name.

    domain       sources
    docs         debian-faq, maint-guide, developers-reference (HTML)
    prose        debian-history (its English HTML pages)
    de           debian-faq-de, maint-guide-de, developers-reference-de
    fr           debian-faq-fr, maint-guide-fr, developers-reference-fr
    es           maint-guide-es
    it           debian-faq-it, maint-guide-it, developers-reference-it
    code         python3-click, python3-markdown, python3-mako, python3-babel (*.py)
    structured   ansible-lint, python3-jsonschema, netplan.io, yamllint (*.json, *.yaml, *.yml)

Needs `apt-get download` (a Debian package mirror); the committed file is what
benchmarks read.

    .venv/bin/python scripts/heldout_workload.py [--per-domain 8] [--chars 1200] [--seed 27]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SOURCES: dict[str, tuple[str, list[str], tuple[str, ...]]] = {
    # domain: (kind, packages, file patterns)
    "docs": ("html", ["debian-faq", "maint-guide", "developers-reference"], ("*.html", "*.html.gz")),
    # debian-history ships the history in ten languages: its English pages only
    "prose": ("html", ["debian-history"], ("*.en.html", "*.en.html.gz")),
    "de": ("html", ["debian-faq-de", "maint-guide-de", "developers-reference-de"], ("*.html", "*.html.gz")),
    "fr": ("html", ["debian-faq-fr", "maint-guide-fr", "developers-reference-fr"], ("*.html", "*.html.gz")),
    "es": ("html", ["maint-guide-es"], ("*.html", "*.html.gz")),
    "it": ("html", ["debian-faq-it", "maint-guide-it", "developers-reference-it"], ("*.html", "*.html.gz")),
    "code": ("files", ["python3-click", "python3-markdown", "python3-mako", "python3-babel"], ("*.py",)),
    "structured": ("files", ["ansible-lint", "python3-jsonschema", "netplan.io", "yamllint"], ("*.json", "*.yaml", "*.yml")),
}
OUT = Path(__file__).resolve().parents[1] / "tools/bench/workloads/heldout.jsonl"


def domain_texts(pkgs: Path, kind: str, packages: list[str], patterns: tuple[str, ...]) -> list[str]:
    from tools.demo_models.corpus import _file_docs, _files, _html_docs

    texts = []
    for name in packages:
        root = pkgs / name
        if kind == "html":
            docs = _html_docs(root, patterns)
        else:
            docs = _file_docs(root, _files(root, patterns, lambda p: "__pycache__" in p.parts))
        texts.extend(text for _, text in docs)
    return texts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=".cache/heldout", help="where the packages are downloaded and unpacked")
    ap.add_argument("--per-domain", type=int, default=8)
    ap.add_argument("--chars", type=int, default=1200, help="characters per prompt window")
    ap.add_argument("--seed", type=int, default=27)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()

    from tools.bench.workload import _windows
    from tools.demo_models.corpus import fetch_debs

    pkgs = fetch_debs(Path(args.work), [p for _, packages, _ in SOURCES.values() for p in packages], log=print)
    rows = []
    for domain, (kind, packages, patterns) in SOURCES.items():
        texts = domain_texts(pkgs, kind, packages, patterns)
        windows = _windows(texts, args.per_domain, args.chars, random.Random(f"{args.seed}:{domain}"))
        if len(windows) < args.per_domain:
            raise SystemExit(f"{domain}: {len(windows)} windows from {packages}, wanted {args.per_domain}")
        rows.extend({"id": f"heldout-{domain}-{i:02d}", "domain": domain, "text": w} for i, w in enumerate(windows))
    random.Random(args.seed).shuffle(rows)
    with open(args.out, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"{len(rows)} prompts, {args.per_domain} a domain, written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
