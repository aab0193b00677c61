"""Workloads: which prompts, how long, and when they arrive.

A workload file is JSON Lines, one request a line:

    {"id": "code-003", "domain": "code", "text": "...", "max_tokens": 128, "prompt_tokens": 64, "arrival_s": 0.41}

Only `text` is required; `domain` defaults to "mixed", `max_tokens` and
`prompt_tokens` to the command line's values, and `arrival_s` (seconds after
the start of the load point) is used only by `--rates file` (replay of a
recorded open-loop schedule). The committed prompt files in
`tools/bench/workloads/` (one per domain, plus `mixed`) are windows of
the demo corpora's held-out split; `specfleet bench workload build`
regenerates them. `heldout` is eight domains from sources no build reads
(scripts/heldout_workload.py). `--save-workload FILE` writes the exact requests of a run
(after lengths, seeds and arrivals are resolved) so that it can be replayed
with `--workload FILE`.

Prompts are sent to every system as token ids (the first `prompt_tokens`
tokens of the text under the target's tokenizer), so every system sees the
very same input.
"""

from __future__ import annotations

import json
import pathlib
import random
from dataclasses import asdict, dataclass, field

WORKLOAD_DIR = pathlib.Path(__file__).resolve().parent / "workloads"
# the demo family's domains (tools.demo_models.corpus.DOMAINS)
DOMAINS = ("en", "de", "fr", "es", "it", "code", "structured")
# heldout: eight domains from sources no build reads (scripts/heldout_workload.py), issue 27's bars
BUILTIN_NAMES = (*DOMAINS, "mixed", "heldout")

# Used when neither the committed files nor the demo corpora are there (e.g. a stripped install).
FALLBACK_PROMPTS = [
    ("en", "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks"),
    ("en", "NAME\n       ls - list directory contents\n\nSYNOPSIS\n       ls [OPTION]... [FILE]...\n"),
    ("de", "Die Paketverwaltung von Debian installiert Programme mit allen Abhängigkeiten. Mit apt können Sie"),
    ("de", "BESCHREIBUNG\n       Dieses Programm zeigt den Inhalt eines Verzeichnisses an.\n"),
    ("fr", "Le système de gestion des paquets de Debian installe les programmes avec leurs dépendances. Avec apt,"),
    ("fr", "DESCRIPTION\n       Cette commande affiche le contenu d'un répertoire.\n"),
    ("es", "El sistema de paquetes de Debian instala los programas con todas sus dependencias. Con apt puede"),
    ("es", "DESCRIPCIÓN\n       Esta orden muestra el contenido de un directorio.\n"),
    ("it", "Il sistema di gestione dei pacchetti di Debian installa i programmi con tutte le dipendenze. Con apt"),
    ("it", "DESCRIZIONE\n       Questo comando mostra il contenuto di una directory.\n"),
    ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'),
    ("code", "class Cache:\n    def __init__(self, size):\n        self.size = size\n        self.items = {}\n"),
    ("structured", "name: specfleet\nversion: 1\nitems:\n  - drafter\n  - verifier\n"),
    ("structured", '{\n  "name": "specfleet",\n  "version": "0.1.0",\n  "dependencies": {\n'),
]


@dataclass
class Request:
    id: str
    domain: str
    text: str
    max_tokens: int
    prompt_tokens: int
    arrival_s: float | None = None
    # Filled in at run time from the target's tokenizer.
    prompt_ids: list[int] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("prompt_ids")
        if d["arrival_s"] is None:
            d.pop("arrival_s")
        return d


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            if "text" not in row:
                raise ValueError(f"{path}:{i + 1}: a workload line needs a 'text' field")
            rows.append(row)
    return rows


def resolve_source(name_or_path: str) -> tuple[str, list[dict]]:
    """A workload by name (en, de, fr, es, it, code, structured, mixed) or by file; the fallback list when absent."""
    path = pathlib.Path(name_or_path)
    # Only a file is a workload: a folder in the working directory may bear a workload's name.
    if path.suffix in (".jsonl", ".json") or path.is_file():
        return str(path), read_jsonl(path)
    if name_or_path not in BUILTIN_NAMES:
        raise ValueError(f"workload {name_or_path!r}: neither a file nor one of {', '.join(BUILTIN_NAMES)}")
    committed = WORKLOAD_DIR / f"{name_or_path}.jsonl"
    if committed.exists():
        return f"tools/bench/workloads/{committed.name}", read_jsonl(committed)
    rows = [
        {"id": f"builtin-{i:02d}", "domain": d, "text": t}
        for i, (d, t) in enumerate(FALLBACK_PROMPTS)
        if name_or_path in ("mixed", "heldout") or d == name_or_path
    ]
    return "built-in fallback prompts", rows


def make_requests(rows: list[dict], n: int, prompt_tokens: int, max_tokens: int, seed: int) -> list[Request]:
    """n requests from the rows, in a seeded order (cycling when n exceeds the rows)."""
    if not rows:
        raise ValueError("the workload has no prompts")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    out = []
    for i in range(n):
        row = rows[order[i % len(order)]]
        out.append(
            Request(
                id=f"{str(row.get('id', f'p{order[i % len(order)]}')).split('#')[0]}#{i}",
                domain=row.get("domain", "mixed"),
                text=row["text"],
                max_tokens=int(row.get("max_tokens", max_tokens)),
                prompt_tokens=int(row.get("prompt_tokens", prompt_tokens)),
                arrival_s=row.get("arrival_s"),
            )
        )
    return out


def tokenize(requests: list[Request], tokenizer) -> None:
    cache: dict[tuple[str, int], list[int]] = {}
    for r in requests:
        key = (r.text, r.prompt_tokens)
        if key not in cache:
            ids = tokenizer.encode(r.text, add_special_tokens=False)
            cache[key] = ids[: r.prompt_tokens] if r.prompt_tokens > 0 else ids
        r.prompt_ids = list(cache[key])
        if not r.prompt_ids:
            raise ValueError(f"request {r.id}: the prompt encodes to no tokens")


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (seconds) of an open-loop Poisson process at `rate` requests/s."""
    rng = random.Random(seed * 1_000_003 + int(rate * 1000))
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(round(t, 6))
    return out


def save(requests: list[Request], path: str | pathlib.Path) -> None:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), ensure_ascii=False) + "\n")


# --- building the committed prompt files from the demo corpora ---------------------------------------------


def _windows(texts: list[str], n: int, chars: int, rng: random.Random) -> list[str]:
    """n windows of about `chars` characters, each starting at a line start of a held-out document."""
    candidates = []
    for ti, t in enumerate(texts):
        starts = [0] + [i + 1 for i, c in enumerate(t) if c == "\n" and i + 1 < len(t) - chars // 2]
        candidates.extend((ti, s) for s in starts)
    rng.shuffle(candidates)
    out, used = [], set()
    for ti, s in candidates:
        window = texts[ti][s : s + chars]
        if len(window.strip()) < chars // 3 or (ti, s // chars) in used:
            continue
        used.add((ti, s // chars))
        out.append(window)
        if len(out) == n:
            break
    return out


def build_workload_files(corpus: pathlib.Path, out: pathlib.Path, per_domain: int, chars: int, seed: int) -> dict[str, int]:
    from tools.demo_models.corpus import load_split

    out.mkdir(parents=True, exist_ok=True)
    mixed, counts = [], {}
    for domain in DOMAINS:
        texts = load_split(corpus, domain, "heldout")
        windows = _windows(texts, per_domain, chars, random.Random(f"{seed}:{domain}"))
        rows = [{"id": f"{domain}-{i:03d}", "domain": domain, "text": w} for i, w in enumerate(windows)]
        with open(out / f"{domain}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        counts[domain] = len(rows)
        mixed.extend(rows[: max(1, per_domain // 2)])
    random.Random(seed).shuffle(mixed)
    with open(out / "mixed.jsonl", "w", encoding="utf-8") as f:
        for row in mixed:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    counts["mixed"] = len(mixed)
    return counts
