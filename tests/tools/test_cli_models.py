"""`specfleet models`: each action's own help, and the bundled demo models kept from a quick build."""

from __future__ import annotations

import subprocess
import sys

from tests.harness import REPO


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specfleet.cli", *args], capture_output=True, text=True, cwd=REPO, timeout=timeout)


def test_each_models_action_prints_its_own_help():
    build = run("models", "build", "--help")
    assert build.returncode == 0 and "usage: specfleet models build" in build.stdout and "--quick" in build.stdout
    assert "training-time budget for the target (default: 0)" in " ".join(build.stdout.split())  # defaults are shown
    matrix = run("models", "matrix", "--help")
    assert matrix.returncode == 0 and "usage: specfleet models matrix" in matrix.stdout and "--models" in matrix.stdout
    parent = run("models", "--help")
    assert parent.returncode == 0 and "{build,matrix}" in parent.stdout


def test_a_quick_build_refuses_to_replace_the_bundled_demo_models(tmp_path):
    target = REPO / "models" / "demo" / "target" / "model.safetensors"
    before = target.stat().st_mtime_ns if target.exists() else None
    # --stop-after corpus: should the refusal ever go, the build stops after writing corpora
    # into tmp_path, before it could write a model over the bundled ones.
    result = run("models", "build", "--quick", "--work", str(tmp_path / "work"), "--stop-after", "corpus", timeout=300)
    assert result.returncode == 2
    assert "--overwrite-demo" in result.stderr and "--out" in result.stderr
    assert (target.stat().st_mtime_ns if target.exists() else None) == before


def test_the_bench_lists_every_command_it_has():
    bench = run("bench", "--help")
    assert bench.returncode == 0 and "{run,compare,single-stream,engine,workload,vllm-setup,docs}" in bench.stdout
    engine = run("bench", "engine", "--help")
    assert engine.returncode == 0 and "usage: specfleet bench engine" in engine.stdout
