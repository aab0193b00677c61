"""Would scoring a prompt with only the specialists the exemplars rank highest route it as well as scoring with all?

An experiment, not part of the serving path. A new prompt that the exemplars do not place clearly is scored by
every specialist (router/drafting.py `score_prompts`): each prefills the prompt, and the one that predicts it
best names its domain. That costs one prefill a specialist. This asks whether a shortlist (the specialists of
the exemplar classifier's N best labels, `DomainClassifier.scores`) would pick the same domain, for N = 1 to
every specialist, on the bench's workloads, prompts cut to their first 64 tokens as `specfleet bench` sends them.
Results and the command are in docs/benchmarks/served-rounds-epyc.md.

    .venv/bin/python scripts/scoring_shortlist.py mixed heldout
"""

from __future__ import annotations

import argparse
import collections
import json

from drafter_service.drafter import DraftItem, DraftModel, draft_batch, stack_draft_models
from router.server import build_drafter_router
from specfleet.config import DEMO_MODELS, REPO, default_config
from specfleet.engine import SessionStore, configure_torch, load_model
from specfleet.sampling import SamplingParams
from specfleet.tokenizer import load_tokenizer
from tools.bench.workload import WORKLOAD_DIR

PROMPT_TOKENS = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="+", help="names under tools/bench/workloads/ (mixed, heldout, ...)")
    args = parser.parse_args()
    configure_torch(1)
    cfg = default_config(REPO / ".cache")
    router = build_drafter_router(cfg, [m.name for svc in cfg.drafters for m in svc.models])
    scorers = router.scorers()
    label = {d: router.drafters[d].specialities[0] for d in scorers}
    store = SessionStore(1 << 30, 100_000)
    models = {d: DraftModel(load_model(d, DEMO_MODELS / "drafters" / d, use_token_map=True, linear="auto"), store, 16) for d in scorers}
    for stack in stack_draft_models(models):
        stack.prepare()
    tokenizer, greedy = load_tokenizer(DEMO_MODELS / "target"), SamplingParams(temperature=0.0)
    for name in args.workloads:
        rows = [json.loads(line) for line in (WORKLOAD_DIR / f"{name}.jsonl").read_text().splitlines() if line.strip()]
        same, labelled, sure, by_all = collections.Counter(), collections.Counter(), 0, 0
        for i, row in enumerate(rows):
            ids = tokenizer.encode(row["text"])[:PROMPT_TOKENS]
            text = tokenizer.decode(ids)
            results = draft_batch(models, [(d, DraftItem(f"{name}-{i}-{d}", 0, ids, 0, greedy, score_context=True)) for d in scorers])
            scores = {d: r.context_log_prob for d, r in zip(scorers, results)}
            best = label[max(scores, key=scores.get)]
            by_all += best == row["domain"]
            sure += bool(router.classifier.sure(text, router.config.exemplar_margin))
            similarity = router.classifier.scores(text)
            ranked = sorted(similarity, key=similarity.get, reverse=True)
            for n in range(1, len(ranked) + 1):
                shortlist = [d for d in scorers if label[d] in ranked[:n]]
                picked = label[max(shortlist, key=scores.get)]
                same[n] += picked == best
                labelled[n] += picked == row["domain"]
        print(f"{name}: {len(rows)} prompts; the exemplars place {sure} clearly; every specialist scoring picks the labelled domain for {by_all}")
        print("| specialists scoring | same pick as all | the labelled domain |")
        print("|---|---|---|")
        for n in sorted(same):
            print(f"| the exemplars' best {n} | {same[n]}/{len(rows)} | {labelled[n]}/{len(rows)} |")


if __name__ == "__main__":
    main()
