"""`ruff check` and `ruff format --check` ([tool.ruff] in pyproject.toml) pass on the runtime packages, the tools, the scripts and
the tests."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.harness import REPO

CHECKED = ["specfleet", "router", "drafter_service", "verifier_service", "tools", "tests", "scripts"]


def test_ruff_check_is_clean():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *CHECKED],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_ruff_format_leaves_the_code_as_it_is():
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", *CHECKED],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


# The runtime's size rules (docs/ARCHITECTURE.md): no file over 400 lines and no function over 80, except where a
# reason says why. Tools and tests are not held to them.
RUNTIME = ["specfleet", "router", "drafter_service", "verifier_service", "deploy"]
MOST_FILE_LINES, MOST_FUNCTION_LINES = 400, 80
LONG_FILES = {
    "specfleet/engine/llama.py": "the forward pass of every served family on one page, as gpt-fast's model.py",
    "specfleet/cli.py": "every subcommand's entry and `serve`'s process tree in one place, the order they start in",
}
LONG_FUNCTIONS = {
    "router/planning.py:Planning.plan": "a round's plan reads top to bottom: route, hope, consolidate, k, helpers",
    "router/drafter_choice.py:cooperate": "the helper search and its goodput bookkeeping share their loop state",
    "specfleet/ray_cluster.py:serve": "the Ray deployment's start-up in the order its actors must come up",
}


def _runtime_files():
    for root in RUNTIME:
        for path in sorted((REPO / root).rglob("*.py")):
            if not path.name.endswith("_pb2.py") and not path.name.endswith("_pb2_grpc.py"):
                yield path


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function, methods as Class.method."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node.end_lineno - node.lineno + 1
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")


def _long_ones() -> tuple[dict[str, int], dict[str, int]]:
    files, functions = {}, {}
    for path in _runtime_files():
        name, text = path.relative_to(REPO).as_posix(), path.read_text()
        if (lines := len(text.splitlines())) > MOST_FILE_LINES:
            files[name] = lines
        for function, length in _functions(ast.parse(text)):
            if length > MOST_FUNCTION_LINES:
                functions[f"{name}:{function}"] = length
    return files, functions


def test_runtime_files_and_functions_are_short_or_say_why():
    files, functions = _long_ones()
    unexplained = {k: v for k, v in {**files, **functions}.items() if k not in LONG_FILES and k not in LONG_FUNCTIONS}
    assert not unexplained, (
        f"over {MOST_FILE_LINES} lines a file or {MOST_FUNCTION_LINES} a function, with no reason in "
        f"tests/repo/test_lint.py: {unexplained} (split it, or add the reason)"
    )
    stale = sorted(set(LONG_FILES) - set(files)) + sorted(set(LONG_FUNCTIONS) - set(functions))
    assert not stale, f"no longer long, take them out of the reasons: {stale}"
