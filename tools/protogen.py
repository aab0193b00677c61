"""Regenerate the gRPC stubs in specfleet/v1 from proto/specfleet/v1 (`make proto`).

The stubs are committed so that an installed specfleet imports them without
grpcio-tools; tests/specfleet/test_proto.py fails when they are stale.
"""

from __future__ import annotations

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Write the stubs for every .proto under proto/ into out_dir; return their paths."""
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted(p for p in (out_dir / "specfleet" / "v1").iterdir() if p.suffix in (".py", ".pyi"))


def main() -> int:
    written = generate(REPO)
    init = REPO / "specfleet" / "v1" / "__init__.py"
    init.write_text('"""Generated gRPC stubs for proto/specfleet/v1 (regenerate with `make proto`)."""\n')
    for path in written:
        print(path.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
