"""``specfleet models build``: corpora -> tokenizer -> target -> distilled drafters -> models/demo.

Every stage writes its result into the work dir and is skipped when it is already
there; the training loops checkpoint regularly, so an interrupted build resumes
where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from .corpus import DRAFTER_NAMES

# the drafter every one of them starts from (work dir only, not exported)
BASE_DRAFTER = "base"
# The text each language specialist also learns a share of: documentation in every language
# quotes commands, package names and untranslated English (a third of the Italian Developer's
# Reference is English), which a drafter that knows only its language can neither propose
# from its token map nor predict.
COMPANIONS = {lang: "en" for lang in ("de", "fr", "es", "it")}
STAGES = ("corpus", "tokenizer", "target", "teacher", "drafters", "export", "matrix")


@dataclass
class Plan:
    vocab: int
    target: "object"
    drafter: "object"
    target_steps: int
    target_minutes: float
    target_batch: int
    target_lr: float
    seq: int
    teacher_seqs: int  # per domain
    teacher_topk: int
    drafter_steps: int
    drafter_minutes: float
    drafter_batch: int
    drafter_lr: float
    specialise_minutes: float  # every drafter's second phase, from the base drafter
    # share of a specialist's companion domain (COMPANIONS) in its specialise-phase batch rows
    # and in the token frequencies its token map is chosen by (0: its own domain only)
    companion_share: float
    token_map: int  # ids each drafter's output layer scores (token_map.json), in training and serving


def link_shared_tokenizer(out: Path) -> None:
    """Every model of the family has the same tokenizer.json: each model's becomes a link to tokenizer/'s, so
    the family travels once (a GPU machine takes 64 MiB of working tree; tests/e2e/test_device_check.py)."""
    shared = out / "tokenizer" / "tokenizer.json"
    for path in sorted(out.glob("*/tokenizer.json")) + sorted(out.glob("drafters/*/tokenizer.json")):
        if path != shared and not path.is_symlink() and path.read_bytes() == shared.read_bytes():
            path.unlink()
            path.symlink_to(os.path.relpath(shared, path.parent))


def make_plan(args) -> Plan:
    from .train import ModelSpec

    if args.quick:
        return Plan(
            vocab=args.vocab or 1024,
            target=ModelSpec(layers=2, hidden=64, intermediate=128, heads=2),
            drafter=ModelSpec(layers=1, hidden=32, intermediate=64, heads=2),
            target_steps=args.target_steps or 40,
            target_minutes=args.target_minutes or 0.4,
            target_batch=8,
            target_lr=3e-3,
            seq=64,
            teacher_seqs=args.teacher_seqs or 32,
            teacher_topk=16,
            drafter_steps=args.drafter_steps or 20,
            drafter_minutes=args.drafter_minutes or 0.1,
            drafter_batch=8,
            drafter_lr=3e-3,
            specialise_minutes=args.specialise_minutes or 0.1,
            companion_share=args.companion_share,
            token_map=256,
        )
    return Plan(
        # 12k ids: five languages, Python and YAML/JSON share one byte-level BPE; at 8k the
        # languages other than English fall to about 2.6 bytes per token
        vocab=args.vocab or 12288,
        # six layers, not more: on two CPU threads in 48 minutes it sees the training text about
        # three times and writes each language (held-out loss 2.4-5.0); a 10-layer target
        # trained 17 minutes saw half of it, continued every language alike, and no specialist
        # beat the general drafter (docs/benchmarks/drafter-recipes.md)
        target=ModelSpec(layers=6, hidden=256, intermediate=768, heads=4),
        # one layer and a 2,048-id output layer: the drafter must cost <= 1/6 of the target per
        # token, and at this size the domains compete for its capacity
        drafter=ModelSpec(layers=1, hidden=128, intermediate=384, heads=4),
        target_steps=args.target_steps or 100_000,
        target_minutes=args.target_minutes or 48.0,
        target_batch=8,
        target_lr=2e-3,
        seq=256,
        # about the whole training split of each domain: a specialist sees each window about three
        # times in its budget instead of overfitting a small sample
        teacher_seqs=args.teacher_seqs or 1600,
        teacher_topk=32,
        drafter_steps=args.drafter_steps or 100_000,
        drafter_minutes=args.drafter_minutes or 4.0,
        drafter_batch=8,
        drafter_lr=3e-3,
        specialise_minutes=args.specialise_minutes or 4.0,
        companion_share=args.companion_share,
        token_map=2048,
    )


def _progress():
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.percentage:>5.1f}%"),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        transient=False,
    )


def _card(title: str, body: dict, command: str) -> str:
    lines = [f"# {title}", ""]
    for k, v in body.items():
        lines.append(f"- **{k}**: {v}")
    lines += ["", "Made by:", "", "```", command, "```", ""]
    return "\n".join(lines)


def _threads(state: dict) -> str:
    n = state.get("threads", 1)
    return "one CPU thread" if n == 1 else f"{n} CPU threads"


def _data_sources(corpus: Path, quick: bool) -> tuple[dict, dict]:
    """Per-domain training-data descriptions for the model cards."""
    stats = json.loads((corpus / "stats.json").read_text())
    data_desc = {d: f"{stats[d]['train']['chars']:,} chars train" for d in stats}
    langs = {"en": "English", "de": "German", "fr": "French", "es": "Spanish", "it": "Italian"}
    srcs = {
        "en": "English: Debian fortunes, jargon-text, manpages (roff), python3.11-doc (reST), debian-reference-en, aptitude-doc-en",
        **{
            lang: f"{langs[lang]}: Debian manpages-{lang} (roff), debian-reference-{lang}"
            + (f", fortunes-{lang}" if lang in ("de", "es", "it") else "")
            + (f", aptitude-doc-{lang} (HTML as text)" if lang in ("fr", "es", "it") else "")
            for lang in ("de", "fr", "es", "it")
        },
        "code": "Python source: the Python 3.11 standard library plus Debian python3-setuptools, python3-docutils and python3-pygments",
        "structured": "YAML/JSON/INI/TOML/CFG files of Debian ansible, rubocop, cloud-init and pandoc-data",
    }
    if quick:
        srcs = {d: "local Python stdlib tree (quick mode)" for d in srcs}
    return srcs, data_desc


def token_maps(streams: dict, size: int, companion_share: float = 0.0) -> dict[str, list[int]]:
    """Each drafter's token map: the ``size`` ids its output layer scores.

    The general drafter's map is the ``size`` most frequent ids of the mix, every domain
    weighted equally, so its ids are shared out between the languages, code and structured
    text. A specialist's is the ``size`` most frequent ids of the text it is trained on: its
    own domain with weight ``1 - companion_share`` plus its companion domain (COMPANIONS)
    with weight ``companion_share``. A map of the domain's own ids alone cannot even propose
    the English quoted in other languages' documentation: the Italian drafter's own map held
    77% of the target's greedy tokens in the English paragraphs of the Italian Developer's
    Reference, the general map 98%.
    """
    import numpy as np

    vocab = max(int(s.max()) for s in streams.values()) + 1
    freqs = {d: np.bincount(s, minlength=vocab) / len(s) for d, s in streams.items()}

    def top(counts) -> list[int]:
        return sorted(int(i) for i in np.argsort(-counts, kind="stable")[:size])

    def specialist(d: str):
        c = COMPANIONS.get(d)
        return freqs[d] if c is None or c not in freqs else (1.0 - companion_share) * freqs[d] + companion_share * freqs[c]

    maps = {d: top(specialist(d)) for d in freqs}
    maps["general"] = top(sum(freqs.values()))
    return maps


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default in --help, the description as written."""


def build_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="specfleet models build", description=__doc__, formatter_class=_HelpFormatter)
    ap.add_argument("--out", default="models/demo", help="where the final models go")
    ap.add_argument("--work", default=".cache/demo_models", help="work dir (corpora, checkpoints)")
    ap.add_argument("--quick", action="store_true", help="tiny models and corpora, stdlib only, no network")
    ap.add_argument("--vocab", type=int, default=0)
    ap.add_argument("--target-minutes", type=float, default=0, help="training-time budget for the target")
    ap.add_argument("--target-steps", type=int, default=0)
    ap.add_argument("--drafter-minutes", type=float, default=0, help="training-time budget of the base drafter that every drafter starts from")
    ap.add_argument("--drafter-steps", type=int, default=0)
    ap.add_argument("--specialise-minutes", type=float, default=0, help="training-time budget per drafter after the base drafter")
    ap.add_argument(
        "--companion-share",
        type=float,
        default=0.25,
        help="share of English in the de, fr, es and it specialists' batch rows and token-map frequencies (default %(default)s; "
        "0: each its own language only, which left the Italian drafter about 0.03 less ahead of the general drafter on the Debian "
        "manuals: docs/benchmarks/drafter-recipes.md)",
    )
    ap.add_argument("--teacher-seqs", type=int, default=0, help="target-labelled windows per domain")
    ap.add_argument("--stop-after", choices=STAGES, default=None)
    ap.add_argument("--no-matrix", action="store_true", help="skip the acceptance matrix at the end")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training (default %(default)s)")
    ap.add_argument(
        "--drafters",
        default="",
        help=f"comma-separated: train only these drafters and stop ({BASE_DRAFTER}, the one all start from, first; "
        "then builds with different lists side by side, then one without)",
    )
    ap.add_argument("--overwrite-demo", action="store_true", help="with --quick: let the tiny models replace the bundled ones in models/demo")
    args = ap.parse_args(argv)
    only = [n for n in args.drafters.split(",") if n]
    unknown = sorted(set(only) - {BASE_DRAFTER, *DRAFTER_NAMES})
    if unknown:
        ap.error(f"--drafters: no drafter named {', '.join(unknown)}; the drafters are {BASE_DRAFTER}, {', '.join(DRAFTER_NAMES)}")
    bundled = Path(__file__).resolve().parents[2] / "models" / "demo"
    if args.quick and Path(args.out).resolve() == bundled and not args.overwrite_demo:
        # The bundled models are what the README's examples and the benchmarks describe; tiny
        # quick ones written over them would change every answer without saying so.
        ap.error(f"--quick would replace the bundled demo models in {bundled} with tiny ones: pass --out DIR, or --overwrite-demo to replace them")

    import torch
    from rich.console import Console

    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    from . import corpus as corpus_mod
    from .exemplars import write_exemplars
    from .tokenizer import train_tokenizer, roundtrip_ok
    from . import train as T

    console = Console(stderr=True)
    log = console.log
    work = Path(args.work)
    out = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    plan = make_plan(args)
    command = "specfleet models build " + " ".join(shlex.quote(a) for a in argv)
    T.save_json(work / "plan.json", {"plan": plan.__dict__, "argv": argv})
    t_start = time.time()

    def stop(stage: str) -> bool:
        return args.stop_after == stage

    # 1. corpora
    corpus = corpus_mod.build_corpora(work, quick=args.quick, log=log)
    if stop("corpus"):
        return 0

    # 2. tokenizer
    tok = train_tokenizer(corpus, work / "tokenizer", vocab_size=plan.vocab)
    for d in corpus_mod.DOMAINS:
        for text in corpus_mod.load_split(corpus, d, "heldout")[:20]:
            if not roundtrip_ok(tok, text):
                log(f"[red]tokenizer does not round-trip a {d} text")
                return 1
    tokens = T.tokenize_corpus(corpus, tok, work / "tokens", log=log)
    streams = {d: T.load_stream(tokens, d, "train") for d in corpus_mod.DOMAINS}
    bpt = {d: round(sum(len(t.encode("utf-8")) for t in corpus_mod.load_split(corpus, d, "train")) / len(streams[d]), 2) for d in corpus_mod.DOMAINS}
    T.save_json(work / "tokens" / "bytes_per_token.json", bpt)
    log("bytes per token (train): " + ", ".join(f"{d} {v}" for d, v in bpt.items()))
    if not 0.0 <= plan.companion_share < 1.0:
        ap.error(f"--companion-share must be in [0, 1), not {plan.companion_share}")
    maps = token_maps(streams, plan.token_map, plan.companion_share)
    if stop("tokenizer"):
        return 0

    # 3. target
    tdir = work / "target"
    tdir.mkdir(exist_ok=True)
    target = T.new_model(plan.target, tok, seed=1)
    tstate_f = tdir / "state.json"
    if not tstate_f.exists():
        budget = T.TrainBudget(
            max_steps=plan.target_steps,
            max_seconds=plan.target_minutes * 60,
            batch=plan.target_batch,
            seq=plan.seq,
            lr=plan.target_lr,
        )
        n_params = sum(p.numel() for p in target.parameters())
        log(f"target {plan.target} {n_params / 1e6:.1f}M params, budget {budget}")
        with _progress() as prog:
            task = prog.add_task("target", total=1.0, info="")
            state = T.train_loop(
                target,
                budget,
                tdir / "ckpt.pt",
                T.mix_batch_fn(streams, plan.seq),
                T.lm_loss,
                "target",
                progress_cb=lambda f, s: prog.update(task, completed=f, info=f"step {s['step']} loss {s['loss']:.3f}"),
                log=log,
                seed=1,
            )
        torch.save(target.state_dict(), tdir / "final.pt")
        # the card describes the data the target was actually trained on, even if the
        # corpora are rebuilt later (e.g. to retrain only the drafters)
        srcs, data_desc = _data_sources(corpus, args.quick)
        state["data"] = "; ".join(f"{d}: {srcs[d]} ({data_desc[d]})" for d in srcs)
        state["threads"] = args.threads
        T.save_json(tstate_f, {k: v for k, v in state.items()})
    else:
        target.load_state_dict(torch.load(tdir / "final.pt", map_location="cpu"))
    target.eval()
    tstate = json.loads(tstate_f.read_text())
    if stop("target"):
        return 0

    # 4. teacher labels: target top-k log-probs on windows of each domain
    caches = {}
    with _progress() as prog:
        for i, d in enumerate(corpus_mod.DOMAINS):
            task = prog.add_task(f"teacher {d}", total=1.0, info="")
            cdir = T.cache_teacher(
                target,
                streams[d],
                plan.teacher_seqs,
                plan.seq,
                plan.teacher_topk,
                work / "teacher" / d,
                seed=100 + i,
                progress_cb=lambda f, task=task: prog.update(task, completed=f),
            )
            prog.update(task, completed=1.0)
            caches[d] = T.load_teacher_cache(cdir)
    if stop("teacher"):
        return 0

    # 5. drafters, in two phases of equal length for every drafter:
    #    a. a base drafter learns the mix (general token map), so every drafter starts knowing
    #       what all domains share: markup, numbers, names, English words inside other text;
    #    b. each specialist continues from the base on its own domain with its own token map,
    #       and the general drafter continues from it on the mix. Specialists trained from
    #       scratch on one domain's 450k tokens overfit it and lose to the general drafter on
    #       other documents of their own language (docs/benchmarks/drafter-recipes.md).
    #       A share (plan.companion_share) of a language specialist's batch rows comes from
    #       English (COMPANIONS). Each drafter's work dir keeps the token map it was trained
    #       with (token_map.json), and export writes that one: a build with another
    #       --companion-share must not pair drafters trained earlier with a different map.
    def train_drafter(
        name: str, src: list, tmap, seed: int, minutes: float, lr: float, init: Path | None, weights: list[float] | None = None
    ) -> dict:
        ddir = work / "drafters" / name
        ddir.mkdir(parents=True, exist_ok=True)
        sf = ddir / "state.json"
        if sf.exists():
            return json.loads(sf.read_text())
        (ddir / "token_map.json").write_text(json.dumps([int(i) for i in tmap]) + "\n")
        model = T.new_model(plan.drafter, tok, seed=seed)
        if init is None:
            T.init_embeddings_from_target(model, target)  # same vocab; PCA-projected to the drafter's width
        else:
            model.load_state_dict(torch.load(init, map_location="cpu"))
        budget = T.TrainBudget(max_steps=plan.drafter_steps, max_seconds=minutes * 60, batch=plan.drafter_batch, seq=plan.seq, lr=lr)
        with _progress() as prog:
            task = prog.add_task(f"drafter {name}", total=1.0, info="")
            state = T.train_loop(
                model,
                budget,
                ddir / "ckpt.pt",
                T.distill_batch_fn(src, weights),
                T.distill_loss_fn(torch.tensor(tmap), len(tok)),
                f"drafter {name}",
                progress_cb=lambda f, s: prog.update(task, completed=f, info=f"step {s['step']} kl {s['loss']:.3f}"),
                log=log,
                seed=seed,
            )
        torch.save(model.state_dict(), ddir / "final.pt")
        state["threads"] = args.threads
        if init is not None:  # a second-phase drafter: what it was specialised with
            state["companion"] = COMPANIONS.get(name)
            state["companion_share"] = plan.companion_share if name in COMPANIONS else 0.0
        T.save_json(sf, state)
        return state

    mix = [caches[d] for d in corpus_mod.DOMAINS]
    base_done = (work / "drafters" / BASE_DRAFTER / "state.json").exists()
    if only and not base_done and BASE_DRAFTER not in only:
        # every drafter starts from the base one: side-by-side runs must not each train it
        ap.error(f"--drafters: the base drafter is not trained yet: run --drafters {BASE_DRAFTER} first")
    base_state = train_drafter(BASE_DRAFTER, mix, maps["general"], 10 + DRAFTER_NAMES.index("general"), plan.drafter_minutes, plan.drafter_lr, None)
    dstates = {}
    for j, name in enumerate(DRAFTER_NAMES):
        if only and name not in only:
            continue
        if name == "general":
            src, weights = mix, None
        else:
            c, s = COMPANIONS.get(name), plan.companion_share
            src, weights = ([caches[name]], None) if c is None or s == 0 else ([caches[name], caches[c]], [1.0 - s, s])
        state = train_drafter(
            name, src, maps[name], 10 + j, plan.specialise_minutes, plan.drafter_lr / 2, work / "drafters" / BASE_DRAFTER / "final.pt", weights
        )
        dstates[name] = state
    if stop("drafters") or only:
        return 0

    # 6. export
    # save_pretrained overwrites our files in place; other files in these dirs (e.g. serving
    # exemplars added by hand) are left alone.
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out / "tokenizer"))
    srcs, data_desc = _data_sources(corpus, args.quick)
    T.export_model(
        target,
        tok,
        out / "target",
        _card(
            "specfleet demo target",
            {
                "architecture": f"LlamaForCausalLM {plan.target.layers} layers x {plan.target.hidden} hidden, "
                f"{plan.target.heads} heads, vocab {len(tok)}, tied embeddings, bf16 weights",
                "data": tstate.get("data") or "; ".join(f"{d}: {srcs[d]} ({data_desc[d]})" for d in srcs),
                "training": f"{tstate['step']} steps x {plan.target_batch} x {plan.seq} tokens "
                f"({tstate['tokens']:,} tokens, {tstate['elapsed'] / 60:.1f} min on {_threads(tstate)}), AdamW, cosine LR",
                "final train loss": f"{tstate['final_loss']:.3f} nats/token (EMA)",
                "purpose": "verifier for specfleet demos; tiny and undertrained, not a useful language model",
            },
            command,
        ),
    )
    for name in DRAFTER_NAMES:
        model = T.new_model(plan.drafter, tok, seed=0)
        model.load_state_dict(torch.load(work / "drafters" / name / "final.pt", map_location="cpu"))
        st, base = dstates[name], base_state
        data = srcs[name] if name != "general" else "all seven domains, mixed uniformly"
        companion, share = st.get("companion"), st.get("companion_share", 0.0)
        mixed = f"; {share:.0%} from {companion}" if companion and share else ""
        own = "its own domain" + (f" ({1 - share:.0%} of the batch rows{mixed})" if mixed else "")
        T.export_model(
            model,
            tok,
            out / "drafters" / name,
            _card(
                f"specfleet demo drafter: {name}",
                {
                    "architecture": f"LlamaForCausalLM {plan.drafter.layers} layers x {plan.drafter.hidden} hidden, "
                    f"vocab {len(tok)}, tied embeddings, bf16 weights; same tokenizer as the target",
                    "data": f"{data}; {plan.teacher_seqs} windows x {plan.seq} tokens per domain labelled by the target",
                    "training": f"distilled from the target (cross-entropy to its top-{plan.teacher_topk} "
                    f"temperature-1 distribution + tail bucket) in two phases: a base drafter on all seven domains "
                    f"({base['step']} steps x {plan.drafter_batch} x {plan.seq} tokens, {base['elapsed'] / 60:.1f} min on "
                    f"{_threads(base)}; tied embedding initialised from the target's embedding projected onto its top "
                    f"principal directions), then from it on {'the mix' if name == 'general' else own} "
                    f"({st['step']} steps, {st['elapsed'] / 60:.1f} min on {_threads(st)}); every drafter of the family "
                    "trained as long",
                    "final distillation loss": f"{st['final_loss']:.3f} nats/token (EMA)",
                    "token map": f"token_map.json: the {plan.token_map} most frequent ids of "
                    + (
                        "the training mix, every domain weighted equally"
                        if name == "general"
                        else "its domain's training text" + (f" weighted {1 - share:.2f} plus {companion}'s weighted {share:.2f}" if mixed else "")
                    )
                    + "; the drafter is trained and served scoring only these (the output layer is most of a step's cost)",
                },
                command,
            ),
        )
    legacy = None
    for name in DRAFTER_NAMES:
        saved = work / "drafters" / name / "token_map.json"
        if saved.exists():
            tmap = json.loads(saved.read_text())
        else:  # trained before the work dir kept its map: then a specialist's map was its own domain's alone
            legacy = legacy or token_maps(streams, plan.token_map, 0.0)
            tmap = legacy[name]
        (out / "drafters" / name / "token_map.json").write_text(json.dumps(tmap) + "\n")
    write_exemplars(corpus, out / "drafters")
    link_shared_tokenizer(out)
    log(f"exported models to {out} ({sum(f.stat().st_size for f in out.rglob('*') if f.is_file()) / 1e6:.1f} MB)")
    if stop("export"):
        return 0

    # 7. acceptance matrix
    if not args.no_matrix:
        from .acceptance import matrix_main

        margv = ["--models", str(out), "--work", str(work), "--output", str(out / "acceptance.md")]
        if args.quick:
            margv += ["--quick"]
        rc = matrix_main(margv)
        if rc:
            return rc
    log(f"build finished in {time.time() - t_start:.0f}s")
    return 0
