"""`specfleet bench engine`: one forward pass timed against transformers' and the floor, run as a user runs it.

The tiny shape keeps it to seconds on one CPU core; scripts/device-check runs the 1B and 8B
shapes on a GPU. What is checked is what the numbers mean, not how fast anything is.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.harness import REPO
from tools.bench.engine import markdown as engine_markdown

DEVICE = os.environ.get("SPECFLEET_TEST_DEVICE", "cpu")


def _bench(tmp_path, *extra) -> tuple[dict, str]:
    out = tmp_path / "engine.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "specfleet.cli",
            "bench",
            "engine",
            "--shape",
            "tiny",
            "--sessions",
            "1,3",
            "--tokens",
            "1,4",
            "--context",
            "24",
            "--device",
            DEVICE,
            "--dtype",
            "float32",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--json",
            str(out),
            *extra,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


def test_engine_bench_times_both_passes_which_agree(tmp_path):
    results, table = _bench(tmp_path, "--attention", "per-session,batched", "--profile", "3,4")
    assert [(r["sessions"], r["tokens"]) for r in results["rows"]] == [(1, 1), (1, 4), (3, 1), (3, 4)]
    # --profile: the row it names, in each mode, its dearest operations (the matrix products among them) per pass.
    assert [("profile" in r) for r in results["rows"]] == [False, False, False, True]
    for prof in results["rows"][-1]["profile"].values():
        assert prof["total_ms"] > 0 and any(op["op"] in ("aten::mm", "aten::addmm") for op in prof["ops"])
        assert sum(op["ms"] for op in prof["ops"]) <= prof["total_ms"] + 1e-3
    assert "Where a pass of 3 x 4 (batched)" in engine_markdown(results)
    assert results["dtype"] == "float32" and results["device"].startswith(DEVICE)
    for row in results["rows"]:
        assert row["context"] == 24
        assert row["specfleet_ms"] > 0 and row["transformers_ms"] > 0 and row["floor_ms"] > 0
        assert set(row["attention"]) == {"per-session", "batched"} and row["specfleet_ms"] == min(row["attention"].values())
        # Same weights, same cached keys and values, same new tokens: the same logits, in both attention modes.
        assert row["max_abs_logit_diff"] < 1e-3
    assert "specfleet / floor" in table and "3 x 4" in table and "specfleet batched ms" in table


def test_engine_bench_floor_is_the_larger_of_memory_and_compute_time(tmp_path):
    # 1 GB/s and 1 GFLOP/s: both terms are milliseconds, the memory one grows with sessions x context
    # and the compute one with sessions x tokens.
    results, _ = _bench(tmp_path, "--bandwidth-gbs", "1", "--peak-tflops", "0.001", "--no-transformers")
    assert results["hardware_source"] == "bandwidth: given, peak: given"
    params = results["parameters"]
    kv_per_position = 2 * 2 * 2 * 16 * 4  # layers x (k, v) x KV heads x head dim x float32 bytes
    for row in results["rows"]:
        b, n = row["sessions"], row["tokens"]
        memory_ms = (params * 4 + b * (24 + n) * kv_per_position) / 1e9 * 1e3
        compute_ms = 2 * params * b * n / 1e9 * 1e3
        assert abs(row["floor_ms"] - max(memory_ms, compute_ms)) < 1e-9 * max(memory_ms, compute_ms) + 1e-12
        assert "transformers_ms" not in row
    # The tiny shape is compute-bound at 3 x 4 on this made-up machine and memory-bound at 1 x 1.
    by_shape = {(r["sessions"], r["tokens"]): r for r in results["rows"]}
    assert by_shape[(3, 4)]["floor_ms"] == 2 * params * 12 / 1e6
    assert by_shape[(1, 1)]["floor_ms"] > 2 * params / 1e6


def test_engine_bench_times_the_cuda_graph_replay_or_says_it_needs_cuda(tmp_path):
    if not DEVICE.startswith("cuda"):
        result = subprocess.run(
            [sys.executable, "-m", "specfleet.cli", "bench", "engine", "--shape", "tiny", "--device", "cpu", "--attention", "graph"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2 and "CUDA graphs need a CUDA device, not cpu" in result.stderr
        return
    # On a GPU (scripts/device-check): the replayed graph computes what the eager pass computes.
    results, table = _bench(tmp_path, "--attention", "batched,graph")
    for row in results["rows"]:
        assert set(row["attention"]) == {"batched", "graph"} and row["max_abs_logit_diff"] < 1e-3
    assert "specfleet graph ms" in table
