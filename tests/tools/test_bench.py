"""`specfleet bench` on a tiny workload: it runs, it measures, and its exactness check can fail."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools.bench import main as bench_main
from tools.bench import report, runner, workload
from tests.harness import DRAFTING_PAYS, REPO


def test_builtin_workload_names_win_over_folders_of_that_name(tmp_path, monkeypatch):
    """A workload name that is also a folder in the working directory (as `docs` is at the repository root)."""
    (tmp_path / "code").mkdir()
    monkeypatch.chdir(tmp_path)
    source, rows = workload.resolve_source("code")
    assert source.endswith("code.jsonl") and rows and {r["domain"] for r in rows} == {"code"}


def test_workloads_are_files_that_replay(tmp_path):
    source, rows = workload.resolve_source("mixed")
    assert rows and all("text" in r and r.get("domain") in workload.DOMAINS for r in rows), source
    assert {r["domain"] for r in rows} == set(workload.DOMAINS)
    a = workload.make_requests(rows, 7, prompt_tokens=16, max_tokens=8, seed=3)
    b = workload.make_requests(rows, 7, prompt_tokens=16, max_tokens=8, seed=3)
    assert [r.to_json() for r in a] == [r.to_json() for r in b]
    assert [r.id for r in a] != [r.id for r in workload.make_requests(rows, 7, 16, 8, seed=4)]
    for r, t in zip(a, workload.poisson_arrivals(len(a), 2.0, seed=3)):
        r.arrival_s = t
    path = tmp_path / "saved.jsonl"
    workload.save(a, path)
    _, replay_rows = workload.resolve_source(str(path))
    c = workload.make_requests(replay_rows, 7, prompt_tokens=99, max_tokens=99, seed=0)
    assert sorted((r.text, r.max_tokens, r.prompt_tokens, r.arrival_s) for r in c) == sorted((r.text, 8, 16, r.arrival_s) for r in a)
    arrivals = workload.poisson_arrivals(2000, 4.0, seed=1)
    assert arrivals == sorted(arrivals) and 400 < arrivals[-1] < 600  # about 2000 / 4 s
    # the fallback list covers every domain when files are absent
    assert {d for d, _ in workload.FALLBACK_PROMPTS} == set(workload.DOMAINS)


def test_compare_and_percentiles():
    assert runner.compare([1, 2, 3], [1, 2, 3], eos=0) is None
    assert runner.compare([1, 2, 3, 0], [1, 2, 3], eos=0) is None  # a trailing EOS is not a difference
    assert runner.compare([1, 9, 3], [1, 2, 3], eos=0) == 1
    assert runner.compare([1, 2], [1, 2, 3], eos=0) == 2
    assert runner.pct([1, 2, 3, 4, 5], 50) == 3
    assert runner.pct([10.0], 99) == 10.0


def test_docs_blocks_keep_hand_written_text(tmp_path):
    docs = tmp_path / "BENCHMARKS.md"
    docs.write_text("# Benchmarks\n\nWritten by hand.\n")
    report.update_docs("one", "first table\n", docs=docs)
    report.update_docs("two", "second table\n", docs=docs)
    report.update_docs("one", "first table, again\n", docs=docs)
    text = docs.read_text()
    assert "Written by hand." in text
    assert "first table, again" in text and "first table\n" not in text
    assert text.index("<!-- bench:begin one -->") < text.index("<!-- bench:begin two -->")
    assert text.count("<!-- bench:end one -->") == 1
    with pytest.raises(ValueError):
        report.update_docs("bad name", "x", docs=docs)


def test_docs_block_goes_to_a_file_of_its_own(tmp_path, monkeypatch):
    """Without docs=, block NAME is written to docs/benchmarks/NAME.md, its plots to plots/NAME/ beside it."""
    monkeypatch.setattr(report, "DOCS_DIR", tmp_path / "benchmarks")
    plot = tmp_path / "acceptance_by_domain.png"
    plot.write_bytes(b"png")
    path = report.update_docs("one", "a table\n", {"acceptance by domain": plot})
    assert path == tmp_path / "benchmarks" / "one.md"
    text = path.read_text()
    assert text.startswith("# one\n") and "<!-- bench:begin one -->\na table" in text
    assert "![acceptance by domain](plots/one/acceptance_by_domain.png)" in text
    assert (tmp_path / "benchmarks" / "plots" / "one" / "acceptance_by_domain.png").read_bytes() == b"png"
    report.update_docs("two", "another\n")
    assert (tmp_path / "benchmarks" / "two.md").exists() and "another" not in path.read_text()


def test_smoke_run_measures_and_catches_a_wrong_output(random_family, cluster, tmp_path, capsys):
    """Target alone, a deliberately wrong system and a running specfleet cluster, at three load points."""
    root = random_family["target"].parent
    out = tmp_path / "out"
    argv = [
        "run",
        "--models",
        str(root),
        "--drafter",
        "drafter-noisy",
        "--systems",
        "hf-target,corrupt",
        "--attach",
        f"specfleet={cluster.router}",
        "--attach",
        f"specfleet-off={cluster.router}:off",
        "--workload",
        "mixed",
        "--requests",
        "4",
        "--prompt-tokens",
        "12",
        "--max-tokens",
        "10",
        "--warmup",
        "1",
        "--concurrency",
        "1,2",
        "--rates",
        "25,50",
        "--out",
        str(out),
        "--no-progress",
    ]
    code = bench_main(argv)
    printed = capsys.readouterr()
    assert code == 3, "a mismatch must make the exit code non-zero"
    assert "OUTPUT MISMATCH" in printed.err
    results = json.loads((out / "results.json").read_text())
    runs = {(r["label"], r["load"]): r for r in results["runs"]}
    assert set(runs) == {(s, p) for s in ("hf-target", "corrupt", "specfleet", "specfleet-off") for p in ("c1", "c2", "r25", "r50")}
    for (label, load), r in runs.items():
        assert r["status"] == "ok" and r["errors"] == 0 and r["checked"] == 4, (label, load, r)
        assert r["output_tokens"] == 40 and r["tokens_per_s"] > 0
        for key in ("ttft_ms", "tpot_ms", "latency_ms"):
            assert r[key]["p50"] is not None and r[key]["p99"] >= r[key]["p50"] > 0
        assert r["mismatches"] == (4 if label == "corrupt" else 0), (label, load, r["mismatch_examples"])
        assert r["speedup"] > 0
    spec = runs[("specfleet", "c1")]["speculation"]
    assert spec["draft_tokens"] > 0 and 0 <= spec["acceptance_rate"] <= 1
    assert "drafter-noisy" in spec["per_drafter"] and spec["per_domain"]
    assert 0 < spec["verifier_busy_fraction"] <= 1
    assert set(spec["per_round_ms"]) >= {"draft_wall", "verify_wall", "network", "queue", "transport", "router"}
    assert all(spec["per_round_ms"][k] >= 0 for k in ("draft_queue", "verify_queue", "router"))
    assert runs[("specfleet-off", "c1")]["speculation"]["draft_tokens"] == 0
    md = (out / "results.md").read_text()
    assert "**MISMATCH 4/4**" in md and "ok 4/4" in md and "specfleet bench run" in md
    assert "| queue ms (share of round) | transport ms (share) | router ms (share) |" in md
    assert (out / "throughput_vs_concurrency.png").stat().st_size > 0
    assert (out / "latency_vs_load.png").stat().st_size > 0
    assert (out / "acceptance_by_domain.png").stat().st_size > 0


def test_interleave_runs_each_load_point_on_every_system_in_turn(random_family, tmp_path):
    """With --repeat, every pass runs every point on every system, the systems' order reversed each
    other pass, and each repeat's ratios are against the baseline of the same pass."""
    root = random_family["target"].parent
    out = tmp_path / "out"
    code = bench_main(
        [
            "run",
            "--models",
            str(root),
            "--systems",
            "hf-target,corrupt",
            "--interleave",
            "--repeat",
            "2",
            "--allow-mismatch",
            "--requests",
            "2",
            "--prompt-tokens",
            "8",
            "--max-tokens",
            "4",
            "--warmup",
            "1",
            "--concurrency",
            "1,2",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["load"], r["label"]) for r in runs] == [
        ("c1", "hf-target"),
        ("c1", "corrupt"),
        ("c2", "hf-target"),
        ("c2", "corrupt"),
        ("c1#2", "corrupt"),
        ("c1#2", "hf-target"),
        ("c2#2", "corrupt"),
        ("c2#2", "hf-target"),
    ]
    assert all(r["status"] == "ok" and r["mismatches"] == (2 if r["label"] == "corrupt" else 0) for r in runs)
    by_key = {(r["load"], r["label"]): r for r in runs}
    again = by_key[("c2#2", "corrupt")]
    assert again["speedup"] == pytest.approx(again["tokens_per_s"] / by_key[("c2#2", "hf-target")]["tokens_per_s"])
    # Across the passes: each point's median of the paired ratios, in the JSON and in the Markdown.
    across = {(row["label"], row["load"]): row for row in json.loads((out / "results.json").read_text())["across_passes"]}
    ratios = sorted(by_key[(load, "corrupt")]["speedup"] for load in ("c2", "c2#2"))
    assert across[("corrupt", "c2")]["ratio"]["median"] == pytest.approx(sum(ratios) / 2)
    assert "Across passes" in (out / "results.md").read_text()


def test_missing_vllm_is_reported_not_fatal(random_family, tmp_path, capsys):
    root = random_family["target"].parent
    out = tmp_path / "out"
    code = bench_main(
        [
            "run",
            "--models",
            str(root),
            "--systems",
            "hf-target,vllm-target",
            "--vllm-venv",
            str(tmp_path / "no-venv"),
            "--requests",
            "2",
            "--prompt-tokens",
            "8",
            "--max-tokens",
            "4",
            "--warmup",
            "0",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    vllm_run = next(r for r in results["runs"] if r["label"] == "vllm-target")
    assert vllm_run["status"] == "unavailable" and "vllm-setup" in vllm_run["message"]
    assert "vllm-target" in capsys.readouterr().out


def test_vllm_spec_decode_counters_are_parsed():
    from tools.bench.vllm import parse_metrics

    text = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 13.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="target"} 1.7e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 52.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="target"} 34.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 12.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 10.0
vllm:generation_tokens_total{engine="0",model_name="target"} 48.0
vllm:num_requests_running{engine="0",model_name="target"} 0.0
"""
    m = parse_metrics(text)
    assert m == {
        "vllm:spec_decode_num_drafts": 13.0,
        "vllm:spec_decode_num_draft_tokens": 52.0,
        "vllm:spec_decode_num_accepted_tokens": 34.0,
        "vllm:spec_decode_num_accepted_tokens_per_pos": 22.0,
        "vllm:generation_tokens": 48.0,
    }
    delta = runner.counters_delta({"vllm:spec_decode_num_draft_tokens": 50.0}, m)
    assert delta["vllm:spec_decode_num_draft_tokens"] == 2.0


def test_router_counters_are_parsed():
    from tools.bench.systems import parse_prometheus

    text = """# TYPE specfleet:rounds_total counter
specfleet:rounds_total 120
specfleet:verify_busy_seconds_total 0.75
specfleet:drafter_draft_tokens_total{domain="code",drafter="code"} 10
specfleet:drafter_draft_tokens_total{domain="prose",drafter="code"} 5
specfleet:expertise_acceptance{domain="code",drafter="code"} NaN
other_metric 3
"""
    assert parse_prometheus(text, "specfleet:") == {
        "specfleet:rounds_total": 120.0,
        "specfleet:verify_busy_seconds_total": 0.75,
        "specfleet:drafter_draft_tokens_total": 15.0,
    }


@pytest.mark.parametrize("first", ["tools.bench.vllm", "tools.bench.systems"])
def test_bench_modules_import_in_either_order(first):
    """`specfleet bench vllm-setup` imports bench/vllm.py before bench/systems.py; either order gives every system."""
    code = f"import {first}; from tools.bench.catalog import SYSTEMS; print(' '.join(sorted(SYSTEMS)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert {"vllm-target", "vllm-draft", "vllm-ngram", "specfleet"} <= set(out.stdout.split())


def test_a_run_cut_short_keeps_the_load_points_it_measured(random_family, tmp_path, monkeypatch):
    """results.json is rewritten after every measured load point: a run ended early (the GPU check's deadline, Ctrl-C)
    still reports what it measured, marked partial."""
    calls, run_load = [], runner.run_load

    async def ended_at_the_second_point(system, requests, point, *args):
        calls.append(point.value)
        if len(calls) == 3:  # the warm-up, c1, then c2
            raise RuntimeError("the deadline passed")
        return await run_load(system, requests, point, *args)

    monkeypatch.setattr(runner, "run_load", ended_at_the_second_point)
    out = tmp_path / "out"
    argv = ["run", "--models", str(random_family["target"].parent), "--systems", "hf-target", "--requests", "2", "--prompt-tokens", "8"]
    with pytest.raises(RuntimeError, match="deadline"):
        bench_main([*argv, "--max-tokens", "4", "--warmup", "1", "--concurrency", "1,2", "--out", str(out), "--no-progress"])
    results = json.loads((out / "results.json").read_text())
    assert results["partial"] and [(r["label"], r["load"], r["status"]) for r in results["runs"]] == [("hf-target", "c1", "ok")]
    assert "Partial" in (out / "results.md").read_text()


def test_the_demo_fleet_system_routes_as_serve_s_embedded_default(tmp_path):
    """`specfleet-multi` on the bundled family is what the docs call the default: `specfleet serve`'s routing
    settings with no config; --set still changes them; a single drafter's system routes with the config's defaults."""
    from specfleet.config.runtime import default_config
    from tools.bench import runner, systems

    family = runner.resolve_family("demo", None, tmp_path)
    routing = default_config(tmp_path).router.routing
    router = systems.SpecfleetMulti(family, systems.Settings()).config()["router"]
    assert (router["fusion_width"], router["fusion_depth"]) == (routing.fusion_width, routing.fusion_depth)
    assert routing.fusion_width > 1  # the default fuses: a system without its settings would measure something else
    changed = systems.SpecfleetMulti(family, systems.Settings(), overrides=[("router.fusion_width", 1)]).config()["router"]
    assert changed["fusion_width"] == 1
    assert "fusion_width" not in systems.Specfleet(family, systems.Settings()).config()["router"]


def test_sampled_requests_carry_a_seed_each_unless_unseeded(tmp_path):
    """specfleet's requests at temperature > 0 carry a seed per request (the exponential race), the same one every time
    it is sent; with --unseeded (Settings.seeded False) none, so the front door takes rejection sampling."""
    from tools.bench import runner, systems
    from tools.bench.workload import Request

    family = runner.resolve_family("demo", None, tmp_path)
    req = Request(id="code-3", domain="code", text="x", max_tokens=4, prompt_tokens=1, prompt_ids=[5])
    seeded = systems.Specfleet(family, systems.Settings(temperature=1.0)).request(req)
    assert seeded.HasField("seed") and seeded.seed == systems.Specfleet(family, systems.Settings(temperature=1.0)).request(req).seed
    assert not systems.Specfleet(family, systems.Settings(temperature=1.0, seeded=False)).request(req).HasField("seed")


def test_a_json_schema_run_sends_every_system_the_schema_and_checks_them_against_the_masked_reference(random_family, cluster, tmp_path, capsys):
    """--json-schema: the greedy reference applies xgrammar's mask, specfleet (attached) is sent the guide, and its
    outputs match the reference token for token (an unguided output, which is no JSON, would not). Without
    --stop-at-eos the run is refused saying why."""
    schema = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}
    root = random_family["target"].parent
    common = ["--models", str(root), "--workload", "mixed", "--requests", "3", "--prompt-tokens", "12", "--max-tokens", "16"]
    common += ["--warmup", "0", "--concurrency", "1", "--no-progress", "--json-schema", json.dumps(schema), "--json-compact"]
    with pytest.raises(SystemExit, match="--json-schema needs --stop-at-eos"):
        bench_main(["run", *common, "--systems", "hf-target", "--out", str(tmp_path / "refused")])
    out = tmp_path / "out"
    argv = ["run", *common, "--stop-at-eos", "--systems", "hf-target", "--attach", f"specfleet={cluster.router}", "--out", str(out)]
    assert bench_main(argv) == 0, capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["json_schema"] == schema and results["config"]["json_compact"] is True
    for r in results["runs"]:
        assert r["status"] == "ok" and r["checked"] == 3 and r["mismatches"] == 0, (r["label"], r.get("mismatch_examples"))


def test_specfleet_through_its_http_api_is_measured_and_checked_as_through_grpc(random_family, tmp_path):
    """specfleet-http and specfleet-off-http: `specfleet serve` driven through /v1/completions by the client the vLLM
    systems use; outputs checked against the target alone, and the speculation statistics read from the final chunk."""
    root = random_family["target"].parent
    out = tmp_path / "out"
    argv = ["run", "--models", str(root), "--drafter", "drafter-noisy", "--systems", "hf-target,specfleet-http,specfleet-off-http"]
    argv += ["--requests", "3", "--prompt-tokens", "12", "--max-tokens", "10", "--warmup", "1", "--concurrency", "2"]
    argv += ["--out", str(out), "--no-progress"]
    # Drafting as k asks, whatever this machine measures (tests/harness.py's cost model where drafting pays).
    for key, value in {**DRAFTING_PAYS, "remeasure_every": 0}.items():
        argv += ["--set", f"router.{key}={str(value).lower()}"]
    assert bench_main(argv) == 0
    runs = {r["label"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    for label in ("specfleet-http", "specfleet-off-http"):
        r = runs[label]
        assert (r["status"], r["errors"], r["checked"], r["mismatches"], r["output_tokens"]) == ("ok", 0, 3, 0, 30), (label, r)
        assert r["ttft_ms"]["p50"] > 0
    assert runs["specfleet-http"]["speculation"]["draft_tokens"] > 0 and "drafter-noisy" in runs["specfleet-http"]["speculation"]["per_drafter"]
    assert runs["specfleet-off-http"]["speculation"]["draft_tokens"] == 0
