"""The layers hold (docs/ARCHITECTURE.md, "Layers"): import-linter's contracts in pyproject.toml, and
tools/check_imports.py (every module in a layer, no import cycles, no private names across packages)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import textwrap

from tests.harness import REPO
from tools import check_imports


def _lint_imports() -> subprocess.CompletedProcess:
    script = pathlib.Path(sys.executable).parent / "lint-imports"
    command = (
        [str(script)]
        if script.exists()
        else [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]
    )
    # This tree's packages, not an installed copy's (the editable install may point at another checkout).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run(
        [*command, "--no-cache", "--config", str(REPO / "pyproject.toml")], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )


def test_lint_imports_keeps_every_contract():
    out = _lint_imports()
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    kept = re.search(r"Contracts: (\d+) kept, 0 broken", out.stdout)
    assert kept and int(kept.group(1)) >= 2, out.stdout[-2000:]


def test_every_module_in_a_layer_no_cycles_no_private_names_across_packages():
    assert check_imports.check(REPO) == []


def test_the_checker_finds_unlayered_modules_cycles_and_private_names(tmp_path):
    files = {
        "pyproject.toml": """
            [tool.importlinter]
            root_packages = ["specfleet", "router"]
            [[tool.importlinter.contracts]]
            name = "layers"
            type = "layers"
            layers = ["tools", "specfleet.cli", "router", "specfleet.core : specfleet._hidden"]
        """,
        "specfleet/__init__.py": "",
        "specfleet/core.py": "def _helper():\n    pass\n",
        "specfleet/_hidden.py": "",
        "specfleet/stray.py": "",
        # the same package: its private names are its own business
        "specfleet/cli.py": "from specfleet.core import _helper\n",
        "router/__init__.py": "",
        "router/a.py": "from specfleet.core import _helper\nfrom router import b\n",
        "router/b.py": "from specfleet import core\n\n\ndef f():\n    import router.a\n\n    return core._helper\n",
        "tools/__init__.py": "",
        "tools/t.py": "import specfleet._hidden\nfrom specfleet import core as c\nc.public = 1\n",
    }
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    assert check_imports.check(tmp_path) == [
        "specfleet/stray.py: specfleet.stray is in no layer of pyproject.toml's [tool.importlinter] layers contract",
        "import cycle: router.a <-> router.b",
        "router/a.py:1: router.a uses specfleet.core._helper, a private name of another package",
        "router/b.py:7: router.b uses specfleet.core._helper, a private name of another package",
        "tools/t.py:1: tools.t uses specfleet._hidden, a private name of another package",
    ]


def test_the_runtime_imports_without_the_tools_or_their_packages():
    """Every runtime module imports with neither tools/ nor the packages only tools use (plots, HTTP client)."""
    code = textwrap.dedent(
        """
        import importlib, sys
        from tools.check_imports import find_modules
        runtime = [m for m in find_modules() if not m.startswith("tools") and not m.endswith("__main__")]
        for name in ("tools", "tools.check_imports"):
            del sys.modules[name]
        for blocked in ("tools", "matplotlib", "requests"):
            sys.modules[blocked] = None  # importing it raises ImportError
        for name in runtime:
            importlib.import_module(name)
        print(len(runtime))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert int(out.stdout.split()[-1]) > 40


def test_the_router_starts_without_torch_or_transformers():
    """The router runs no model: importing it and loading the bundled tokenizer pulls in neither (each costs
    seconds of CPU at every start, and hundreds of MiB)."""
    probe = (
        "import sys, router.server, router.openai_api\n"
        "from specfleet.tokenizer import load_tokenizer\n"
        "load_tokenizer('models/demo/target')\n"
        "sys.exit(' '.join(m for m in ('torch', 'transformers') if m in sys.modules) or None)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
