"""``python -m tools.demo_models {build,matrix} [...]``."""

import sys

from .acceptance import matrix_main
from .build import build_main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("build", "matrix"):
        print("usage: python -m tools.demo_models {build,matrix} [options]  (--help for each)", file=sys.stderr)
        return 2
    return (build_main if argv[0] == "build" else matrix_main)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
