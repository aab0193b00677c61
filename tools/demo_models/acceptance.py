"""``specfleet models matrix``: drafter x domain acceptance matrix of the demo models.

For every domain and both prompt sets (the held-out split of the training sources
and the "unseen source" split), ``--prompts`` windows of ``--prompt-len`` tokens
are taken; the target continues each greedily for ``--new-tokens`` tokens. Along
that continuation (teacher-forced, so every position sees the target's own prefix):

* greedy alpha: P(argmax q == argmax p), q = drafter, p = target;
* sampled alpha at temperature T: E[sum_x min(p_T(x), q_T(x))], the per-token
  acceptance probability of lossless speculative sampling;
* tokens / verification at k drafts, greedy: simulates the chain exactly (accepted
  drafts + 1 target token per verification);
* tokens / verification at k, sampled: 1 + sum_j prod_{l<j} beta_l with the per
  position sampled acceptance beta along the chain (expected value);
* the target's loss (nats/token) on held-out and unseen text;
* per-token cost of target and drafters (one thread, KV-cached one-token decode
  step, fp32 and bf16, through specfleet's own forward pass; and the target's 5-token
  verification step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from .corpus import DRAFTER_NAMES as DRAFTERS


def _load(path: Path, dtype):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return m.eval()


def _prompts(tok, texts: list[str], n: int, length: int, seed: int):
    import numpy as np

    ids: list[int] = []
    for t in texts:
        ids.extend(tok(t, add_special_tokens=False)["input_ids"])
        ids.append(tok.eos_token_id)
    stream = np.asarray(ids, dtype=np.int64)
    if len(stream) <= length + 1:
        stream = np.tile(stream, length // max(1, len(stream)) + 2)
    rng = np.random.default_rng(seed)
    starts = np.sort(rng.choice(len(stream) - length, size=n, replace=n > len(stream) - length))
    return np.stack([stream[s : s + length] for s in starts]), stream


def _greedy_continue(model, prompts, new_tokens: int):
    import torch

    with torch.inference_mode():
        out = model(input_ids=prompts, use_cache=True)
        cache = out.cache
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        toks = [nxt]
        for _ in range(new_tokens - 1):
            out = model(input_ids=nxt, cache=cache, use_cache=True)
            cache = out.cache
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            toks.append(nxt)
    return torch.cat([prompts] + toks, dim=1)


def _cont_logits(model, seq, prompt_len: int):
    """Logits at the positions that predict the continuation tokens."""
    import torch

    with torch.inference_mode():
        logits = model(input_ids=seq).logits.float()
    return logits[:, prompt_len - 1 : -1]


def _chain_greedy(match, k: int) -> float:
    tokens = verifs = 0
    for row in match:
        n = len(row)
        i = 0
        while i < n:
            a = 0
            while a < k and i + a < n and row[i + a]:
                a += 1
            tokens += min(a + 1, n - i)
            verifs += 1
            i += a + 1
    return tokens / max(1, verifs)


def _chain_sampled(beta, k: int) -> float:
    import numpy as np

    b = np.asarray(beta)  # (prompts, positions)
    n = b.shape[1]
    vals = []
    for i in range(0, n - k):
        e, prod = 1.0, np.ones(b.shape[0])
        for j in range(k):
            prod = prod * b[:, i + j]
            e = e + prod
        vals.append(e)
    return float(np.mean(vals)) if vals else float("nan")


def _heldout_loss(model, stream, n: int, length: int, seed: int) -> float:
    import numpy as np
    import torch
    import torch.nn.functional as F

    rng = np.random.default_rng(seed)
    if len(stream) <= length + 1:
        stream = np.tile(stream, length // max(1, len(stream)) + 2)
    starts = rng.integers(0, len(stream) - length - 1, size=n)
    x = torch.from_numpy(np.stack([stream[s : s + length + 1] for s in starts]))
    losses = []
    with torch.inference_mode():
        for b in range(0, n, 8):
            xb = x[b : b + 8]
            logits = model(input_ids=xb[:, :-1]).logits.float()
            losses.append(F.cross_entropy(logits.reshape(-1, logits.size(-1)), xb[:, 1:].reshape(-1), reduction="sum").item())
    return sum(losses) / (n * length)


def drafter_logits(model, token_map, seq, prompt_len: int):
    """A drafter's logits at the continuation's positions, as served: ids outside its token map
    (None: none) can never be proposed."""
    import torch

    logits = _cont_logits(model, seq, prompt_len)
    if token_map is not None:
        unmapped = torch.ones(logits.shape[-1], dtype=torch.bool)
        unmapped[token_map] = False
        logits = logits.masked_fill(unmapped, float("-inf"))
    return logits


def _token_map(name: str, model_dir: Path, vocab_size: int):
    from specfleet.engine import TOKEN_MAP_FILE, read_token_map

    path = model_dir / TOKEN_MAP_FILE
    return read_token_map(name, path, vocab_size) if path.exists() else None


def step_costs_ms(cases: dict, vocab: int, context: int = 128, reps: int = 60) -> dict:
    """Median wall time (ms) of one KV-cached decode step, batch 1, for each ``name: (model, k[, token_map])``,
    through specfleet's own forward pass (`specfleet.engine.llama`, what the services run; a token map
    keeps only those rows of the output layer, as the drafter service does).

    ``k`` tokens are fed at once (k = 1: a drafter/target decode step; k > 1: a verification
    step) after ``context`` cached tokens; nothing is committed, so every step sees the same
    context. The cases are timed round-robin so that background load hits all of them alike.
    """
    import torch

    from specfleet.engine import Session, llama
    from specfleet.engine.kv import KVPool

    g = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, vocab, (1, context), generator=g)
    runs, times = {}, {n: [] for n in cases}
    for n, (m, k, *token_map) in cases.items():
        model = llama.from_hf(m)
        if token_map and token_map[0] is not None:
            model.lm_head = model.lm_head[token_map[0]].contiguous()
        pool = KVPool(model)
        session = Session(token_ids=ctx[0].tolist())
        session.reserve(pool, context + k, context + k)
        causal = torch.ones(context, context, dtype=torch.bool).tril()
        llama.forward(model, ctx, torch.arange(context)[None], pool.kv, [session.place()], [0], [context], [causal], logits=False)
        session.kv_len = context
        attend = None if k == 1 else torch.ones(k, k, dtype=torch.bool).tril()
        runs[n] = (model, pool, session, k, attend)
    for r in range(reps + 5):
        for n, (model, pool, session, k, attend) in runs.items():
            x = torch.randint(0, vocab, (1, k), generator=g)
            positions = torch.arange(context, context + k)[None]
            t = time.perf_counter()
            llama.forward(model, x, positions, pool.kv, [session.place()], [context], [k], [attend])
            dt = time.perf_counter() - t
            if r >= 5:
                times[n].append(dt)
    return {n: statistics.median(v) * 1000 for n, v in times.items()}


def matrix_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="specfleet models matrix", description=__doc__)
    ap.add_argument("--models", default="models/demo", help="dir with tokenizer/, target/, drafters/<name>/")
    ap.add_argument("--work", default=".cache/demo_models", help="work dir holding the corpora (rebuilt if missing)")
    ap.add_argument("--output", default=None, help="Markdown file to write (default <models>/acceptance.md)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--loss-windows", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="tiny settings (and stdlib-only corpora if rebuilding)")
    ap.add_argument("--no-cost", action="store_true", help="skip the timing measurements")
    ap.add_argument("--cost-only", action="store_true", help="only the timing measurements (printed, no file)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.prompt_len, args.new_tokens, args.loss_windows = 8, 16, 16, 4

    import torch
    from rich.console import Console
    from rich.progress import Progress
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from .corpus import DOMAINS, build_corpora, load_split

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    models = Path(args.models)
    out_file = Path(args.output) if args.output else models / "acceptance.md"
    corpus = build_corpora(Path(args.work), quick=args.quick, log=console.log)
    tok = AutoTokenizer.from_pretrained(str(models / "tokenizer"))
    target = _load(models / "target", torch.float32)
    drafters = {n: _load(models / "drafters" / n, torch.float32) for n in DRAFTERS if (models / "drafters" / n).exists()}
    # As served: a drafter with a token map scores only the mapped ids (specfleet.engine.load_model).
    token_maps = {n: _token_map(n, models / "drafters" / n, m.config.vocab_size) for n, m in drafters.items()}

    sets = [(d, s) for d in DOMAINS for s in ("heldout", "unseen")] if not args.cost_only else []
    res: dict = {"greedy": {}, "sampled": {}, "tpv_greedy": {}, "tpv_sampled": {}, "loss": {}}
    T = args.temperature
    with Progress(console=console) as prog:
        task = prog.add_task("acceptance matrix", total=len(sets))
        for si, (d, s) in enumerate(sets):
            prompts, stream = _prompts(tok, load_split(corpus, d, s), args.prompts, args.prompt_len, seed=1000 + si)
            prompts = torch.from_numpy(prompts)
            seq = _greedy_continue(target, prompts, args.new_tokens)
            p_logits = _cont_logits(target, seq, args.prompt_len)
            p_arg = p_logits.argmax(-1)
            p_T = torch.softmax(p_logits / T, -1)
            res["loss"][(d, s)] = _heldout_loss(target, stream, args.loss_windows, 256 if not args.quick else 32, seed=si)
            for n, m in drafters.items():
                q_logits = drafter_logits(m, token_maps[n], seq, args.prompt_len)
                match = (q_logits.argmax(-1) == p_arg).numpy()
                beta = torch.minimum(p_T, torch.softmax(q_logits / T, -1)).sum(-1).numpy()
                res["greedy"][(n, d, s)] = float(match.mean())
                res["sampled"][(n, d, s)] = float(beta.mean())
                res["tpv_greedy"][(n, d, s)] = _chain_greedy(match, args.k)
                res["tpv_sampled"][(n, d, s)] = _chain_sampled(beta, args.k)
            prog.advance(task)

    cost = {}
    if not args.no_cost:
        vocab = len(tok)
        import copy

        for dtype in (torch.float32, torch.bfloat16):
            dn = str(dtype).replace("torch.", "")
            cases = {("target", dn, 1): (copy.deepcopy(target).to(dtype), 1)}
            cases[("target", dn, args.k + 1)] = (cases[("target", dn, 1)][0], args.k + 1)
            for n, m in drafters.items():
                cases[(n, dn, 1)] = (copy.deepcopy(m).to(dtype), 1, token_maps[n])
            cost.update(step_costs_ms(cases, vocab, reps=20 if args.quick else 60))

    if args.cost_only:
        print(json.dumps({"|".join(map(str, k)): round(v, 3) for k, v in cost.items()}, indent=1))
        return 0
    md = render(res, cost, args, drafters, sets, token_maps)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(md)
    (out_file.with_suffix(".json")).write_text(
        json.dumps(
            {k: {"|".join(map(str, kk)): vv for kk, vv in v.items()} for k, v in {**res, "cost_ms": cost}.items()},
            indent=1,
        )
    )
    print(md)
    console.log(f"wrote {out_file}")
    return 0


def render(res, cost, args, drafters, sets, token_maps=None) -> str:
    from .corpus import DOMAINS

    lines = [
        "# specfleet demo models: acceptance matrix",
        "",
        f"{args.prompts} prompts x {args.prompt_len} tokens per domain and prompt set, target greedy continuation of "
        f"{args.new_tokens} tokens. Cells: `held-out / unseen-source`. Sampled alpha at temperature {args.temperature}; "
        f"tokens per verification at k = {args.k}.",
        "",
    ]

    def table(key: str, title: str, fmt: str):
        lines.append(f"## {title}")
        lines.append("")
        lines.append("| drafter | " + " | ".join(DOMAINS) + " |")
        lines.append("|---|" + "---|" * len(DOMAINS))
        for n in drafters:
            cells = []
            for d in DOMAINS:
                h = res[key].get((n, d, "heldout"))
                u = res[key].get((n, d, "unseen"))
                c = f"{h:{fmt}} / {u:{fmt}}"
                if n == d:
                    c = f"**{c}**"
                cells.append(c)
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
        lines.append("")

    table("greedy", "Greedy per-token acceptance alpha", ".3f")
    table("sampled", f"Sampled per-token acceptance alpha (T = {args.temperature})", ".3f")
    table("tpv_greedy", f"Mean tokens per verification, greedy, k = {args.k}", ".2f")
    table("tpv_sampled", f"Expected tokens per verification, sampled, k = {args.k}", ".2f")
    lines.append("## Target loss (nats/token)")
    lines.append("")
    lines.append("| set | " + " | ".join(DOMAINS) + " |")
    lines.append("|---|" + "---|" * len(DOMAINS))
    for s in ("heldout", "unseen"):
        lines.append(f"| {s} | " + " | ".join(f"{res['loss'][(d, s)]:.3f}" for d in DOMAINS) + " |")
    lines.append("")
    if cost:
        lines.append("## Per-token cost (one CPU thread, batch 1, KV-cached, context 128; median ms)")
        lines.append("")
        lines.append(f"| model | fp32 1 token | bf16 1 token | fp32 {args.k + 1} tokens | bf16 {args.k + 1} tokens |")
        lines.append("|---|---|---|---|---|")
        k1 = args.k + 1
        lines.append(
            f"| target | {cost[('target', 'float32', 1)]:.2f} | {cost[('target', 'bfloat16', 1)]:.2f} | "
            f"{cost[('target', 'float32', k1)]:.2f} | {cost[('target', 'bfloat16', k1)]:.2f} |"
        )
        for n in drafters:
            lines.append(f"| drafter {n} | {cost[(n, 'float32', 1)]:.2f} | {cost[(n, 'bfloat16', 1)]:.2f} | | |")
        lines.append("")
        mapped = {len(m) for m in (token_maps or {}).values() if m is not None}
        if mapped:
            lines.append(
                f"Drafters are measured as served: their output layer scores only the {', '.join(map(str, sorted(mapped)))} "
                "ids of their token_map.json, in the acceptance rates above and in these costs."
            )
            lines.append("")
        t_best = min(cost[("target", "float32", 1)], cost[("target", "bfloat16", 1)])
        d_best = max(min(cost[(n, "float32", 1)], cost[(n, "bfloat16", 1)]) for n in drafters)
        fp32_ratio = cost[("target", "float32", 1)] / max(cost[(n, "float32", 1)] for n in drafters)
        lines.append(
            f"Target / drafter per-token cost (each in its fastest dtype, slowest drafter): **{t_best / d_best:.1f}x**; "
            f"both fp32: {fp32_ratio:.1f}x. Target {k1}-token verification / 1-token step: "
            f"fp32 {cost[('target', 'float32', k1)] / cost[('target', 'float32', 1)]:.2f}x, "
            f"bf16 {cost[('target', 'bfloat16', k1)] / cost[('target', 'bfloat16', 1)]:.2f}x."
        )
        lines.append("")
    return "\n".join(lines)
