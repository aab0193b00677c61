"""The mutant machinery: every known-bad change still applies, and scripts/mutants judges each outcome right.

Running the mutants themselves (`.venv/bin/python scripts/mutants`) takes minutes; these checks take seconds.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.mutation import REPO, MutantError, copy_tree, load_mutants, mutated_copy


def test_every_mutant_applies_exactly_once():
    """A `find` that no longer matches (the code moved on) would make its mutant silently meaningless."""
    mutants = load_mutants()
    assert "accept-every-draft" in mutants  # tests/test_lossless.py's negative control
    stale = {m.name: f"{m.file}: {m.occurrences()} occurrences" for m in mutants.values() if m.occurrences() != 1}
    assert not stale, stale


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
