"""The verifier's whole verify pass (`Verifier._verify`: the forward pass, the verdict, the commit) of the demo
target, B sessions of 100 cached tokens (greedy, or sampled with `--temperature`: rejection sampling, or with
`--raced` the exponential race of a client's seed), with and without lookup-like chains: the median wall time of
each case over interleaved repetitions, on whatever code PYTHONPATH holds (run it in two checkouts to compare them).

    PYTHONPATH=. taskset -c 0 .venv/bin/python scripts/verify_pass_cost.py --sessions 1,4 [--reps 300] [--temperature 1 [--raced]]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from specfleet import config as config_mod
from specfleet.sampling import SamplingParams
from verifier_service.server import load_core
from verifier_service.verifier import VerifyItem

CONTEXT = 100


def cases(sessions: int) -> dict[str, tuple[int, int] | None]:
    """name: (chain length, sessions with a chain), or None for a plain pass."""
    out = {"plain": None, "1 chain of 1": (1, 1), "1 chain of 3": (3, 1)}
    if sessions > 1:
        out |= {"2 chains of 3": (3, 2), f"{sessions} chains of 3": (3, sessions)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", default="1,4")
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--raced", action="store_true", help="sessions with a client's seed: the exponential race")
    args = parser.parse_args()
    sampling = SamplingParams(temperature=args.temperature, seed=3, drafter_invariant=args.raced)
    cfg = config_mod.default_config(config_mod.REPO / ".cache")
    verifier = load_core(cfg.verifier, threads=1).verifier
    for batch in [int(s) for s in args.sessions.split(",")]:
        prompts = [[(b * 37 + j * 11) % 500 + 10 for j in range(CONTEXT)] for b in range(batch)]
        ids = [f"b{batch}s{b}" for b in range(batch)]
        verifier.verify_batch([VerifyItem(sid, 0, p, sampling) for sid, p in zip(ids, prompts)])

        def live(chain):
            out = []
            for b, sid in enumerate(ids):
                session = verifier.store.sync(sid, CONTEXT, [])  # back to the prompt: every pass verifies the same place
                item = VerifyItem(sid, CONTEXT, [], sampling)
                if chain and b < chain[1]:
                    n = chain[0]
                    item = dataclasses.replace(
                        item, tree_tokens=[5] * n, tree_parents=list(range(-1, n - 1)), proposals=[([5], [1.0])] * n, lookup_confidences=[0.6] * n
                    )
                out.append((b, item, session))
            return out

        timed = {name: [] for name in cases(batch)}
        for _ in range(args.reps):
            for name, chain in cases(batch).items():
                passes = live(chain)
                started = time.perf_counter()
                verifier._verify(passes)
                timed[name].append((time.perf_counter() - started) * 1e3)
        for name, ms in timed.items():
            print(f"{batch} sessions, {name}: {statistics.median(ms):.3f} ms")


if __name__ == "__main__":
    main()
