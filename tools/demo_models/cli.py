"""`specfleet models ACTION ...`: build the bundled demo models, or measure them (`specfleet.cli` runs it by module path)."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    # Everything after the action is the action's own (its --help included), so it is not parsed here.
    if argv and argv[0] in ("build", "matrix"):
        from tools import demo_models

        return demo_models.build_main(argv[1:]) if argv[0] == "build" else demo_models.matrix_main(argv[1:])
    parser = argparse.ArgumentParser(prog="specfleet models", description="Build the bundled demo models or measure them.")
    parser.add_argument("action", choices=["build", "matrix"], help="`specfleet models ACTION --help` for its options")
    parser.parse_args(argv)  # prints the help, or the error naming the unknown action
    return 2
