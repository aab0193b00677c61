"""The GPU machine's Python, simulated: packages it lacks cannot be imported (tests/e2e/test_device_check.py).

On PYTHONPATH, this file runs at every interpreter's start-up, in child processes too. It hides the packages from
the path finder itself, so they look as absent as on that machine: `import fastapi` raises ModuleNotFoundError and
importlib.util.find_spec("fastapi") is None (libraries that probe for optional packages probe that way).
"""

import importlib.machinery
import os
import sys

MISSING = frozenset(os.environ.get("SPECFLEET_SIMULATE_MISSING", "").split(",")) - {""}


class _HidingPathFinder(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] in MISSING:
            return None
        return super().find_spec(fullname, path, target)


if MISSING:
    sys.meta_path[:] = [_HidingPathFinder if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path]
