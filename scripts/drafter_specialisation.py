"""Does more training on one domain make a drafter beat the general drafter there?

An experiment, not part of the build. It starts from the general drafter that
`specfleet models build` trained (its fp32 checkpoint in the build's work dir),
trains a copy further for the same number of steps on either one domain's target-labelled
windows (a specialist fine-tuned from the general drafter) or on the mix
(the control: the general drafter, trained as long), and reports greedy
per-token acceptance on every domain's held-out and unseen prompts, before and
after. The question is whether fine-tuning gains on its own domain more than
the control gains there: only that margin would make a specialist worth
routing to. Results and the command are in docs/benchmarks/drafter-specialisation.md.

    .venv/bin/python scripts/drafter_specialisation.py --domain de
    .venv/bin/python scripts/drafter_specialisation.py --domain general

One thread; run the runs one per core (taskset -c N) to use both cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.demo_models import train as T  # noqa: E402
from tools.demo_models.acceptance import _cont_logits, _greedy_continue, _prompts  # noqa: E402
from tools.demo_models.build import make_plan  # noqa: E402
from tools.demo_models.corpus import DOMAINS, load_split  # noqa: E402
from tools.demo_models.tokenizer import load_tokenizer  # noqa: E402


def eval_sets(work: Path, tok, plan, prompts: int) -> dict:
    """Per (domain, split): the target's greedy continuation and its argmax at every position."""
    cache = work / f"specialisation-eval-{prompts}.pt"
    if cache.exists():
        return torch.load(cache)
    target = T.new_model(plan.target, tok, seed=1)
    target.load_state_dict(torch.load(work / "target" / "final.pt", map_location="cpu"))
    target.eval()
    sets = {}
    for i, domain in enumerate(DOMAINS):
        for split in ("heldout", "unseen"):
            ids, _ = _prompts(tok, load_split(work / "corpus", domain, split), prompts, 64, seed=2000 + 2 * i + (split == "unseen"))
            seq = _greedy_continue(target, torch.from_numpy(ids), 64)
            sets[f"{domain}/{split}"] = (seq, _cont_logits(target, seq, 64).argmax(-1))
    torch.save(sets, cache)
    return sets


def acceptance(model, sets: dict) -> dict[str, float]:
    out = {}
    for name, (seq, target_argmax) in sets.items():
        out[name] = round(float((_cont_logits(model, seq, 64).argmax(-1) == target_argmax).float().mean()), 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--domain", required=True, choices=[*DOMAINS, "general"], help="train on this domain, or on the mix")
    ap.add_argument("--steps", type=int, default=400, help="optimizer steps, each a batch of the build's drafter windows")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--prompts", type=int, default=24, help="prompts of 64 tokens per domain and split")
    ap.add_argument("--work", default=".cache/demo_models", help="the full build's work dir")
    args = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(args.work)
    plan = make_plan(argparse.Namespace(quick=False, vocab=0, target_steps=0, target_minutes=0, teacher_seqs=0, drafter_steps=0, drafter_minutes=0))
    tok = load_tokenizer(work / "tokenizer")
    sets = eval_sets(work, tok, plan, args.prompts)
    model = T.new_model(plan.drafter, tok, seed=0)
    model.load_state_dict(torch.load(work / "drafters" / "general" / "final.pt", map_location="cpu"))
    model.eval()
    before = acceptance(model, sets)
    domains = DOMAINS if args.domain == "general" else (args.domain,)
    caches = [T.load_teacher_cache(work / "teacher" / d) for d in domains]
    ckpt = work / f"specialisation-{args.domain}.pt"
    ckpt.unlink(missing_ok=True)
    budget = T.TrainBudget(max_steps=args.steps, max_seconds=float("inf"), batch=plan.drafter_batch, seq=plan.seq, lr=args.lr)
    state = T.train_loop(model, budget, ckpt, T.distill_batch_fn(caches), T.distill_loss, args.domain, log=lambda *a: None, seed=77)
    ckpt.unlink(missing_ok=True)
    after = acceptance(model, sets)
    print(
        json.dumps(
            {
                "trained_on": args.domain,
                "steps": state["step"],
                "lr": args.lr,
                "gain": {k: round(after[k] - before[k], 3) for k in after},
                "before": before,
                "after": after,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
