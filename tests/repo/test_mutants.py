"""The mutant machinery: every known-bad change still applies, and scripts/mutants judges each outcome right.

Running the mutants themselves (`.venv/bin/python scripts/mutants`) takes minutes; these checks take seconds.
Each mutant must also survive reformatting of its file (tests/mutation.py matches `find` by tokens):
the reformatting transformations below, and `ruff format` where ruff is installed.
"""

from __future__ import annotations

import ast
import io
import itertools
import pathlib
import shutil
import subprocess
import sys
import tokenize

import pytest
import yaml

from tests.mutation import REPO, Mutant, MutantError, copy_tree, load_mutants, mutated_copy


def test_every_mutant_applies_exactly_once():
    """A `find` that no longer matches (the code moved on) would make its mutant silently meaningless."""
    mutants = load_mutants()
    assert "accept-every-draft" in mutants  # tests/e2e/test_lossless.py's negative control
    stale = {m.name: f"{m.file}: {m.occurrences()} occurrences" for m in mutants.values() if m.occurrences() != 1}
    assert not stale, stale
    # In the files as they are, each find occurs literally and is replaced exactly as str.replace would.
    texts = {m.file: (REPO / m.file).read_text() for m in mutants.values()}
    assert [m.name for m in mutants.values() if m.mutate(texts[m.file]) != texts[m.file].replace(m.find, m.replace)] == []


def test_every_python_mutant_parses_and_changes_the_code():
    """A mutated .py file still parses (else its tests fail for the wrong reason) and differs from the original."""
    broken = {}
    for m in _python_mutants():
        original = (REPO / m.file).read_text()
        try:
            if ast.dump(ast.parse(m.mutate(original))) == ast.dump(ast.parse(original)):
                broken[m.name] = "the code does not change"
        except SyntaxError as err:
            broken[m.name] = f"does not parse: {err}"
    assert not broken, broken


def test_mutated_copy_changes_only_the_copy(tmp_path):
    mutant = load_mutants()["accept-every-draft"]
    original = (REPO / mutant.file).read_text()
    tree = mutated_copy(tmp_path / "tree", mutant.name)
    assert (REPO / mutant.file).read_text() == original
    assert (tree / mutant.file).read_text() == original.replace(mutant.find, mutant.replace)
    assert not (tree / ".git").exists() and not (tree / ".venv").exists()
    assert (tree / "models").is_dir() and (tree / "tests" / "mutation.py").is_file()


def _tree_with_mutants(tmp_path, entries: list[dict]):
    """A copy of the tree whose only mutants are `entries`, judged by one small test."""
    tree = copy_tree(tmp_path / "tree", REPO)
    for path in (tree / "tests" / "mutants").glob("*.yaml"):
        path.unlink()
    (tree / "tests" / "mutants" / "demo.yaml").write_text(yaml.safe_dump(entries))
    (tree / "marker.txt").write_text("good\n")
    # Judges the first line only, so that a mutant adding a line survives.
    (tree / "tests" / "test_marker.py").write_text(
        "import pathlib\n\ndef test_marker():\n    assert pathlib.Path('marker.txt').read_text().splitlines()[0] == 'good'\n"
    )
    return tree


def _mutant(name: str, find: str, replace: str, tests: list[str]) -> dict:
    return {"name": name, "why": "for the test", "file": "marker.txt", "find": find, "replace": replace, "tests": tests}


def test_scripts_mutants_reports_each_outcome(tmp_path):
    tree = _tree_with_mutants(
        tmp_path,
        [
            _mutant("caught-one", "good", "bad", ["tests/test_marker.py"]),
            _mutant("survivor", "good\n", "good\nextra\n", ["tests/test_marker.py::test_marker"]),
            _mutant("stale", "gone", "bad", ["tests/test_marker.py"]),
            _mutant("no-tests", "good", "bad", ["tests/test_marker.py", "-k", "nothing_matches"]),
        ],
    )
    done = subprocess.run([sys.executable, "scripts/mutants"], cwd=tree, capture_output=True, text=True, timeout=300)
    lines = {line.split()[1]: line.split()[0] for line in done.stdout.splitlines() if line[:1] not in (" ", "")}
    assert lines.get("caught-one") == "caught", done.stdout
    assert lines.get("survivor") == "SURVIVED", done.stdout
    assert lines.get("stale") == "broken-find", done.stdout
    assert lines.get("no-tests") == "error", done.stdout  # pytest selected nothing: exit 5, not a catch
    assert "1 caught, 1 survived" in done.stdout, done.stdout
    assert done.returncode == 1

    only = subprocess.run([sys.executable, "scripts/mutants", "--only", "caught-one"], cwd=tree, capture_output=True, text=True, timeout=300)
    assert only.returncode == 0 and "1 caught, 0 survived" in only.stdout, only.stdout + only.stderr


def test_load_mutants_refuses_malformed_entries(tmp_path):
    tree = _tree_with_mutants(tmp_path, [_mutant("twice", "good", "bad", ["x"]), _mutant("twice", "good", "worse", ["x"])])
    with pytest.raises(MutantError, match="the name twice is already used"):
        load_mutants(tree)
    (tree / "tests" / "mutants" / "demo.yaml").write_text(yaml.safe_dump([{"name": "short", "file": "marker.txt"}]))
    with pytest.raises(MutantError, match="needs exactly the keys"):
        load_mutants(tree)


# ---- Reformatting: every mutant still applies once, and mutates the reformatted file as it does the original ----


def _python_mutants() -> list[Mutant]:
    return [m for m in load_mutants().values() if m.file.endswith(".py")]


def _tokens_at(text: str):
    """text's tokens with their start and end offsets; an f-string is one STRING token (Python 3.12+ splits it)."""
    starts = [0, *itertools.accumulate(map(len, io.StringIO(text).readlines()))]
    fstring = (getattr(tokenize, "FSTRING_START", -1), getattr(tokenize, "FSTRING_END", -1))
    opened = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        start, end = starts[tok.start[0] - 1] + tok.start[1], starts[tok.end[0] - 1] + tok.end[1]
        if tok.type == fstring[0]:
            opened.append((tok, start))
        elif tok.type == fstring[1]:
            first, first_start = opened.pop()
            if not opened:
                yield tokenize.TokenInfo(tokenize.STRING, text[first_start:end], first.start, tok.end, ""), first_start, end
        elif not opened:
            yield tok, start, end


def _edited(text: str, edits: list[tuple[int, int, str]]) -> str:
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def requote(text: str) -> str:
    """Swaps ' and " around every one-line string (f-strings too) whose body has neither quote nor backslash."""
    edits = []
    for tok, start, end in _tokens_at(text):
        body = tok.string.lstrip("rRbBuUfF")
        prefix, quote, inner = tok.string[: len(tok.string) - len(body)], body[:1], body[1:-1]
        if tok.type == tokenize.STRING and not body.startswith(('"""', "'''")) and not set(inner) & set("\"'\\"):
            edits.append((start, end, prefix + ("'" if quote == '"' else '"') + inner + ("'" if quote == '"' else '"')))
    return _edited(text, edits)


def wrap(text: str) -> str:
    """Breaks the line after every opening bracket and comma inside brackets, and adds a trailing comma
    to every bracket that holds a comma (a call's arguments, a tuple, a subscript: the same code) but
    not a comprehension's `for`."""
    edits, brackets, previous = [], [], None  # brackets: per open bracket, "comma", "for" or None
    for tok, start, end in _tokens_at(text):
        if tok.type in (tokenize.NL, tokenize.COMMENT):
            continue
        if tok.string in ")]}" and brackets and brackets.pop() == "comma" and previous.string not in ",([{":
            edits.append((start, start, ","))
        elif tok.string in ("(", "[", "{"):
            brackets.append(None)
        elif tok.string in (",", "for") and brackets and brackets[-1] != "for":
            brackets[-1] = "comma" if tok.string == "," else "for"
        if tok.string in ("(", "[", "{") or (tok.string == "," and brackets):
            edits.append((end, end, "\n" + " " * 8))
        previous = tok
    return _edited(text, edits)


def respace(text: str) -> str:
    """Spaces after every opening bracket, comma and operator, and before every closing bracket not starting a line."""
    edits = []
    for tok, start, end in _tokens_at(text):
        if tok.type == tokenize.OP and tok.string in ")]}" and text[start - 1] not in " \n":
            edits.append((start, start, " "))
        elif tok.type == tokenize.OP and tok.string not in ".)]}:":
            edits.append((end, end, " "))
    return _edited(text, edits)


def nest(text: str) -> str:
    """Every indented line four spaces deeper (the code moved into a block), lines inside strings left alone."""
    inside = {row for tok, _, _ in _tokens_at(text) if tok.type == tokenize.STRING for row in range(tok.start[0] + 1, tok.end[0] + 1)}
    lines = io.StringIO(text).readlines()
    return "".join("    " + line if line[:4] == "    " and row not in inside else line for row, line in enumerate(lines, 1))


# Mutants each transformation must move off their literal `find` (so that the token match does the work): strings
# in double quotes (one before a comment); calls wrapped over lines with a trailing comma, a find ending in a comma,
# one ending in an unclosed bracket; a find with a comment, one ending inside an f-string; finds and replaces of
# several lines, one line inside a deeper block: re-indented.
REFORMATS = {
    requote: ["llama3-rope-scaling-ignored", "any-rope-scaling-accepted"],
    wrap: ["metrics-request-without-deadline", "undecodable-requests-unknown", "model-info-without-device", "stacked-proposals-use-one-token-map"],
    respace: ["pool-not-sized-before-capture", "ready-message-names-a-command-not-on-path", "stacked-models-share-the-first-models-weights"],
    nest: ["device-spelling-unchecked", "verifier-failure-fails-requests", "unknown-fields-ignored", "max-tokens-past-context-accepted"],
}


@pytest.mark.parametrize("reformat", REFORMATS, ids=lambda f: f.__name__)
def test_every_mutant_survives_reformatting(reformat):
    """mutate(reformat(file)) has the AST of reformat(mutate(file)), for every mutant of a .py file."""
    failures, by_tokens, files = {}, set(), {}
    for m in _python_mutants():
        original = (REPO / m.file).read_text()
        if m.file not in files:
            files[m.file] = reformat(original)
            assert ast.dump(ast.parse(files[m.file])) == ast.dump(ast.parse(original)), f"{reformat.__name__} changed {m.file}"
        reformatted = files[m.file]
        if not any(match.literal for match in m.matches(reformatted)):
            by_tokens.add(m.name)
        try:
            if ast.dump(ast.parse(m.mutate(reformatted))) != ast.dump(ast.parse(reformat(m.mutate(original)))):
                failures[m.name] = "mutates the reformatted file differently"
        except (MutantError, SyntaxError) as err:
            failures[m.name] = str(err)
    assert not failures, failures
    assert set(REFORMATS[reformat]) <= by_tokens, f"still literal: {set(REFORMATS[reformat]) - by_tokens}"


def _ruff() -> str | None:
    return shutil.which("ruff", path=str(pathlib.Path(sys.executable).parent)) or shutil.which("ruff")


@pytest.mark.skipif(_ruff() is None, reason="ruff is not installed (pip install -e .[dev])")
def test_every_mutant_survives_ruff_format(tmp_path):
    """As above with `ruff format` (its defaults: 88 columns, double quotes) of copies of the files: the
    original files, and each mutated one, formatted in one run; the repository is never formatted."""
    mutants = _python_mutants()
    for m in mutants:
        original = (REPO / m.file).read_text()
        for path, text in ((tmp_path / "original" / m.file, original), (tmp_path / "mutated" / m.name / m.file, m.mutate(original))):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    subprocess.run([_ruff(), "format", "--isolated", "--quiet", str(tmp_path)], check=True, timeout=300)
    failures, by_tokens = {}, set()
    for m in mutants:
        formatted = (tmp_path / "original" / m.file).read_text()
        if not any(match.literal for match in m.matches(formatted)):
            by_tokens.add(m.name)
        try:
            mutated = m.mutate(formatted)
            if ast.dump(ast.parse(mutated)) != ast.dump(ast.parse((tmp_path / "mutated" / m.name / m.file).read_text())):
                failures[m.name] = "mutates the formatted file differently"
        except (MutantError, SyntaxError) as err:
            failures[m.name] = str(err)
    assert not failures, f"{len(failures)} of {len(mutants)} mutants break under ruff format: {failures}"
    assert len(by_tokens) >= 20, f"ruff format changed the finds of only {sorted(by_tokens)}"  # 32 of 104 with ruff 0.17


# ---- The matcher on small snippets ----


def _demo(find: str, replace: str = "pass", file: str = "demo.py") -> Mutant:
    return Mutant(name="demo", why="a test", file=file, find=find, replace=replace, tests=("x",), area="demo.yaml")


SNIPPETS = {  # text, find, replace, and the mutated text
    "quotes": ("x = f('a', b)\n", 'x = f("a", b)', 'x = f("z", b)', 'x = f("z", b)\n'),
    "wrapped call": (
        "def g():\n    total = compute(\n        first,\n        second,\n    )\n    return total\n",
        "    total = compute(first, second)\n",
        "    total = compute(second, first)\n",
        "def g():\n    total = compute(second, first)\n    return total\n",
    ),
    "trailing comma in find": ("f(a, b)\n", "f(a, b,)", "f(b, a,)", "f(b, a,)\n"),
    "spacing and comment in the span": ("f(a ,  # first\n  b)\n", "f(a, b)", "f(b, a)", "f(b, a)\n"),
    "parentheses the file added": ("x = (\n    alpha + beta\n)\n", "x = alpha + beta", "x = alpha - beta", "x = alpha - beta\n"),
    "parentheses find has": ("x = alpha + beta\n", "x = (alpha + beta)", "x = (alpha - beta)", "x = (alpha - beta)\n"),
    "implicit concatenation": ('msg = "a" "b"\n', "msg = 'ab'", "msg = ''", "msg = ''\n"),
    "unclosed paren": (
        "if key  and  not check(a, b):\n    pass\n",
        "if key and not check(",
        "if False and not check(",
        "if False and not check(a, b):\n    pass\n",
    ),
    "unfinished f-string": (
        'print(\n    f"  try: {cmd()} now"\n)\n',
        'print(f"  try: {cmd()}',
        'print(f"  go: {cmd()}',
        'print(f"  go: {cmd()} now"\n)\n',
    ),
    "comment in find": ("x = 1 #  keep it\ny = 2\n", "x = 1  # keep it\n", "x = 2  # keep it\n", "x = 2  # keep it\ny = 2\n"),
    # find does not start with indentation: replace's lines stay as written (here the comment's, harmlessly).
    "find ends inside a comment": (
        "if ok:\n    # Generation would stop here\n    go()\n",
        "if ok:\n        # Generation",
        "if False:\n        # Generation",
        "if False:\n        # Generation would stop here\n    go()\n",
    ),
    "indented line, one block deeper": (
        "class A:\n    def f(self):\n        if unknown:\n            raise E\n",
        "    if unknown:\n",
        "    if False:\n",
        "class A:\n    def f(self):\n        if False:\n            raise E\n",
    ),
    "lines added, re-indented": (
        "def f():\n  if a:\n      x = 1\n      z = 3\n",
        "    x = 1\n",
        "    x = 1\n    if b:\n        y = 2\n",
        "def f():\n  if a:\n      x = 1\n      if b:\n          y = 2\n      z = 3\n",
    ),
    "several lines, tabs": (
        "def f(d):\n\tif not ok(d):\n\t\traise E(d)\n\tfor x in d:\n\t\tuse(x)\n",
        "    if not ok(d):\n        raise E(d)\n    for x in d:",
        "    pass\n    for x in d:",
        "def f(d):\n\tpass\n\tfor x in d:\n\t\tuse(x)\n",
    ),
    "deleted line": ("f(\n    a=1,\n    device=str(d),\n)\n", "    device=str(d),", "", "f(\n    a=1,\n\n)\n"),
    "text inside a string, literally": ('s = "it\'s here"\n', "t's here", "t's there", 's = "it\'s there"\n'),
}


@pytest.mark.parametrize("name", SNIPPETS)
def test_matcher_on_snippets(name):
    text, find, replace, expected = SNIPPETS[name]
    mutant = _demo(find, replace)
    assert len(mutant.matches(text)) == 1
    mutated = mutant.mutate(text)
    ast.parse(mutated)
    assert mutated == expected


def test_matcher_counts_each_occurrence_once():
    assert len(_demo("f(x, y)").matches("f(x, y)\n")) == 1  # the literal occurrence is also the token match
    assert len(_demo("f(x, y)").matches("f(x, y)\nf(x,y)\n")) == 2  # one literal, one by tokens
    assert len(_demo("f(x, y)").matches("f(x, y)\ng(f(\n    x,\n    y,\n))\n")) == 2
    assert len(_demo("f(x, y)").matches('f(x, y)\ns = "f(x, y)"\n')) == 2  # inside a string: literal, still counted
    assert len(_demo("f(x, y)").matches("f(x, yz)\n")) == 0
    with pytest.raises(MutantError, match="occurs 2 times"):
        _demo("f(x, y)").mutate("f(x, y)\nf(x,y)\n")
    with pytest.raises(MutantError, match="occurs 0 times"):
        _demo("f(x, y)").mutate("f(y, x)\n")


def test_matcher_keeps_other_files_literal():
    assert len(_demo("a: 'x'", file="demo.yaml").matches("a:  'x'\n")) == 0
    assert len(_demo("a: 'x'", file="demo.yaml").matches("a: 'x'\n")) == 1
    assert len(_demo("a = 'x'").matches('a  =  "x"\n')) == 1
    assert len(_demo("a = 'x'").matches("a = 'x' $\n")) == 1  # a file that does not tokenize: literal matches only
    assert len(_demo("a = 'x'").matches("a  = 'x' $\n")) == 0
