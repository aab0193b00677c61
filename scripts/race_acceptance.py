"""Acceptance of drafter-invariant (raced) drafts against rejection sampling's, on the demo models.

For held-out text of each demo domain, teacher-forced: at every position, p is the
target's shaped next-token distribution and q the drafter's, as the drafter service
proposes it (token map, truncated to `proposal_top_k` entries). Rejection sampling
accepts a draft with probability sum_v min(p(v), q(v)); the seeded exponential race
(verification.py, obligation 6) accepts it when p's and q's races pick the same token,
estimated here over `--draws` noise keys per position.

    .venv/bin/python scripts/race_acceptance.py --prompts 8 --draws 128
"""

from __future__ import annotations

import argparse

import torch

from tools.bench.workload import DOMAINS, resolve_source
from specfleet.config import DEMO_MODELS
from specfleet.engine import ForwardItem, Session, forward_batch, load_model
from specfleet.engine.sampling import probs_from_logits, race, race_keys, race_noise, truncate
from specfleet.sampling import SamplingParams

SHAPES = {"t=1.0": SamplingParams(temperature=1.0), "t=0.7 top_p=0.9": SamplingParams(temperature=0.7, top_p=0.9)}


def logits_along(loaded, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] next-token logits after each prefix of ids."""
    return forward_batch(loaded, [ForwardItem(Session(token_ids=list(ids)), ids, list(range(len(ids))))])[0]


def shaped(logits: torch.Tensor, s: SamplingParams) -> torch.Tensor:
    n = logits.shape[0]
    return probs_from_logits(logits, torch.full((n,), s.temperature), torch.full((n,), s.top_k), torch.full((n,), s.top_p))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8, help="held-out texts per domain")
    parser.add_argument("--tokens", type=int, default=96, help="tokens of each text, teacher-forced")
    parser.add_argument("--draws", type=int, default=128, help="noise keys per position for the race")
    parser.add_argument("--proposal-top-k", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = load_model("target", DEMO_MODELS / "target")
    drafters = {name: load_model(name, DEMO_MODELS / "drafters" / name, use_token_map=True) for name in ("general", *DOMAINS)}
    print("| domain | drafter | shape | positions | rejection sampling | race | race / rejection |")
    print("|---|---|---|---|---|---|---|")
    for domain in DOMAINS:
        _, rows = resolve_source(domain)
        texts = [target.tokenizer.encode(r["text"], add_special_tokens=False)[: args.tokens] for r in rows[: args.prompts]]
        for drafter_name in ("general", domain):
            drafter = drafters[drafter_name]
            for shape_name, s in SHAPES.items():
                rejection, raced, positions = 0.0, 0.0, 0
                for ids in texts:
                    p = shaped(logits_along(target, ids), s)
                    local_ids, local_q = truncate(shaped(logits_along(drafter, ids), s), args.proposal_top_k)
                    q = torch.zeros_like(p).scatter_(1, drafter.global_ids(local_ids), local_q)
                    rejection += float(torch.minimum(p, q).sum())
                    for t in range(len(ids)):
                        keys = race_keys(list(range(args.draws)), [t] * args.draws)
                        noise = race_noise(keys, torch.arange(p.shape[1]))
                        raced += float((race(p[t].expand(args.draws, -1), noise) == race(q[t].expand(args.draws, -1), noise)).double().mean())
                    positions += len(ids)
                a, b = rejection / positions, raced / positions
                print(f"| {domain} | {drafter_name} | {shape_name} | {positions} | {a:.3f} | {b:.3f} | {b / a:.2f} |", flush=True)


if __name__ == "__main__":
    main()
