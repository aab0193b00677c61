"""specfleet bench engine: one forward pass, timed, against transformers and the memory/compute floor.

    specfleet bench engine --shape 8b --sessions 1,8,32,64 --tokens 1,5 --context 512 --device cuda --dtype bfloat16
    specfleet bench engine --model models/demo/target --sessions 1,32 --tokens 1,5 --context 128 --device cpu

For every (sessions B, new tokens n) at a cached context C per session, it times
(median of --repeats after --warmup):

  specfleet      `engine.forward_batch`: B sessions, each feeding n new tokens (a causal
                 chain, as a verify pass feeds a draft) after C cached positions; logits
                 stay on the device; once per --attention mode (auto, per-session, batched,
                 and on a GPU graph: the pass replayed as the verifier's CUDA graph of one
                 (B, n) bucket, with the host work a replay costs)
  transformers   the same weights through the Hugging Face module's forward (its default
                 attention, no compilation) with a DynamicCache holding the same C keys and
                 values per session, rebuilt before each call (untimed)
  floor          the larger of (weight + KV bytes) / memory bandwidth and
                 2 x parameters x B x n / peak FLOP/s: what the pass must cost at least

and the largest difference between the two passes' logits (a check that both
computed the same thing). Weights are random (from a shape name) or a model
directory's. Bandwidth and peak come from a table of known GPUs, from
--bandwidth-gbs / --peak-tflops, or (on a CPU, or an unknown GPU) from a
quick measurement, marked as such.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

from tools.bench.floor import hardware, sync
from tools.bench.pass_profile import profile_row, profile_pass

# Shapes by name: Hugging Face LlamaConfig arguments.
SHAPES = {
    # For tests of the harness: seconds on one CPU core.
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    # The 1B: 16 layers x 2048, GQA 32/8, vocabulary 32k.
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8),
    # Llama-3-8B.
    "8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
}


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specfleet bench engine", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="random weights of this shape (default 1b)")
    src.add_argument("--model", help="a model directory (its weights) instead of --shape")
    p.add_argument("--sessions", default="1,8,32,64", help="B values, comma separated (default %(default)s)")
    p.add_argument("--tokens", default="1,5", help="new tokens per session, comma separated (default %(default)s)")
    p.add_argument("--context", type=int, default=512, help="cached positions per session (default %(default)s)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default auto)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--repeats", type=int, default=10, help="timed passes per row; the median is reported (default %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="untimed passes first (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on a CPU (default %(default)s)")
    p.add_argument(
        "--attention",
        default="auto",
        help="specfleet's attention modes to time, comma separated: auto, per-session, batched, graph (CUDA only: the pass "
        "as a CUDA graph, as the verifier replays it) (default %(default)s); a row's specfleet time is the fastest",
    )
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers column")
    p.add_argument("--bandwidth-gbs", type=float, help="memory bandwidth in GB/s for the floor (default: known device, else measured)")
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s in the dtype for the floor (default: known device, else measured)")
    p.add_argument(
        "--profile",
        metavar="B,N",
        help="also profile the row of B sessions x N new tokens in each eager mode (torch.profiler over three passes): the "
        "operations that take the most device time a pass (CPU time on a CPU), in the table and the JSON",
    )
    p.add_argument("--json", dest="json_path", help="write the results here as JSON")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.command_line = "specfleet bench engine " + " ".join(argv)
    try:
        results = run(args)
    except ValueError as err:
        print(f"specfleet bench engine: {err}", file=sys.stderr)
        return 2
    print_table(results)
    if args.json_path:
        path = pathlib.Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2))
        print(f"wrote {path}")
    return 0


def run(args) -> dict:
    import torch

    from specfleet.engine import DTYPES, resolve_device

    device = resolve_device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = DTYPES[dtype_name]
    from specfleet.engine.attention import ATTENTION_MODES

    sessions, tokens = _csv_ints(args.sessions), _csv_ints(args.tokens)
    args.modes = [m.strip() for m in args.attention.split(",") if m.strip()]
    if not args.modes or any(m not in (*ATTENTION_MODES, "graph") for m in args.modes):
        raise ValueError(f"--attention: a comma-separated list of {', '.join(ATTENTION_MODES)}, graph; got {args.attention!r}")
    if "graph" in args.modes and device.type != "cuda":
        raise ValueError(f"--attention graph: CUDA graphs need a CUDA device, not {device}")
    if not sessions or not tokens or min(sessions + tokens) < 1 or args.context < 1 or args.repeats < 1:
        raise ValueError("--sessions, --tokens, --context and --repeats must be positive")
    args.profile_row = profile_row(args.profile)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    hf, source = _hf_model(args, device, dtype, args.context + max(tokens))
    loaded = _loaded(hf, source, args.context + max(tokens))
    bandwidth, peak, hardware_source = hardware(device, dtype, args.bandwidth_gbs, args.peak_tflops)
    model = loaded.model
    params = loaded.parameters
    kv_bytes_per_position = model.num_layers * 2 * model.kv_heads * model.head_dim * torch.finfo(dtype).bits // 8
    rows = []
    for b in sessions:
        for n in tokens:
            row = {"sessions": b, "tokens": n, "context": args.context}
            row.update(_time_row(loaded, hf, b, n, args, device, dtype))
            weight_bytes = params * torch.finfo(dtype).bits // 8
            kv_bytes = b * (args.context + n) * kv_bytes_per_position
            row["floor_ms"] = 1e3 * max((weight_bytes + kv_bytes) / bandwidth, 2 * params * b * n / peak)
            row["specfleet_over_floor"] = row["specfleet_ms"] / row["floor_ms"]
            rows.append(row)
            print(_row_line(row), file=sys.stderr, flush=True)
    return {
        "model": source,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": dtype_name,
        "parameters": params,
        "layers": model.num_layers,
        "threads": args.threads if device.type == "cpu" else None,
        "bandwidth_gbs": bandwidth / 1e9,
        "peak_tflops": peak / 1e12,
        "hardware_source": hardware_source,
        "repeats": args.repeats,
        "attention_modes": args.modes,
        "torch": torch.__version__,
        "command": getattr(args, "command_line", "specfleet bench engine"),
        "rows": rows,
    }


def _hf_model(args, device, dtype, positions: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.model:
        hf = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True, dtype=dtype).to(device).eval()
        return hf, str(args.model)
    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=max(positions, 2048), tie_word_embeddings=False)
    # Created on the device in its dtype: an 8B model built on the CPU first would take minutes.
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return hf, f"random {args.shape}"


def _loaded(hf, source: str, positions: int):
    from specfleet.engine.llama import from_hf
    from specfleet.engine import LoadedModel

    config = hf.config
    return LoadedModel(
        name="bench",
        path=source,
        model=from_hf(hf),
        tokenizer=None,
        fingerprint="",
        vocab_size=int(config.vocab_size),
        # The benchmark's sessions are this long at most (CUDA graphs bucket positions up to it).
        max_context=positions,
        eos_token_id=-1,
        parameters=sum(p.numel() for p in hf.parameters()),
    )


def _median_ms(fn, before, args, device) -> float:
    """Median wall time of fn() in ms; before() runs untimed ahead of each call."""
    times = []
    for i in range(args.warmup + args.repeats):
        before()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _time_row(loaded, hf, b: int, n: int, args, device, dtype) -> dict:
    import torch
    from transformers import DynamicCache

    from specfleet.engine import ForwardItem, Session, forward_batch

    model, C = loaded.model, args.context
    gen = torch.Generator(device=device).manual_seed(args.seed + 1000 * b + n)
    # The same cached keys and values for both: [layers, B, 2, KV, C, D].
    kv = torch.randn(model.num_layers, b, 2, model.kv_heads, C, model.head_dim, generator=gen, device=device, dtype=dtype)
    ids = torch.randint(0, loaded.vocab_size, (b, n), generator=gen, device=device)
    id_rows = ids.tolist()
    sessions = []
    for s in range(b):
        session = Session(token_ids=[0] * C)
        session.reserve(loaded.pool, C + n, C + n)
        loaded.pool.kv[:, :, :, loaded.pool.index(session.blocks, C)] = kv[:, s]
        session.kv_len = C
        sessions.append(session)
    items = [ForwardItem(sessions[s], id_rows[s], list(range(C, C + n))) for s in range(b)]
    out: dict = {}

    def ours():
        out["specfleet"] = forward_batch(loaded, items, host=False)

    row, ours_out = {"attention": {}}, {}
    for mode in args.modes:
        if mode == "graph":
            from specfleet.engine.graphs import CudaGraphs

            loaded.graphs = CudaGraphs(loaded, [(b, n)])  # captured in the first (untimed) warm-up pass
        else:
            model.attention = mode
        try:
            row["attention"][mode] = _median_ms(ours, lambda: None, args, device)
            # A graph replays the batched pass's kernels: profiled eagerly, they say the same, and a profiler over a
            # replay is the one place this bench could crash.
            if args.profile_row == (b, n) and mode != "graph":
                row.setdefault("profile", {})[mode] = profile_pass(ours, device)
        finally:
            if loaded.graphs is not None:
                loaded.graphs.release()
                loaded.graphs = None
        ours_out[mode] = out.pop("specfleet")
    row["specfleet_attention"] = min(row["attention"], key=row["attention"].get)
    row["specfleet_ms"] = row["attention"][row["specfleet_attention"]]
    if not args.no_transformers:
        cache = {}

        def fresh_cache():
            cache["c"] = None  # let the previous one go before the next is built
            c = DynamicCache()
            for layer in range(model.num_layers):
                c.update(kv[layer, :, 0].clone(), kv[layer, :, 1].clone(), layer)
            cache["c"] = c

        positions = torch.arange(C, C + n, device=device).expand(b, n)

        def theirs():
            with torch.inference_mode():
                out["transformers"] = hf(input_ids=ids, position_ids=positions, past_key_values=cache["c"], use_cache=True).logits

        row["transformers_ms"] = _median_ms(theirs, fresh_cache, args, device)
        cache.clear()
        theirs_out = out["transformers"].float()
        row["max_abs_logit_diff"] = max(float((o - theirs_out).abs().max()) for o in ours_out.values())
    for session in sessions:
        session.evict_kv()  # its blocks go back to the pool for the next row
    sessions = items = kv = out = ours_out = None  # let them go (the closures above hold some of them)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _row_line(row: dict) -> str:
    hf = f"{row['transformers_ms']:.2f}" if "transformers_ms" in row else "-"
    ours = ", ".join(f"{m} {ms:.2f}" for m, ms in row["attention"].items())
    return f"  B={row['sessions']} n={row['tokens']} C={row['context']}: specfleet {ours} ms, transformers {hf} ms, floor {row['floor_ms']:.3f} ms"


def print_table(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    title = (
        f"one forward pass, {results['model']} ({results['parameters'] / 1e9:.2f}B parameters), {results['dtype']} on "
        f"{results['device_name']}; floor at {results['bandwidth_gbs']:.0f} GB/s, {results['peak_tflops']:.1f} TFLOP/s "
        f"({results['hardware_source']})"
    )
    table = Table(title=title)
    modes = results.get("attention_modes", [])
    for col in (
        "sessions x tokens",
        "context",
        *[f"specfleet {m} ms" for m in modes],
        "transformers ms",
        "floor ms",
        "specfleet / floor",
        "max |Δ logit|",
    ):
        table.add_column(col, justify="right")
    for r in results["rows"]:
        table.add_row(
            f"{r['sessions']} x {r['tokens']}",
            str(r["context"]),
            *[f"{r['attention'][m]:.2f}" for m in modes],
            f"{r['transformers_ms']:.2f}" if "transformers_ms" in r else "-",
            f"{r['floor_ms']:.3f}",
            f"{r['specfleet_over_floor']:.1f}x",
            f"{r['max_abs_logit_diff']:.2g}" if "max_abs_logit_diff" in r else "-",
        )
    # Piped output (logs, the device check) gets the whole table, not columns cut to 80 characters.
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def markdown(results: dict) -> str:
    """The table as Markdown (docs/benchmarks/gpu.md, the device check's report)."""
    lines = [
        f"{results['model']} ({results['parameters'] / 1e9:.2f}B parameters), {results['dtype']}, {results['device_name']}; "
        f"floor at {results['bandwidth_gbs']:.0f} GB/s and {results['peak_tflops']:.1f} TFLOP/s ({results['hardware_source']}); "
        f"median of {results['repeats']} passes, ms",
        "",
        "| sessions x new tokens | context | "
        + " | ".join(f"specfleet ({m})" for m in results["attention_modes"])
        + " | transformers | floor | specfleet / floor | max abs logit diff |",
        "|---|---|" + "---|" * len(results["attention_modes"]) + "---|---|---|---|",
    ]
    for r in results["rows"]:
        hf = f"{r['transformers_ms']:.2f}" if "transformers_ms" in r else "-"
        diff = f"{r['max_abs_logit_diff']:.2g}" if "max_abs_logit_diff" in r else "-"
        ours = " | ".join(f"{r['attention'][m]:.2f}" for m in results["attention_modes"])
        lines.append(
            f"| {r['sessions']} x {r['tokens']} | {r['context']} | {ours} | {hf} | {r['floor_ms']:.3f} | {r['specfleet_over_floor']:.1f}x | {diff} |"
        )
    for r in results["rows"]:
        for mode, prof in r.get("profile", {}).items():
            lines += [
                "",
                f"Where a pass of {r['sessions']} x {r['tokens']} ({mode}) spends its {prof['clock']} time: {prof['total_ms']:.2f} ms a pass",
                "",
                "| operation | ms a pass | calls a pass |",
                "|---|---|---|",
                *(f"| `{op['op']}` | {op['ms']:.3f} | {op['calls']} |" for op in prof["ops"]),
            ]
    return "\n".join(lines) + "\n"
