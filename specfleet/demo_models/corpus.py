"""Assemble the four demo-model corpora (code, prose, docs, structured).

Everything comes from sources a fresh Debian/Ubuntu machine can get through its
package managers:

* code:        Python source of several code bases: the standard library's own source
               (``sysconfig`` stdlib path) plus the modules of ``python3-setuptools``,
               ``python3-docutils`` and ``python3-pygments``;
* prose:       ``fortunes``, ``dict-gcide``, ``jargon-text`` and ``bible-kjv-text``
               (the KJV text is stored compressed; it is decoded with the ``bible``
               binary from ``bible-kjv``, unpacked next to it, never installed);
* docs:        ``python3.11-doc`` (reST sources), ``manpages`` (roff), ``perl-doc``
               (POD), ``vim-runtime`` (vim help files);
* structured:  YAML / JSON / INI / TOML / CFG files of ``ansible`` (playbooks, roles,
               changelogs, JSON fixtures), ``rubocop`` (YAML configuration),
               ``cloud-init`` (YAML configs, JSON schemas) and ``pandoc-data`` (YAML
               translations).

Debian packages are fetched with ``apt-get download`` and unpacked with
``dpkg-deb -x`` into the work dir (``<work>/debs``, ``<work>/pkgs``).

Each domain gets a deterministic train / held-out split (by source file, or by
block of chunks for single-file sources) plus an *unseen* set from a source the
training never uses:

* code:       Python modules of ``python3-jinja2``, ``python3-requests`` and
              ``python3-urllib3`` (code bases that no training split of any domain
              uses; ``ansible``'s own Python is used nowhere, since its YAML/JSON
              files are the structured training set);
* prose:      ``fortune-anarchism``;
* docs:       ``manpages-dev`` (sections 2 and 3, never trained on);
* structured: YAML / JSON / INI files of ``ansible-core``.

``--quick`` mode uses only the local Python stdlib tree (no network):
code = ``*.py`` (minus ``email/``, which is the unseen set), prose = the stdlib's
``*.txt`` / LICENSE files, docs = ``pydoc_data.topics``, structured = the
``*.json`` / ``*.toml`` / ``*.xml`` / ``*.cfg`` test data.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

DOMAINS = ("code", "prose", "docs", "structured")
SPLITS = ("train", "heldout", "unseen")

DEB_PACKAGES = [
    "fortunes",
    "dict-gcide",
    "jargon-text",
    "bible-kjv-text",
    "bible-kjv",
    "python3.11-doc",
    "manpages",
    "perl-doc",
    "vim-runtime",
    "ansible",
    "python3-setuptools",
    "python3-docutils",
    "python3-pygments",
    "rubocop",
    "cloud-init",
    "pandoc-data",
    # unseen sources
    "python3-jinja2",
    "python3-requests",
    "python3-urllib3",
    "fortune-anarchism",
    "manpages-dev",
    "ansible-core",
]

CHUNK_CHARS = 4000
MAX_FILE_CHARS = 60_000


@dataclass
class Limits:
    train_chars: int  # per domain
    heldout_chars: int
    unseen_chars: int


FULL_LIMITS = Limits(train_chars=3_000_000, heldout_chars=250_000, unseen_chars=250_000)
QUICK_LIMITS = Limits(train_chars=120_000, heldout_chars=20_000, unseen_chars=20_000)


# --------------------------------------------------------------------------- helpers


def _h(s: str) -> int:
    return int(hashlib.sha1(s.encode("utf-8", "surrogatepass")).hexdigest()[:8], 16)


def _read_text(path: Path) -> str | None:
    try:
        raw = path.read_bytes()
        if path.suffix == ".gz" or path.suffix == ".dz":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile):
        return None
    if b"\x00" in raw[:4096]:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def _chunks(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
    """Split ``text`` at line boundaries into pieces of about ``size`` characters."""
    start = 0
    n = len(text)
    while start < n:
        end = min(n, start + size)
        if end < n:
            nl = text.rfind("\n", start + size // 2, end)
            if nl != -1:
                end = nl + 1
        piece = text[start:end]
        if piece.strip():
            yield piece
        start = end


# A "source" yields (doc_id, text) pairs; big single files are split into blocks.
Doc = tuple[str, str]


def _files(root: Path, patterns: Iterable[str], exclude: Callable[[Path], bool] | None = None) -> list[Path]:
    out: list[Path] = []
    if not root.exists():
        return out
    for pat in patterns:
        out.extend(p for p in root.rglob(pat) if p.is_file() and not p.is_symlink())
    if exclude:
        out = [p for p in out if not exclude(p)]
    return sorted(set(out))


def _file_docs(root: Path, paths: list[Path], transform: Callable[[str], str] | None = None) -> Iterator[Doc]:
    for p in paths:
        t = _read_text(p)
        if not t:
            continue
        if transform:
            t = transform(t)
        t = t[:MAX_FILE_CHARS]
        if t.strip():
            yield str(p.relative_to(root)), t


def _big_text_docs(name: str, text: str, block: int = 8) -> Iterator[Doc]:
    """Split a single large text into blocks of ``block`` chunks, each its own doc id."""
    chunks = list(_chunks(text))
    for i in range(0, len(chunks), block):
        yield f"{name}#{i // block}", "".join(chunks[i : i + block])


# --------------------------------------------------------------------------- apt


def fetch_debs(work: Path, packages: list[str], log: Callable[[str], None] = print) -> Path:
    """``apt-get download`` + ``dpkg-deb -x`` each package into ``work/pkgs/<name>``."""
    debs = work / "debs"
    pkgs = work / "pkgs"
    debs.mkdir(parents=True, exist_ok=True)
    pkgs.mkdir(parents=True, exist_ok=True)
    updated = False
    for name in packages:
        dest = pkgs / name
        if (dest / ".unpacked").exists():
            continue
        have = sorted(debs.glob(f"{name}_*.deb"))
        if not have:
            for attempt in range(2):
                r = subprocess.run(["apt-get", "download", name], cwd=debs, capture_output=True, text=True)
                have = sorted(debs.glob(f"{name}_*.deb"))
                if have:
                    break
                if not updated:
                    log(f"apt-get download {name} failed ({r.stderr.strip()[-200:]}); running apt-get update")
                    subprocess.run(["apt-get", "update"], capture_output=True, text=True)
                    updated = True
            if not have:
                log(f"WARNING: could not download {name}; skipping it")
                continue
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir()
        subprocess.run(["dpkg-deb", "-x", str(have[-1]), str(dest)], check=True)
        (dest / ".unpacked").touch()
    return pkgs


# --------------------------------------------------------------------------- sources


def _fortune_docs(root: Path) -> Iterator[Doc]:
    fdir = root / "usr/share/games/fortunes"
    for p in sorted(fdir.glob("*")) if fdir.exists() else []:
        if p.is_dir() or p.suffix in (".dat", ".u8") or p.is_symlink():
            continue
        t = _read_text(p)
        if not t:
            continue
        # one doc per block of fortunes, "%" separators kept (that is the file format)
        yield from _big_text_docs(f"{root.name}/{p.name}", t, block=2)


def _gcide_docs(root: Path) -> Iterator[Doc]:
    p = root / "usr/share/dictd/gcide.dict.dz"
    t = _read_text(p) if p.exists() else None
    if t:
        # skip the database-info header
        k = t.find("\nA\n")
        yield from _big_text_docs("gcide", t[k + 1 if k > 0 else 0 :], block=4)


def _jargon_docs(root: Path) -> Iterator[Doc]:
    p = root / "usr/share/doc/jargon-text/jargon.txt.gz"
    t = _read_text(p) if p.exists() else None
    if t:
        yield from _big_text_docs("jargon", t, block=4)


def _bible_docs(pkgs: Path) -> Iterator[Doc]:
    binp = pkgs / "bible-kjv/usr/bin/bible"
    data = pkgs / "bible-kjv-text/usr/lib/bible.data"
    if not (binp.exists() and data.exists()):
        return
    try:
        r = subprocess.run(
            [str(binp), "-d", str(data), "Gen1:1-Rev22:21"], capture_output=True, text=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError):
        return
    if r.returncode == 0 and len(r.stdout) > 100_000:
        yield from _big_text_docs("kjv", r.stdout.lstrip("\n"), block=4)


STRUCT_PATTERNS = ("*.yml", "*.yaml", "*.json", "*.ini", "*.toml", "*.cfg")


def full_sources(pkgs: Path) -> dict[str, dict[str, list[Callable[[], Iterator[Doc]]]]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    P = lambda n: pkgs / n  # noqa: E731

    def code_train():
        paths = _files(stdlib, ["*.py"], lambda p: "site-packages" in p.parts or "__pycache__" in p.parts)
        return _file_docs(stdlib, paths)

    def py_pkg(name: str):
        def docs():
            root = P(name)
            return _file_docs(root, _files(root, ["*.py"], lambda p: "__pycache__" in p.parts))

        return docs

    def code_unseen():
        for name in ("python3-jinja2", "python3-requests", "python3-urllib3"):
            yield from py_pkg(name)()

    def docs_py():
        root = P("python3.11-doc") / "usr/share/doc/python3.11/html/_sources"
        return _file_docs(root, _files(root, ["*.txt"]))

    def docs_man():
        root = P("manpages") / "usr/share/man"
        return _file_docs(root, _files(root, ["*.gz"]))

    def docs_perl():
        root = P("perl-doc")
        return _file_docs(root, _files(root, ["*.pod"]))

    def docs_vim():
        root = P("vim-runtime") / "usr/share/vim/vim90/doc"
        return _file_docs(root, _files(root, ["*.txt", "*.txt.gz"]))

    def docs_unseen():
        root = P("manpages-dev") / "usr/share/man"
        return _file_docs(root, _files(root, ["*.gz"]))

    def struct_pkg(name: str):
        def docs():
            root = P(name)
            return _file_docs(root, _files(root, STRUCT_PATTERNS))

        return docs

    def struct_unseen():
        root = P("ansible-core")
        return _file_docs(root, _files(root, STRUCT_PATTERNS))

    return {
        "code": {
            "train": [code_train, py_pkg("python3-setuptools"), py_pkg("python3-docutils"), py_pkg("python3-pygments")],
            "unseen": [code_unseen],
        },
        "prose": {
            "train": [
                lambda: _fortune_docs(P("fortunes")),
                lambda: _gcide_docs(P("dict-gcide")),
                lambda: _jargon_docs(P("jargon-text")),
                lambda: _bible_docs(pkgs),
            ],
            "unseen": [lambda: _fortune_docs(P("fortune-anarchism"))],
        },
        "docs": {"train": [docs_py, docs_man, docs_perl, docs_vim], "unseen": [docs_unseen]},
        "structured": {
            "train": [struct_pkg(n) for n in ("ansible", "rubocop", "cloud-init", "pandoc-data")],
            "unseen": [struct_unseen],
        },
    }


def quick_sources() -> dict[str, dict[str, list[Callable[[], Iterator[Doc]]]]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = lambda p: "site-packages" in p.parts or "__pycache__" in p.parts  # noqa: E731

    def code_train():
        return _file_docs(stdlib, _files(stdlib, ["*.py"], lambda p: skip(p) or "email" in p.parts or "test" in p.parts))

    def code_unseen():
        return _file_docs(stdlib, _files(stdlib / "email", ["*.py"], skip))

    def prose_train():
        paths = _files(stdlib, ["*.txt", "LICENSE*"], skip)
        return _file_docs(stdlib, [p for p in paths if p.stat().st_size > 500])

    def docs_train():
        try:
            from pydoc_data.topics import topics  # type: ignore
        except ImportError:  # pragma: no cover
            topics = {}
        for k in sorted(topics):
            yield f"pydoc:{k}", topics[k]

    def struct_train():
        return _file_docs(stdlib, _files(stdlib, ["*.json", "*.toml", "*.xml", "*.cfg", "*.ini"], skip))

    return {
        "code": {"train": [code_train], "unseen": [code_unseen]},
        "prose": {"train": [prose_train], "unseen": []},
        "docs": {"train": [docs_train], "unseen": []},
        "structured": {"train": [struct_train], "unseen": []},
    }


# --------------------------------------------------------------------------- build


def _is_heldout(doc_id: str) -> bool:
    return _h("heldout:" + doc_id) % 20 == 0  # 5% of docs / blocks


def _take(docs: list[Doc], budget: int) -> list[Doc]:
    out, n = [], 0
    for d in docs:
        if n >= budget:
            break
        out.append(d)
        n += len(d[1])
    return out


def _interleave_sources(per_source: list[list[Doc]], budget: int) -> list[Doc]:
    """Take about budget / n_sources characters from each source (redistributing leftovers)."""
    per_source = [s for s in per_source if s]
    if not per_source:
        return []
    out: list[Doc] = []
    remaining = budget
    srcs = sorted(per_source, key=lambda s: sum(len(t) for _, t in s))
    for i, s in enumerate(srcs):
        share = remaining // (len(srcs) - i)
        got = _take(s, share)
        out.extend(got)
        remaining -= sum(len(t) for _, t in got)
    return out


def build_corpora(work: Path, quick: bool, log: Callable[[str], None] = print) -> Path:
    """Write ``work/corpus/<domain>/<split>.jsonl`` (one {"id", "text"} per line). Resumable."""
    out = work / "corpus"
    done = out / ".done"
    if done.exists():
        return out
    limits = QUICK_LIMITS if quick else FULL_LIMITS
    if quick:
        sources = quick_sources()
    else:
        pkgs = fetch_debs(work, DEB_PACKAGES, log)
        sources = full_sources(pkgs)
    stats = {}
    for domain in DOMAINS:
        train_src: list[list[Doc]] = []
        held_src: list[list[Doc]] = []
        for fn in sources[domain]["train"]:
            docs = list(fn())
            random.Random(_h(domain)).shuffle(docs)
            train_src.append([d for d in docs if not _is_heldout(d[0])])
            held_src.append([d for d in docs if _is_heldout(d[0])])
        unseen: list[list[Doc]] = []
        for fn in sources[domain]["unseen"]:
            docs = list(fn())
            random.Random(_h(domain + "u")).shuffle(docs)
            unseen.append(docs)
        splits = {
            "train": _interleave_sources(train_src, limits.train_chars),
            "heldout": _interleave_sources(held_src, limits.heldout_chars),
            "unseen": _interleave_sources(unseen, limits.unseen_chars),
        }
        if not splits["unseen"]:
            # quick mode has no separate source for some domains: reuse the held-out split
            splits["unseen"] = splits["heldout"]
        d = out / domain
        d.mkdir(parents=True, exist_ok=True)
        stats[domain] = {}
        for split, docs in splits.items():
            with open(d / f"{split}.jsonl", "w", encoding="utf-8") as f:
                for doc_id, text in docs:
                    f.write(json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n")
            stats[domain][split] = {"docs": len(docs), "chars": sum(len(t) for _, t in docs)}
        log(f"corpus {domain}: " + ", ".join(f"{s} {v['docs']} docs / {v['chars']:,} chars" for s, v in stats[domain].items()))
    (out / "stats.json").write_text(json.dumps(stats, indent=1))
    done.touch()
    return out


def load_split(corpus: Path, domain: str, split: str) -> list[str]:
    with open(corpus / domain / f"{split}.jsonl", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]
