"""The `specfleet` command itself: --version, and a command it does not know."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from specfleet.cli import COMMANDS
from tests.harness import REPO


def _specfleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specfleet.cli", *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_version_prints_the_installed_package_s_version():
    out = _specfleet("--version")
    assert (out.returncode, out.stdout) == (0, f"specfleet {importlib.metadata.version('specfleet')}\n"), out.stderr


def test_an_unknown_command_is_named_with_the_valid_ones():
    out = _specfleet("serv", "--config", "x.yaml")
    assert out.returncode == 2  # as argparse's invalid choice
    assert "unknown command 'serv'" in out.stderr and out.stdout == ""
    assert all(name in out.stderr for name in COMMANDS)
