"""Assemble the seven demo-model corpora: five natural languages, code and structured text.

The domains are chosen to compete for a small drafter's capacity: a one-layer drafter
that has to cover German, French, Spanish, Italian, English, Python and YAML/JSON
spreads its parameters and its 2,048-id output layer thin; one that covers a single
domain does not. Everything comes from Debian packages (``apt-get download`` +
``dpkg-deb -x`` into the work dir, ``<work>/debs`` and ``<work>/pkgs``) and the local
Python standard library:

* en:          ``fortunes``, ``jargon-text``, ``manpages`` (roff), ``python3.11-doc``
               (reST), ``debian-reference-en`` (plain text), ``aptitude-doc-en`` (HTML);
* de:          ``manpages-de``, ``debian-reference-de``, ``fortunes-de``;
* fr:          ``manpages-fr``, ``debian-reference-fr``, ``aptitude-doc-fr``;
* es:          ``manpages-es``, ``debian-reference-es``, ``fortunes-es``, ``aptitude-doc-es``;
* it:          ``manpages-it``, ``debian-reference-it``, ``fortunes-it``, ``aptitude-doc-it``;
* code:        Python source: the standard library (``sysconfig`` stdlib path) plus the
               modules of ``python3-setuptools``, ``python3-docutils`` and ``python3-pygments``;
* structured:  YAML / JSON / INI / TOML / CFG files of ``ansible`` (playbooks, roles,
               changelogs, JSON fixtures), ``rubocop``, ``cloud-init`` and ``pandoc-data``.

``debian-faq-*``, ``maint-guide-*`` and ``developers-reference-*`` are never used: they
are the independent evaluation's held-out Debian documentation.

Each domain gets a deterministic train / held-out split (by source file, or by block of
chunks for single-file sources) plus an *unseen* set from a source the training never
uses:

* en, de, fr, es, it: the Debian Edu manual (``debian-edu-doc-<lang>``, HTML), Debian
  documentation in that language that no training split uses;
* code:       Python modules of ``python3-jinja2``, ``python3-requests`` and ``python3-urllib3``;
* structured: YAML / JSON / INI files of ``ansible-core``.

``--quick`` mode uses only the local Python stdlib tree (no network) and is a smoke test
of the pipeline, not of specialisation: code = ``*.py`` (minus ``email/``, the unseen
set), structured = the ``*.json`` / ``*.toml`` / ``*.xml`` / ``*.cfg`` test data, and the
five language domains share out the stdlib's ``*.txt`` files and ``pydoc_data.topics``.
"""

from __future__ import annotations

import gzip
import hashlib
import html
import json
import random
import re
import shutil
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

LANGUAGES = ("en", "de", "fr", "es", "it")
DOMAINS = LANGUAGES + ("code", "structured")
# one specialist per domain, named after it (its directory name is its speciality), and
# the general drafter over the mix
DRAFTER_NAMES = DOMAINS + ("general",)
SPLITS = ("train", "heldout", "unseen")

DEB_PACKAGES = [
    "fortunes",
    "jargon-text",
    "manpages",
    "python3.11-doc",
    "python3-setuptools",
    "python3-docutils",
    "python3-pygments",
    "ansible",
    "rubocop",
    "cloud-init",
    "pandoc-data",
    "aptitude-doc-en",
    *(f"manpages-{lang}" for lang in ("de", "fr", "es", "it")),
    *(f"debian-reference-{lang}" for lang in LANGUAGES),
    *(f"fortunes-{lang}" for lang in ("de", "es", "it")),
    *(f"aptitude-doc-{lang}" for lang in ("fr", "es", "it")),
    # unseen sources
    *(f"debian-edu-doc-{lang}" for lang in LANGUAGES),
    "python3-jinja2",
    "python3-requests",
    "python3-urllib3",
    "ansible-core",
]

CHUNK_CHARS = 4000
MAX_FILE_CHARS = 60_000


@dataclass
class Limits:
    train_chars: int  # per domain
    heldout_chars: int
    unseen_chars: int


FULL_LIMITS = Limits(train_chars=1_500_000, heldout_chars=150_000, unseen_chars=150_000)
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
    missing: list[str] = []
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
                missing.append(name)
                continue
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir()
        subprocess.run(["dpkg-deb", "-x", str(have[-1]), str(dest)], check=True)
        (dest / ".unpacked").touch()
    if missing:
        raise SystemExit(
            "could not download these Debian packages with apt-get download: "
            + " ".join(missing)
            + "\ninstall them (apt-get install -y "
            + " ".join(missing)
            + ") or make them downloadable, then rerun"
        )
    return pkgs


# --------------------------------------------------------------------------- sources


def _fortune_docs(root: Path) -> Iterator[Doc]:
    fdir = root / "usr/share/games/fortunes"
    paths = sorted(p for p in fdir.rglob("*") if p.is_file()) if fdir.exists() else []
    for p in paths:
        # offensive fortunes (off/) are left out; .dat/.u8 are indexes and symlinks duplicates
        if p.suffix in (".dat", ".u8") or p.is_symlink() or "off" in p.relative_to(fdir).parts:
            continue
        t = _read_text(p)
        if not t:
            continue
        # one doc per block of fortunes, "%" separators kept (that is the file format)
        yield from _big_text_docs(f"{root.name}/{p.relative_to(fdir)}", t, block=2)


def _jargon_docs(root: Path) -> Iterator[Doc]:
    p = root / "usr/share/doc/jargon-text/jargon.txt.gz"
    t = _read_text(p) if p.exists() else None
    if t:
        yield from _big_text_docs("jargon", t, block=4)


_HTML_DROP = re.compile(r"<(script|style|head)\b.*?</\1>", re.S | re.I)
_HTML_BREAK = re.compile(r"<(br|p|div|h[1-6]|li|tr|pre|dt|dd|table|ul|ol)\b[^>]*>", re.I)
_HTML_TAG = re.compile(r"<[^>]+>")


def html_text(t: str) -> str:
    """Readable text of an HTML page: markup dropped, entities decoded, blank runs collapsed."""
    t = _HTML_DROP.sub("", t)
    t = _HTML_BREAK.sub("\n", t)
    t = html.unescape(_HTML_TAG.sub("", t))
    t = re.sub(r"[ \t]+\n", "\n", t)
    return re.sub(r"\n{3,}", "\n\n", t).strip() + "\n"


def _html_docs(root: Path, patterns: Iterable[str] = ("*.html",), block: int = 1) -> Iterator[Doc]:
    """HTML pages as text; a single big manual is split into blocks of chunks."""
    for p in _files(root, patterns):
        t = _read_text(p)
        if not t:
            continue
        t = html_text(t)
        if len(t) > MAX_FILE_CHARS:
            yield from _big_text_docs(str(p.relative_to(root)), t, block=4)
        elif t.strip():
            yield str(p.relative_to(root)), t


def _man_docs(root: Path, lang: str | None) -> Iterator[Doc]:
    """roff man pages of one language (``lang`` None: the untranslated ``usr/share/man/man*``)."""
    base = root / "usr/share/man" / (lang or "")
    paths = [p for p in _files(base, ["*.gz"]) if p.relative_to(base).parts[0].startswith("man")]
    yield from _file_docs(root, paths)


def _debref_docs(pkgs: Path, lang: str) -> Iterator[Doc]:
    """The Debian Reference as plain text (its .txt.gz), in blocks of chunks."""
    root = pkgs / f"debian-reference-{lang}"
    for p in _files(root, [f"debian-reference.{lang}.txt.gz"]):
        t = _read_text(p)
        if t:
            yield from _big_text_docs(f"debian-reference-{lang}", t, block=4)


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

    def en_pydoc():
        root = P("python3.11-doc") / "usr/share/doc/python3.11/html/_sources"
        return _file_docs(root, _files(root, ["*.txt"]))

    def struct_pkg(name: str):
        def docs():
            root = P(name)
            return _file_docs(root, _files(root, STRUCT_PATTERNS))

        return docs

    def lang_sources(lang: str) -> list[Callable[[], Iterator[Doc]]]:
        srcs = [lambda: _man_docs(P(f"manpages-{lang}"), lang), lambda: _debref_docs(pkgs, lang)]
        if lang in ("de", "es", "it"):
            srcs.append(lambda: _fortune_docs(P(f"fortunes-{lang}")))
        if lang in ("fr", "es", "it"):
            srcs.append(lambda: _html_docs(P(f"aptitude-doc-{lang}")))
        return srcs

    def edu_manual(lang: str):
        # the bookworm manual only: the bullseye one is mostly the same text
        return lambda: _html_docs(P(f"debian-edu-doc-{lang}"), ["debian-edu-bookworm-manual.html"])

    sources = {
        "en": {
            "train": [
                lambda: _fortune_docs(P("fortunes")),
                lambda: _jargon_docs(P("jargon-text")),
                lambda: _man_docs(P("manpages"), None),
                en_pydoc,
                lambda: _debref_docs(pkgs, "en"),
                lambda: _html_docs(P("aptitude-doc-en")),
            ],
            "unseen": [edu_manual("en")],
        },
        "code": {
            "train": [code_train, py_pkg("python3-setuptools"), py_pkg("python3-docutils"), py_pkg("python3-pygments")],
            "unseen": [code_unseen],
        },
        "structured": {
            "train": [struct_pkg(n) for n in ("ansible", "rubocop", "cloud-init", "pandoc-data")],
            "unseen": [struct_pkg("ansible-core")],
        },
    }
    for lang in LANGUAGES[1:]:
        sources[lang] = {"train": lang_sources(lang), "unseen": [edu_manual(lang)]}
    return sources


def quick_sources() -> dict[str, dict[str, list[Callable[[], Iterator[Doc]]]]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    skip = lambda p: "site-packages" in p.parts or "__pycache__" in p.parts  # noqa: E731

    def code_train():
        return _file_docs(stdlib, _files(stdlib, ["*.py"], lambda p: skip(p) or "email" in p.parts or "test" in p.parts))

    def code_unseen():
        return _file_docs(stdlib, _files(stdlib / "email", ["*.py"], skip))

    def prose():
        paths = _files(stdlib, ["*.txt", "LICENSE*"], skip)
        yield from _file_docs(stdlib, [p for p in paths if p.stat().st_size > 500])
        try:
            from pydoc_data.topics import topics  # type: ignore
        except ImportError:  # pragma: no cover
            topics = {}
        for k in sorted(topics):
            yield f"pydoc:{k}", topics[k]

    def lang_train(i: int):
        return lambda: (d for d in prose() if _h("quick:" + d[0]) % len(LANGUAGES) == i)

    def struct_train():
        return _file_docs(stdlib, _files(stdlib, ["*.json", "*.toml", "*.xml", "*.cfg", "*.ini"], skip))

    sources = {
        "code": {"train": [code_train], "unseen": [code_unseen]},
        "structured": {"train": [struct_train], "unseen": []},
    }
    for i, lang in enumerate(LANGUAGES):
        sources[lang] = {"train": [lang_train(i)], "unseen": []}
    return sources


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
        if not splits["heldout"] and len(splits["train"]) > 1:
            # a small source (quick mode) can leave no document to the 5% held-out draw
            splits["heldout"] = [splits["train"].pop()]
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
