"""`ruff check` and `ruff format --check` ([tool.ruff] in pyproject.toml) pass on the runtime packages, the tools and
the tests."""

from __future__ import annotations

import subprocess
import sys

from tests.harness import REPO

CHECKED = ["specfleet", "router", "drafter_service", "verifier_service", "tools", "tests"]


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
