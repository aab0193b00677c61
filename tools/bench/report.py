"""Results out: JSON, a Markdown table, PNG plots, and marked blocks of docs/benchmarks/NAME.md."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess

from tools.bench.passes import passes_table

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
DOCS_DIR = REPO / "docs" / "benchmarks"  # one file per block; docs/BENCHMARKS.md summarises them


def machine_info() -> dict:
    cpu = platform.processor() or "unknown"
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": None,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        mem = pathlib.Path("/proc/meminfo").read_text().splitlines()[0].split()[1]
        info["memory_gib"] = round(int(mem) / 2**20, 1)
        info["load_avg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except (OSError, IndexError, ValueError):
        pass
    try:
        import torch
        import transformers

        info["torch"] = torch.__version__
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        info["git_dirty"] = bool(dirty)
    except OSError:
        pass
    return info


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


# --- the table ---------------------------------------------------------------------------------------------------


def _f(x, fmt="{:.1f}", none="–"):
    return none if x is None else fmt.format(x)


def check_cell(m: dict) -> str:
    if m.get("status") != "ok":
        return "–"
    bits = []
    if m["mismatches"]:
        bits.append(f"**MISMATCH {m['mismatches']}/{m['checked']}**")
    elif m["checked"]:
        bits.append(f"ok {m['checked']}/{m['checked']}")
    else:
        bits.append("unchecked")
    if m["errors"]:
        bits.append(f"**{m['errors']} errors**")
    return ", ".join(bits)


def results_table(results: dict) -> str:
    head = (
        "| system | load | out tok/s | × " + results["baseline"] + " | TTFT p50 ms | TPOT p50 ms | latency p50 / p90 / p99 ms "
        "| accept rate | accepted / verify | verifier busy | per round: draft / verify / network ms | exact vs target |"
    )
    lines = [head, "|" + "---|" * 12]
    for run in results["runs"]:
        if run.get("status") != "ok":
            lines.append(f"| {run['label']} | {run.get('load', '–')} | {run['status']}: {run.get('message', '')[:160]} |" + " |" * 9 + " |")
            continue
        s = run.get("speculation") or {}
        pr = s.get("per_round_ms") or {}
        rounds = "–"
        if pr:
            rounds = f"{_f(pr['draft_wall'])} / {_f(pr['verify_wall'])} / {_f(pr['network'])}"
        lat = run["latency_ms"]
        lines.append(
            f"| {run['label']} | {run['load']} | {_f(run['tokens_per_s'])} | {_f(run.get('speedup'), '{:.2f}×')} "
            f"| {_f(run['ttft_ms']['p50'])} | {_f(run['tpot_ms']['p50'], '{:.2f}')} "
            f"| {_f(lat['p50'], '{:.0f}')} / {_f(lat['p90'], '{:.0f}')} / {_f(lat['p99'], '{:.0f}')} "
            f"| {_f(s.get('acceptance_rate'), '{:.0%}')} | {_f(s.get('accepted_per_verification'), '{:.2f}')} "
            f"| {_f(s.get('verifier_busy_fraction'), '{:.0%}')} | {rounds} | {check_cell(run)} |"
        )
    return "\n".join(lines)


def domain_table(results: dict) -> str:
    rows = []
    for run in results["runs"]:
        for key, d in ((run.get("speculation") or {}).get("per_domain") or {}).items():
            rows.append(
                f"| {run['label']} | {run['load']} | {d['domain']} | {d['drafter']} | {d['rounds']} | {d['draft_tokens']} "
                f"| {d['accepted_tokens']} | {_f(d['acceptance_rate'], '{:.0%}')} | {_f(d['accepted_per_verification'], '{:.2f}')} |"
            )
    routing = []
    for run in results["runs"]:
        routed = (run.get("speculation") or {}).get("routed_domains") or {}
        if any(k != "(none)" for v in routed.values() for k in v):
            pairs = ", ".join(f"{true}→{got} {n}" for true, v in sorted(routed.items()) for got, n in sorted(v.items()))
            routing.append(f"- {run['label']} at {run['load']}: workload domain → router's domain (requests): {pairs}")
    if not rows:
        return ""
    return "\n".join(
        [
            "| system | load | domain | drafter | rounds | drafted | accepted | accept rate | accepted / verify |",
            "|" + "---|" * 9,
            *rows,
            *([""] + routing if routing else []),
        ]
    )


def round_table(results: dict) -> str:
    """Where a speculative round's time goes: draft and verify calls, each split into the server's compute,
    the server's queue and transport, and the router's own time. Results from before queue and router time
    were measured show their network (queue and transport together) in the transport column."""
    rows = []
    for run in results["runs"]:
        s = run.get("speculation") or {}
        pr = s.get("per_round_ms")
        if not pr or not s.get("rounds"):
            continue
        measured = "router" in pr
        dq, vq = pr.get("draft_queue"), pr.get("verify_queue")
        dt, vt = (pr["draft_transport"], pr["verify_transport"]) if measured else (pr["draft_network"], pr["verify_network"])
        total = (pr["draft_wall"] or 0) + (pr["verify_wall"] or 0) + (pr.get("router") or 0)

        def share(ms):
            return f"{_f(ms, '{:.2f}')} ({_f(ms / total if ms is not None and total else None, '{:.0%}')})"

        rows.append(
            f"| {run['label']} | {run['load']} | {s['rounds'] / max(1, run['requests']):.1f} | {_f(s.get('tokens_per_round'), '{:.2f}')} "
            f"| {_f(pr['draft_wall'], '{:.2f}')} = {_f(pr['draft_compute'], '{:.2f}')} + {_f(dq, '{:.2f}')} + {_f(dt, '{:.2f}')} "
            f"| {_f(pr['verify_wall'], '{:.2f}')} = {_f(pr['verify_compute'], '{:.2f}')} + {_f(vq, '{:.2f}')} + {_f(vt, '{:.2f}')} "
            f"| {share(pr.get('queue'))} | {share(pr['transport'] if measured else pr['network'])} | {share(pr.get('router'))} |"
        )
    if not rows:
        return ""
    return "\n".join(
        [
            "| system | load | rounds / request | tokens / round | draft ms = compute + queue + transport "
            "| verify ms = compute + queue + transport | queue ms (share of round) | transport ms (share) | router ms (share) |",
            "|" + "---|" * 9,
            *rows,
        ]
    )


def _rel(path: str) -> str:
    try:
        return str(pathlib.Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def markdown(results: dict, plots: dict[str, str] | None = None, heading: str = "###") -> str:
    mach = results["machine"]
    cfg = results["config"]
    lines = [
        f"{heading} {results['title']}",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Machine: {mach['cpu']}, {mach['logical_cpus']} logical CPUs ({mach['usable_cpus']} usable), "
        f"{mach.get('memory_gib', '?')} GiB; load average at start {mach.get('load_avg_at_start', '?')}; "
        f"torch {mach.get('torch', '?')}, transformers {mach.get('transformers', '?')}; commit {mach.get('git_commit', '?')}"
        f"{' (with uncommitted changes)' if mach.get('git_dirty') else ''}. Date: {results['date']}.",
        "",
        f"Models: {cfg['models']} (target `{_rel(cfg['target'])}`, drafter `{cfg['drafter']}`). "
        f"Workload: {cfg['workload']} ({cfg['requests']} requests per load point, {cfg['prompt_tokens']} prompt tokens, "
        f"{cfg['max_tokens']} new tokens (medians), {'EOS ignored' if cfg['ignore_eos'] else 'stop at EOS'}, "
        f"{'temperature ' + str(cfg['temperature']) if cfg.get('temperature') else 'greedy'}, seed {cfg['seed']}, "
        f"{cfg['warmup']} warm-up requests). Every system: {cfg['threads']} thread(s), cores {cfg['cpus'] or 'unpinned'}, "
        f"at most k = {cfg['k']} draft tokens per round (specfleet's adaptive speculation may draft fewer).",
        "",
        results_table(results),
        "",
    ]
    across = passes_table(results)
    if across:
        lines += ["Across passes (median of the passes, min–max; each ratio against the baseline's run in the same pass):", "", across, ""]
    rt = round_table(results)
    if rt:
        lines += [
            "Per speculative round (router's view; compute is the servers' forward passes, queue the calls' waits for the "
            "servers' model threads before those passes (their batch queues), transport the rest of "
            "the calls' wall time: serialisation, gRPC, event loops, waiting for a CPU; router is the router's own time in "
            "the round, beside its calls):",
            "",
            rt,
            "",
        ]
    dt = domain_table(results)
    if dt:
        lines += ["Acceptance by domain:", "", dt, ""]
    notes = list(results.get("notes") or [])
    if any(((r.get("speculation") or {}).get("verifier_busy_fraction") or 0) > 1.0 for r in results["runs"]):
        notes.append(
            "Verifier busy above 100% is impossible for one verifier thread: the router's verify_busy_seconds_total "
            "adds a merged verifier batch's compute once per calling lane, so it over-counts under concurrency."
        )
    if notes:
        lines += [f"- {n}" for n in notes] + [""]
    failures = results.get("failures") or []
    if failures:
        lines += ["**Check failures:**", ""] + [f"- {f}" for f in failures] + [""]
    for name, path in (plots or {}).items():
        lines.append(f"![{name}]({path})")
    return "\n".join(lines).rstrip() + "\n"


# --- plots -------------------------------------------------------------------------------------------------------


def plots(results: dict, out_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    out_dir.mkdir(parents=True, exist_ok=True)
    made = {}
    ok = [r for r in results["runs"] if r.get("status") == "ok"]
    labels = list(dict.fromkeys(r["label"] for r in ok))

    def series(kind: str, metric):
        data = {}
        for label in labels:
            pts = sorted((r["load_value"], metric(r)) for r in ok if r["label"] == label and r["load_kind"] == kind and metric(r) is not None)
            if pts:
                data[label] = pts
        return data

    subtitle = f"{results['config']['models']} models, {results['config']['workload']}, {results['machine']['cpu']}"

    def spread(data) -> bool:  # a curve needs two load points at least
        return len({x for pts in data.values() for x, _ in pts}) >= 2

    lat = series("open", lambda r: r["latency_ms"]["p50"])
    if spread(lat):
        fig, ax = plt.subplots(figsize=(9, 4.8))
        for label, pts in lat.items():
            p99 = dict(series("open", lambda r: r["latency_ms"]["p99"]).get(label, []))
            line = ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=f"{label} p50")[0]
            ax.plot(list(p99), list(p99.values()), marker="x", linestyle="--", color=line.get_color(), alpha=0.6, label=f"{label} p99")
        ax.set_xlabel("offered load (requests/s, Poisson)")
        ax.set_ylabel("request latency (ms)")
        ax.set_title(f"Latency against load\n{subtitle}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        made["latency vs load"] = out_dir / "latency_vs_load.png"
        fig.savefig(made["latency vs load"], dpi=110)
        plt.close(fig)
    thr = series("closed", lambda r: r["tokens_per_s"])
    if spread(thr):
        fig, ax = plt.subplots(figsize=(9, 4.8))
        for label, pts in thr.items():
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
        ax.set_xticks(sorted({x for pts in thr.values() for x, _ in pts}))
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"Throughput against concurrency\n{subtitle}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        made["throughput vs concurrency"] = out_dir / "throughput_vs_concurrency.png"
        fig.savefig(made["throughput vs concurrency"], dpi=110)
        plt.close(fig)
    # acceptance by domain: first load point of each speculative system
    acc: dict[str, dict[str, float]] = {}
    for r in ok:
        per_domain = (r.get("speculation") or {}).get("per_domain") or {}
        if not per_domain or r["label"] in acc:
            continue
        by_domain: dict[str, list[int]] = {}
        for d in per_domain.values():
            tot = by_domain.setdefault(d["domain"], [0, 0])
            tot[0] += d["accepted_tokens"]
            tot[1] += d["draft_tokens"]
        acc[r["label"]] = {dom: a / n for dom, (a, n) in by_domain.items() if n}
    if acc:
        domains = sorted({d for v in acc.values() for d in v})
        fig, ax = plt.subplots(figsize=(9, 4.8))
        width = 0.8 / len(acc)
        for i, (label, vals) in enumerate(acc.items()):
            ax.bar([j + i * width for j in range(len(domains))], [vals.get(d, 0) for d in domains], width, label=label)
        ax.set_xticks([j + width * (len(acc) - 1) / 2 for j in range(len(domains))], domains)
        ax.set_ylabel("acceptance rate (accepted / drafted)")
        ax.set_ylim(0, 1)
        ax.set_title(f"Acceptance by domain\n{subtitle}", fontsize=9)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        made["acceptance by domain"] = out_dir / "acceptance_by_domain.png"
        fig.savefig(made["acceptance by domain"], dpi=110)
        plt.close(fig)
    return made


# --- docs/benchmarks/NAME.md -------------------------------------------------------------------------------------

_HEADER = """# {block}

Measured by `specfleet bench`. The block between `<!-- bench:begin {block} -->` and
`<!-- bench:end {block} -->` is rewritten by `specfleet bench ... --update-docs {block}`;
everything outside it is kept as written. docs/BENCHMARKS.md links here from its summary.
"""


def update_docs(block: str, body: str, plots: dict[str, pathlib.Path] | None = None, docs: pathlib.Path | None = None) -> pathlib.Path:
    """Replace (or append) the marked block NAME in docs (default docs/benchmarks/NAME.md, created if absent);
    plots are copied to plots/NAME/ beside that file."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", block):
        raise ValueError(f"docs block name {block!r}: use letters, digits, '.', '_' or '-'")
    docs = DOCS_DIR / f"{block}.md" if docs is None else docs
    links = {}
    if plots:
        pdir = docs.parent / "plots" / block
        pdir.mkdir(parents=True, exist_ok=True)
        for stale in pdir.glob("*.png"):
            stale.unlink()
        for name, path in plots.items():
            shutil.copy(path, pdir / pathlib.Path(path).name)
            links[name] = f"plots/{block}/{pathlib.Path(path).name}"
    if links:
        body = body.rstrip() + "\n\n" + "\n".join(f"![{n}]({p})" for n, p in links.items()) + "\n"
    begin, end = f"<!-- bench:begin {block} -->", f"<!-- bench:end {block} -->"
    text = docs.read_text() if docs.exists() else _HEADER.format(block=block)
    new_block = f"{begin}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: new_block, text, count=1)
    else:
        text = text.rstrip() + "\n\n" + new_block + "\n"
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(text)
    return docs


def write_partial(results: dict, out_dir: pathlib.Path) -> None:
    """results.json and results.md of the runs measured so far, without plots; `write_results` replaces them at the end."""
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = {**results, "partial": True, "notes": [*results["notes"], "Partial: the runs measured before the benchmark ended early."]}
    (out_dir / "results.json").write_text(json.dumps(partial, indent=1, default=str))
    (out_dir / "results.md").write_text(markdown(partial, {}))


def write_results(results: dict, out_dir: pathlib.Path) -> dict[str, pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    made = plots(results, out_dir)
    results["plots"] = {k: str(v) for k, v in made.items()}
    paths["json"].write_text(json.dumps(results, indent=1, default=str))
    paths["markdown"].write_text(markdown(results, {k: v.name for k, v in made.items()}))
    paths.update({f"plot: {k}": v for k, v in made.items()})
    return paths
