"""Known-bad changes ("mutants") to the code, and copies of the tree with one applied.

Each `tests/mutants/<area>.yaml` lists mutants: a name, why it is wrong, a `file`,
a `find` that occurs exactly once in it, its `replace`ment, and the pytest arguments
(`tests`) that must fail with it applied. `scripts/mutants` runs them all;
tests/e2e/test_lossless.py starts a cluster from a mutated copy as its negative control.

How `find` is matched, so that reformatting (ruff format, black) does not break a
mutant: a match is a literal occurrence of `find` or, in a `.py` file, a run of
Python tokens (the `tokenize` module) equal to the tokens of `find`, where:
  - whitespace, line breaks inside brackets, indentation and backslash continuations
    do not count; a line's end (NEWLINE, or `;`) does, except at find's two ends;
  - a string is compared by its value ('x' == "x"; "a" "b" == "ab"), an f-string by
    its prefix and body, a number by its value;
  - a comma just before a closing bracket is optional, on either side;
  - parentheses may be added by the file around part of the match (an opening one
    that ends its line, as a formatter wraps a long expression) or left out of it
    (redundant ones in find);
  - comments in `find` must be in the file, words alike (`#x` == `# x`); the file's
    other comments are skipped (and vanish with the replaced span);
  - find's last token may stop inside the file's one (a fragment ending inside a name,
    a comment or a string: `print(f"  try: {cmd()}`, compared literally); an unclosed
    bracket ends find's tokens quietly (`if not ok(`); text inside a string matches
    literally only.
A literal occurrence and the token match over the same text count once; `find` must
occur exactly once. A literal occurrence is replaced literally (so an unformatted
file mutates exactly as by `str.replace`), except that one of an indented `find` must
start its line. Otherwise the text from the first matched token to the last is
replaced; when `find` starts with indentation and the match starts its line,
`replace`'s lines move by the difference between the two indentations, and find's
leading indentation and trailing whitespace (`"    if unknown:\n"`) frame `replace`.
"""

from __future__ import annotations

import ast
import functools
import io
import itertools
import pathlib
import re
import shutil
import tokenize
from dataclasses import dataclass
from typing import NamedTuple

import yaml

REPO = pathlib.Path(__file__).resolve().parent.parent
MUTANTS_DIR = pathlib.Path("tests") / "mutants"
FIELDS = ("name", "why", "file", "find", "replace", "tests")

# Not copied: version control, environments, caches and build outputs (.gitignore's entries).
SKIP = {".git", ".venv", "__pycache__", ".pytest_cache", ".cache", "build", "dist", "bench-results", ".whl", ".gl"}


class MutantError(ValueError):
    """A mutants file that cannot be used as written; the message says which entry and why."""


# ---- Matching `find` by Python tokens (the rules are in the module docstring) ----

_CLOSERS = {")", "]", "}"}
_STRING_PREFIXES = {"r", "u", "f", "b", "rb", "br", "fr", "rf"}
_FSTRING = (getattr(tokenize, "FSTRING_START", -1), getattr(tokenize, "FSTRING_END", -1))  # Python 3.12+


class _Tok(NamedTuple):
    key: object  # what matching compares; None for a fragment's unfinished last token
    raw: str  # the token's text
    start: int  # offsets into the text
    end: int
    kind: str  # "code", "string", "comment", "comma" (before a closing bracket), "wrap" (a "(" ending its line)
    partner: int = -1  # index of the matching bracket in the token list, -1 if none


class _Needle(NamedTuple):
    tokens: tuple[_Tok, ...]
    lead: str  # find's text before its first token (indentation), and after its last one
    tail: str


class Match(NamedTuple):
    start: int  # offsets into the file's text
    end: int
    literal: bool  # a literal occurrence of find (replaced as str.replace would)


def _key(tok: tokenize.TokenInfo) -> object:
    if tok.type in (tokenize.STRING, tokenize.NUMBER):
        try:
            return ("value", type(value := ast.literal_eval(tok.string)).__name__, value)
        except (ValueError, SyntaxError):  # an f-string: its prefix and body, either quote
            prefix = tok.string[: len(tok.string) - len(tok.string.lstrip("rRbBuUfF"))]
            quote = 3 if tok.string[len(prefix) :].startswith(('"""', "'''")) else 1
            return ("f", prefix.lower(), tok.string[len(prefix) + quote : -quote])
    if tok.type == tokenize.COMMENT:
        return ("#", " ".join(tok.string[1:].split()))
    if tok.type == tokenize.NEWLINE or tok.string == ";":
        return "\n"
    return tok.string


def _raw_tokens(text: str, fragment: bool):
    """text's tokens, the offset where a fragment's unfinished last token starts (or None),
    and a function from a token's (row, column) to its offset; None when text does not
    tokenize. A fragment gets a header of one line per indentation it uses, so that it may
    dedent to a level it never opened. An f-string is one token, as on Python 3.11."""
    lines = io.StringIO(text).readlines()  # split as tokenize splits them
    widths = sorted({len(ln) - len(ln.lstrip(" ")) for ln in lines if ln.strip()} | {0}) if fragment else []
    header = "".join(" " * w + "_\n" for w in widths)
    starts = [0, *itertools.accumulate(map(len, lines))]
    offset = lambda row, col: starts[row - 1 - len(widths)] + col  # noqa: E731
    tokens, opened = [], []  # opened: the f-strings not closed yet (their pieces, on Python 3.12+)
    try:
        for tok in tokenize.generate_tokens(io.StringIO(header + text).readline):
            if tok.start[0] <= len(widths) or (tok.type == tokenize.ERRORTOKEN and tok.string.isspace()):
                continue
            if tok.type == tokenize.ERRORTOKEN:  # Python 3.11: the quote of a string left unfinished
                raise tokenize.TokenError("unterminated string", tok.start)
            if tok.type == _FSTRING[0]:
                opened.append(tok)
            elif tok.type == _FSTRING[1]:
                first = opened.pop()
                if not opened:  # the outermost f-string ends: one STRING token
                    string = text[offset(*first.start) : offset(*tok.end)]
                    tokens.append(tokenize.TokenInfo(tokenize.STRING, string, first.start, tok.end, ""))
            elif not opened:
                tokens.append(tok)
    except tokenize.TokenError as err:  # at the end: an unclosed bracket or string
        if not fragment:
            return None
        return tokens, (_unfinished(text, tokens, offset) if "string" in err.args[0] else None), offset
    except SyntaxError:  # IndentationError, or a character Python does not know
        return None
    return tokens, None, offset


def _unfinished(text: str, tokens: list[tokenize.TokenInfo], offset) -> int:
    """Where a fragment's unterminated string starts: after the last complete token (or at its prefix)."""
    last = tokens[-1] if tokens else None
    if last and last.type == tokenize.NAME and last.string.lower() in _STRING_PREFIXES and text[offset(*last.end) :][:1] in "\"'":
        return offset(*tokens.pop().start)
    at = offset(*last.end) if last else 0
    return len(text) - len(text[at:].lstrip())


@functools.lru_cache(maxsize=192)  # every mutant's find and the files they change
def _tokens(text: str, fragment: bool) -> tuple[_Tok, ...] | None:
    """text's significant tokens (see the module docstring), or None when it does not tokenize."""
    if (raw := _raw_tokens(text, fragment)) is None:
        return None
    infos, unfinished, offset = raw
    toks: list[_Tok] = []
    for tok in (t for t in infos if t.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)):
        start, end, key = offset(*tok.start), offset(*tok.end), _key(tok)
        if key == "\n" and (not toks or toks[-1].key == "\n"):
            continue  # a line's end counts once, and not before the first token
        kind = {tokenize.COMMENT: "comment", tokenize.STRING: "string"}.get(tok.type, "code")
        if kind == "string" and toks and toks[-1].kind == "string":
            toks[-1] = _joined(toks[-1], key, end, text)
            continue
        toks.append(_Tok(key, text[start:end], start, end, kind))
    if unfinished is not None:
        toks.append(_Tok(None, text[unfinished:], unfinished, len(text), "code"))
    if toks and fragment and toks[-1].key == "\n":
        toks.pop()
    return tuple(_pair_brackets(toks, text))


def _joined(first: _Tok, key: tuple, end: int, text: str) -> _Tok:
    """A string literal and the next one (implicit concatenation) as one token."""
    parts = first.key[1] if first.key[0] == "joined" else (first.key,)
    same = key[0] == "value" and parts[-1][:2] == key[:2]  # two str (or two bytes) literals: one value
    parts = (*parts[:-1], ("value", key[1], parts[-1][2] + key[2])) if same else (*parts, key)
    key = parts[0] if len(parts) == 1 else ("joined", parts)
    return first._replace(key=key, raw=text[first.start : end], end=end)


def _pair_brackets(toks: list[_Tok], text: str) -> list[_Tok]:
    """Marks each bracket's partner, commas before a closing bracket and "(" that end their line."""
    stack: list[int] = []
    for i, tok in enumerate(toks):
        if tok.raw in ("(", "[", "{"):
            stack.append(i)
        elif tok.raw in _CLOSERS and stack:
            j = stack.pop()
            toks[j], toks[i] = toks[j]._replace(partner=i), tok._replace(partner=j)
    after = ""  # the next token's text, comments left out
    for i in reversed(range(len(toks))):
        tok = toks[i]
        if tok.raw == "," and after in _CLOSERS:
            toks[i] = tok._replace(kind="comma")
        elif tok.raw == "(" and tok.partner > i and "\n" in text[tok.end : toks[i + 1].start]:
            toks[i] = tok._replace(kind="wrap")
        after = after if tok.kind == "comment" else tok.raw
    return toks


@functools.lru_cache(maxsize=64)
def _positions(text: str) -> dict[object, list[int]]:
    """Where each token key occurs among text's tokens."""
    positions: dict[object, list[int]] = {}
    for i, tok in enumerate(_tokens(text, False)):
        positions.setdefault(tok.key, []).append(i)
    return positions


def _needle(find: str) -> _Needle | None:
    toks = _tokens(find, True)
    return _Needle(toks, find[: toks[0].start], find[toks[-1].end :]) if toks else None


def _match_at(hay: tuple[_Tok, ...], i: int, needle: _Needle) -> Match | None:
    """The match of needle starting at hay's token i, or None."""
    toks, last = needle.tokens, len(needle.tokens) - 1
    j, k, end = 0, i, None
    skip_hay: set[int] = set()  # closing brackets of parentheses only the file has
    skip_needle: set[int] = set()  # closing brackets of parentheses only find has
    while j <= last:
        f, t = toks[j], (hay[k] if k < len(hay) else None)
        if j in skip_needle:
            j += 1
        elif t is None:
            return None
        elif k in skip_hay:
            k += 1
        elif f.key is not None and f.key == t.key:
            j, k, end = j + 1, k + 1, t.end
        elif j == last and not needle.tail and t.raw.startswith(f.raw):
            j, k, end = j + 1, k + 1, t.start + len(f.raw)  # find stops inside this token
        elif j == 0:
            return None
        elif t.kind in ("comment", "comma", "wrap"):
            if t.kind == "wrap":
                skip_hay.add(t.partner)
            k += 1
        elif f.kind == "comma" or (f.raw == "(" and f.partner > j):
            skip_needle.add(f.partner)
            j += 1
        else:
            return None
    pending = {p for p in skip_hay if p >= k}
    while pending:  # the parentheses the file opened inside the match close right after it
        if k >= len(hay) or hay[k].kind not in ("comment", "comma") and k not in pending:
            return None
        if k in pending:
            pending.discard(k)
            end = hay[k].end
        k += 1
    return Match(hay[i].start, end, False)


def find_matches(text: str, find: str, python: bool = True) -> list[Match]:
    """Where find occurs in text: its literal occurrences and, in Python, its token matches
    (a token match over a literal occurrence counts once, as that literal occurrence)."""
    literal = [Match(m.start(), m.end(), True) for m in re.finditer(re.escape(find), text)]
    hay, needle = (_tokens(text, False), _needle(find)) if python else (None, None)
    if hay is None or needle is None:
        return literal
    if find[:1] in (" ", "\t"):  # indented lines found inside deeper ones are a token match, to re-indent
        literal = [m for m in literal if text[m.start - 1 : m.start] not in (" ", "\t")]
    first = needle.tokens[0]
    if len(needle.tokens) > 1 or needle.tail:
        starts = _positions(text).get(first.key, [])
    else:  # a one-token find may stop inside a token
        starts = [i for i, tok in enumerate(hay) if tok.key == first.key or tok.raw.startswith(first.raw)]
    found = [m for m in (_match_at(hay, i, needle) for i in starts) if m is not None]
    tokens = [m for m in found if not any(lit.start < m.end and m.start < lit.end for lit in literal)]
    return sorted(literal + tokens)


def replace_match(text: str, match: Match, find: str, replace: str) -> str:
    """text with replace in place of match (see the module docstring for how it is framed)."""
    start, end = match.start, match.end
    if match.literal:
        return text[:start] + replace + text[end:]
    needle = _needle(find)
    cut = needle.lead.rfind("\n") + 1  # find's lead: line ends (rare), then indentation
    indent, replace = needle.lead[cut:], replace.removeprefix(needle.lead[:cut])
    line_start = text.rfind("\n", 0, start) + 1
    if indent and not text[line_start:start].strip():  # a block of lines: re-indent them all
        replace = _reindent(replace, indent, text[line_start:start])
        start = line_start
    else:
        replace = replace.removeprefix(indent)
    if needle.tail and replace.endswith(needle.tail):
        replace = replace[: len(replace) - len(needle.tail)]
    elif "\n" in needle.tail and not text[end : (text + "\n").index("\n", end)].strip():
        end = (text + "\n").index("\n", end) + 1  # find took its line's end, and replace does not give it back
    return text[:start] + replace + text[end:]


def _reindent(text: str, old: str, new: str) -> str:
    """text's lines moved from find's indentation `old` to the file's `new`: by spaces, or by
    tabs (one for four spaces) when the file indents with tabs."""
    width = lambda indent: len(indent.expandtabs(4))  # noqa: E731
    delta, lines = width(new) - width(old), []
    for line in text.split("\n"):
        body = line.lstrip(" \t")
        col = max(0, width(line[: len(line) - len(body)]) + delta)
        lines.append(("\t" * (col // 4) + " " * (col % 4) if "\t" in new else " " * col) + body if body else line)
    return "\n".join(lines)


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str
    file: str  # relative to the repository root
    find: str
    replace: str
    tests: tuple[str, ...]  # pytest arguments that must fail with the mutant applied
    area: str  # the YAML file it comes from, relative to the repository root

    def matches(self, text: str) -> list[Match]:
        return find_matches(text, self.find, python=self.file.endswith(".py"))

    def occurrences(self, root: pathlib.Path = REPO) -> int:
        path = root / self.file
        return len(self.matches(path.read_text())) if path.is_file() else 0

    def mutate(self, text: str) -> str:
        """text (the file's contents) with the mutant applied; `find` must occur exactly once."""
        found = self.matches(text)
        if len(found) != 1:
            raise MutantError(f"mutant {self.name} ({self.area}): `find` occurs {len(found)} times in {self.file}, must be exactly once")
        return replace_match(text, found[0], self.find, self.replace)

    def apply(self, root: pathlib.Path) -> None:
        """Rewrite root/file with the mutant; the file is replaced, never written through a link."""
        path = root / self.file
        text = self.mutate(path.read_text() if path.is_file() else "")
        path.unlink()
        path.write_text(text)


def load_mutants(root: pathlib.Path = REPO, area: str | None = None) -> dict[str, Mutant]:
    """Every mutant of tests/mutants/*.yaml (or of one area file), by name, in file order.

    Raises MutantError for a malformed entry or a duplicated name; whether `find` still
    occurs exactly once is left to `Mutant.occurrences`, so that one stale mutant does
    not hide the others."""
    files = sorted((root / MUTANTS_DIR).glob("*.yaml"))
    if area is not None:
        wanted = (root / area).resolve()
        files = [f for f in files if f.resolve() == wanted]
        if not files:
            raise MutantError(f"--area {area}: no such file among {MUTANTS_DIR}/*.yaml")
    mutants: dict[str, Mutant] = {}
    for path in files:
        where = str(path.relative_to(root))
        entries = yaml.safe_load(path.read_text()) or []
        if not isinstance(entries, list):
            raise MutantError(f"{where}: must be a list of mutants")
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict) or set(entry) != set(FIELDS):
                got = sorted(entry) if isinstance(entry, dict) else type(entry).__name__
                raise MutantError(f"{where}[{i}]: needs exactly the keys {list(FIELDS)}, got {got}")
            # An empty replace deletes what find matched.
            if not all(isinstance(entry[k], str) and (entry[k] or k == "replace") for k in FIELDS if k != "tests"):
                raise MutantError(f"{where}[{i}]: name, why, file and find must be non-empty strings, replace a string")
            tests = entry["tests"]
            if not isinstance(tests, list) or not tests or not all(isinstance(t, str) and t for t in tests):
                raise MutantError(f"{where}[{i}] ({entry['name']}): tests must be a non-empty list of pytest arguments")
            if entry["name"] in mutants:
                raise MutantError(f"{where}[{i}]: the name {entry['name']} is already used in {mutants[entry['name']].area}")
            if entry["find"] == entry["replace"]:
                raise MutantError(f"{where}[{i}] ({entry['name']}): replace equals find, so nothing changes")
            mutants[entry["name"]] = Mutant(**{k: entry[k] for k in FIELDS[:-1]}, tests=tuple(tests), area=where)
    return mutants


def copy_tree(dest: pathlib.Path, root: pathlib.Path = REPO) -> pathlib.Path:
    """A copy of the working tree (committed or not) at dest, which must not exist yet."""
    dest = pathlib.Path(dest)
    dest.mkdir(parents=True)
    for entry in root.iterdir():
        if entry.name in SKIP or entry.name.endswith(".egg-info"):
            continue
        target = dest / entry.name
        if entry.is_dir() and not entry.is_symlink():
            ignore = shutil.ignore_patterns(*SKIP, "*.pyc", "*.egg-info")
            # Copied, models too (41 MB, a fraction of a second): a test that writes models must not
            # write through a link into the real tree.
            shutil.copytree(entry, target, symlinks=True, ignore=ignore)
        else:
            shutil.copy2(entry, target, follow_symlinks=False)
    return dest


def mutated_copy(dest: pathlib.Path, name: str, root: pathlib.Path = REPO) -> pathlib.Path:
    """A copy of the tree at dest with the mutant `name` applied; returns dest."""
    mutants = load_mutants(root)
    if name not in mutants:
        raise MutantError(f"no mutant named {name}; known: {sorted(mutants)}")
    copy_tree(dest, root)
    mutants[name].apply(dest)
    return pathlib.Path(dest)
