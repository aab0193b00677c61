"""scripts/device-check's CPU path, reduced (--quick --device cpu): every step runs and reports, so the
script is known to work before it reaches the GPU machine it is written for."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO


def test_device_check_quick_on_cpu_runs_every_step(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "scripts/device-check", str(out), "--quick", "--device", "cpu", "--wheels", str(tmp_path / "no-wheels")],
        cwd=REPO, capture_output=True, text=True, timeout=1800,
    )
    report = json.loads((out / "device-check.json").read_text())
    assert result.returncode == 0, (report["steps"], (out / "device-check.log").read_text()[-4000:])
    assert [s["name"] for s in report["steps"]] == ["environment", "engine tests", "bench engine tiny", "serve and bench"]
    assert all(s["status"] == "ok" for s in report["steps"])
    tests = report["steps"][1]["summary"]
    assert tests["tests"] >= 4 and tests["failures"] == tests["errors"] == 0
    assert len(report["engine"]["tiny"]["rows"]) == 4
    # Greedy outputs were checked against transformers generate at both loads, for both specfleet systems.
    runs = {(r["label"], r["load"]): r for r in report["serve"]["runs"]}
    for label in ("specfleet", "specfleet-off"):
        for load in ("c1", "c2"):
            assert runs[(label, load)]["status"] == "ok" and runs[(label, load)]["checked"] == 2 and runs[(label, load)]["mismatches"] == 0
    assert any(bar["what"].startswith("single-stream tokens/s") for bar in report["bars"])
    md = (out / "device-check.md").read_text()
    assert "## device check: cpu (quick)" in md and "| serve and bench | ok |" in md and "### bench engine, tiny" in md
