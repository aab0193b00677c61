"""`specfleet bench`: specfleet and the systems a user would pick instead, side by side, in one run."""


def main(argv: list[str] | None = None) -> int:
    from tools.bench.cli import main as _main

    return _main(argv)
