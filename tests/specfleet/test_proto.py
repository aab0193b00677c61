"""The committed gRPC stubs match proto/ (regenerate with `make proto`)."""

from __future__ import annotations

import pathlib

from tools.protogen import REPO, generate


def test_generated_stubs_are_up_to_date(tmp_path: pathlib.Path):
    fresh = {p.name: p.read_text() for p in generate(tmp_path)}
    committed_dir = REPO / "specfleet" / "v1"
    committed = {p.name: p.read_text() for p in committed_dir.iterdir() if p.suffix in (".py", ".pyi") and p.name != "__init__.py"}
    assert sorted(fresh) == sorted(committed), "stub files differ from proto/: run `make proto`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale stubs {stale}: run `make proto`"
