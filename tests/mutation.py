"""Known-bad changes ("mutants") to the code, and copies of the tree with one applied.

Each `tests/mutants/<area>.yaml` lists mutants: a name, why it is wrong, a `file`,
a `find` string that occurs exactly once in it, its `replace`ment, and the pytest
arguments (`tests`) that must fail with it applied. `scripts/mutants` runs them all;
tests/test_lossless.py starts a cluster from a mutated copy as its negative control.
"""

from __future__ import annotations

import pathlib
import shutil
from dataclasses import dataclass

import yaml

REPO = pathlib.Path(__file__).resolve().parent.parent
MUTANTS_DIR = pathlib.Path("tests") / "mutants"
FIELDS = ("name", "why", "file", "find", "replace", "tests")

# Not copied: version control, environments, caches and build outputs (.gitignore's entries).
SKIP = {".git", ".venv", "__pycache__", ".pytest_cache", ".cache", "build", "dist", "bench-results", ".whl", ".gl"}


class MutantError(ValueError):
    """A mutants file that cannot be used as written; the message says which entry and why."""


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str
    file: str  # relative to the repository root
    find: str
    replace: str
    tests: tuple[str, ...]  # pytest arguments that must fail with the mutant applied
    area: str  # the YAML file it comes from, relative to the repository root

    def occurrences(self, root: pathlib.Path = REPO) -> int:
        path = root / self.file
        return path.read_text().count(self.find) if path.is_file() else 0

    def apply(self, root: pathlib.Path) -> None:
        """Rewrite root/file with the mutant; the file is replaced, never written through a link."""
        path = root / self.file
        found = self.occurrences(root)
        if found != 1:
            raise MutantError(f"mutant {self.name} ({self.area}): `find` occurs {found} times in {self.file}, must be exactly once")
        text = path.read_text().replace(self.find, self.replace)
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
            mutants[entry["name"]] = Mutant(
                name=entry["name"], why=entry["why"], file=entry["file"], find=entry["find"],
                replace=entry["replace"], tests=tuple(tests), area=where,
            )
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
