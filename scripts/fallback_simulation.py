"""The measured fallback to plain decoding (router/measured_goodput.py) on a simulated lane.

One client; a drafting round drafts 4 tokens, each accepted with probability `acceptance` until the first
rejection, and takes 15 ms (14 where acceptance is lower: shorter drafts stop early); a plain round commits one
token in 8 ms; both spread uniformly by `--jitter` (a few percent by default; served rounds spread by a third or
more), and a drafting round right after a plain one pays 5 ms to catch its drafters up (and is not measured, as
the scheduler marks it). The controller's cost model is optimistic, so only the measured check decides. Each cell:
the share of rounds that drafted and tokens per ms over 4,000 rounds, the mean of five seeds, for the decision rule
as it is (two standard errors, forget 0.97) and as it was (two standard errors, forget 0.9; point estimates,
forget 0.75).

    PYTHONPATH=. .venv/bin/python scripts/fallback_simulation.py [--jitter 0.4]
"""

from __future__ import annotations

import argparse
import random

import router.measured_goodput as measured
from router.measured_goodput import MeasuredGoodput
from router.cost_model import CostModel
from router.speculation import SpeculationController

RULES = {
    "point estimates, forget 0.75 (first)": (0.0, 0.75),
    "two standard errors, forget 0.9 (before)": (2.0, 0.9),
    "two standard errors, forget 0.97 (now)": (2.0, 0.97),
}
CASES = [(0.7, 15.0), (0.6, 14.0), (0.5, 14.0), (0.4, 12.0), (0.3, 14.0), (0.2, 14.0)]  # (acceptance, drafting round ms)
PLAIN_MS, CATCH_UP_MS, ROUNDS, SEEDS = 8.0, 5.0, 4000, 5


def lane(loses_by_se: float, forget: float, acceptance: float, drafting_ms: float, seed: int, jitter: float) -> tuple[float, float]:
    measured.LOSES_BY_SE = loses_by_se
    rng = random.Random(seed)
    cost = CostModel(verify_base=5.0, verify_per_token=0.05, draft_per_token=0.3, verify_call=0.0, draft_call=0.0, pinned=True)
    controller = SpeculationController(cost=cost, measured=MeasuredGoodput(forget))
    drafted_last, drafting, tokens, ms = False, 0, 0, 0.0
    for r in range(ROUNDS):
        drafted = any(controller.plan([0.8], [4]))
        if drafted:
            accepted = next((i for i in range(4) if rng.random() >= acceptance), 4)
            round_tokens, wall = 1 + accepted, drafting_ms * rng.uniform(1 - 2 * jitter, 1 + 2 * jitter)
        else:
            round_tokens, wall = 1, PLAIN_MS * rng.uniform(1 - jitter, 1 + jitter)
        cold = drafted and not drafted_last
        wall += CATCH_UP_MS * cold
        controller.observe_round(1, round_tokens, wall, drafted, clean=not cold)
        drafted_last, drafting, tokens, ms = drafted, drafting + drafted, tokens + round_tokens, ms + wall
    return drafting / ROUNDS, tokens / ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jitter", type=float, default=0.05, help="a plain round's spread (a drafting round's: twice it)")
    args = ap.parse_args()
    saved = measured.LOSES_BY_SE
    print("| acceptance | drafting over plain decoding | " + " | ".join(f"{name}: rounds drafted, tok/ms" for name in RULES) + " |")
    print("|---|---|" + "---|" * len(RULES))
    for acceptance, drafting_ms in CASES:
        drafting_goodput = sum(acceptance**i for i in range(5)) / drafting_ms
        cells = []
        for loses_by_se, forget in RULES.values():
            runs = [lane(loses_by_se, forget, acceptance, drafting_ms, seed, args.jitter) for seed in range(SEEDS)]
            share, goodput = (sum(x) / SEEDS for x in zip(*runs))
            cells.append(f"{share:.0%}, {goodput:.4f} ({goodput / max(drafting_goodput, 1 / PLAIN_MS):.2f}x the better way)")
        print(f"| {acceptance} | {drafting_goodput * PLAIN_MS:.2f}x | " + " | ".join(cells) + " |")
    measured.LOSES_BY_SE = saved


if __name__ == "__main__":
    main()
