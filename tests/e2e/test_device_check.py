"""scripts/device-check on the GPU machine's Python, simulated on a CPU: every step runs and reports, inside its
deadline, with the packages that machine lacks hidden (tests/gpu_python/sitecustomize.py), so the check is known
to work before it reaches the machine it is written for."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from tests.harness import REPO

# What the GPU machine's Python lacks (the brief; docs/benchmarks/gpu.md).
MISSING = "fastapi,uvicorn,pydantic,starlette,redis,ray,openai,cryptography,uvloop"
# What may travel to the GPU machine at most (the tool's limit is 64 MiB; the rest is headroom for the carried wheels).
TRAVEL_LIMIT_MIB = 60


def device_check():
    loader = importlib.machinery.SourceFileLoader("device_check", str(REPO / "scripts" / "device-check"))
    spec = importlib.util.spec_from_loader("device_check", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def gpu_python_env() -> dict:
    return {
        **os.environ,
        "SPECFLEET_SIMULATE_MISSING": MISSING,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "gpu_python"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    }


def test_the_simulated_machine_lacks_the_packages():
    """The negative control of the simulation: without it the tests below would pass on any machine."""
    probe = "import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) for m in sys.argv[1].split(',')))"
    assert subprocess.run([sys.executable, "-c", probe, MISSING], env=gpu_python_env(), cwd=REPO).returncode == 0
    assert subprocess.run([sys.executable, "-c", probe, MISSING], cwd=REPO).returncode == 1


def test_every_service_module_imports_on_the_gpu_machines_python():
    check = device_check()
    done = subprocess.run(
        [sys.executable, "-c", check.ENVIRONMENT, "cpu", ",".join(check.MODULES)],
        env=gpu_python_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


# Each part's steps, as the GPU machine runs them (`--part 1`, then `--part 2`); as two tests, so that the test run's
# workers share them.
PART_STEPS = {
    "1": ["environment", "engine tests", "bench engine tiny", "serve and bench"],
    "2": ["environment", "fleet: collaboration", "fleet: pipelining", "bench engine tiny long"],
}
# Greedy outputs are checked against transformers generate in every run of every bench: (bench, system, load).
PART_RUNS = {
    "1": [("serve", label, load) for label in ("specfleet-fleet", "specfleet-off") for load in ("c1", "c2")],
    "2": [("collaboration", label, "c2") for label in ("general", "expertise", "expertise+fusion", "fusion-lockstep")]
    + [("pipelining", label, "c2") for label in ("coupled", "pipelined")],
}


@pytest.mark.timeout(1500)  # clusters start one after another; minutes on two shared cores
@pytest.mark.parametrize("part", sorted(PART_STEPS))
def test_device_check_quick_runs_every_step_on_the_gpu_machines_python(tmp_path, part):
    out = tmp_path / "out"
    command = ["scripts/device-check", str(out), "--part", part, "--quick", "--deadline", "1300", "--device", "cpu"]
    result = subprocess.run(
        [sys.executable, *command, "--wheels", str(tmp_path / "no-wheels")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1400,
        env=gpu_python_env(),
    )
    report = json.loads((out / "device-check.json").read_text())
    assert result.returncode == 0, (report["steps"], (out / "device-check.log").read_text()[-6000:])
    assert [s["name"] for s in report["steps"]] == PART_STEPS[part]
    assert all(s["status"] == "ok" for s in report["steps"])
    # As few files as the GPU machine returns (8 at most), the details packed.
    assert sorted(p.name for p in out.iterdir()) == ["details.tar.gz", "device-check.json", "device-check.log", "device-check.md"]
    runs = {(bench, r["label"], r["load"]): r for bench, b in report["benches"].items() for r in b["runs"]}
    for key in PART_RUNS[part]:
        assert runs[key]["status"] == "ok" and runs[key]["checked"] >= 2 and runs[key]["mismatches"] == 0, key
        assert key[1] == "specfleet-off" or runs[key]["per_round_ms"], key  # the round's draft, verify and network time
    whats = [bar["what"] for bar in report["bars"]]
    md = (out / "device-check.md").read_text()
    assert f"## device check, part {part}: cpu (quick)" in md
    if part == "1":
        tests = report["steps"][1]["summary"]
        assert tests["tests"] >= 4 and tests["failures"] == tests["errors"] == 0
        assert len(report["engine"]["tiny"]["rows"]) == 4
        assert sum(w.startswith("specfleet (all demo drafters) over transformers generate") for w in whats) == 2  # one a load
        assert "### bench engine, tiny" in md
    else:
        assert any(w.startswith("expertise + fusion over the general drafter") for w in whats)
        assert any(w.startswith("pipelined over coupled") for w in whats)
        assert "| fleet: pipelining | ok |" in md


def test_a_step_that_runs_out_ends_its_whole_process_tree(tmp_path):
    """The bench starts `specfleet serve` in a session of its own: a step that runs out must end it too, and
    nothing that ran before the step (here: a sleeper of this test's own)."""
    check = device_check()
    bystander = subprocess.Popen(["sleep", "300"])
    pid_file = tmp_path / "grandchild.pid"
    spawn = (
        f"import subprocess, time, pathlib; p = subprocess.Popen(['sleep', '300'], start_new_session=True); "
        f"pathlib.Path({str(pid_file)!r}).write_text(str(p.pid)); time.sleep(300)"
    )

    class Args:
        device, quick, part, wheels = "cpu", True, "1", str(tmp_path / "no-wheels")

    runner = check.Check(tmp_path / "out", Args, time.monotonic() + 60)
    try:
        started = time.monotonic()
        entry, _ = runner.step("sleeper", [sys.executable, "-c", spawn], dict(os.environ), 3)
        assert entry["status"].startswith("timed out") and time.monotonic() - started < 30
        grandchild = int(pid_file.read_text())
        assert not check.alive(grandchild), "the detached grandchild outlived its step"
        assert bystander.poll() is None, "the step's end took a process that was running before it"
    finally:
        runner.close()
        bystander.kill()
        bystander.wait()
    report = json.loads((tmp_path / "out" / "device-check.json").read_text())
    assert report["steps"][0]["name"] == "sleeper" and report["steps"][0]["status"].startswith("timed out")


def test_what_travels_to_the_gpu_machine_fits():
    """Tracked files plus untracked ones git does not ignore, plus the carried wheels, under TRAVEL_LIMIT_MIB."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    # A link travels as a link (the demo family's models link one shared tokenizer.json).
    size = sum((REPO / os.fsdecode(name)).lstat().st_size for name in listed if name and (REPO / os.fsdecode(name)).exists())
    mib = size / 2**20 + device_check().WHEELS_MIB
    assert mib < TRAVEL_LIMIT_MIB, f"{mib:.1f} MiB would travel to the GPU machine (at most {TRAVEL_LIMIT_MIB})"
