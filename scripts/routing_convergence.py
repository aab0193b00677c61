"""How many requests does expertise routing need to learn each domain's specialist from acceptance alone?

A simulation, not a service: the router's own policy (`router.routing.DrafterRouter`, Thompson
sampling over the `ExpertiseStore`), fed Bernoulli acceptances at the bundled family's measured
greedy per-token rates (`models/demo/acceptance.json`, held-out). No drafter declares a
speciality and the client names the domain, as in a cold start without a prior. Per domain,
`--requests` requests of `--rounds` rounds of k = 4 drafts each, domains interleaved; the
result is the share of the last three requests' rounds led by the domain's specialist, averaged
over `--seeds` runs, and how many runs reach `--bar` in every domain.

    .venv/bin/python scripts/routing_convergence.py --requests 8,16,32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.routing import DomainClassifier, DrafterProfile, DrafterRouter, ExpertiseStore, RoutingConfig  # noqa: E402
from specfleet.config import DEMO_MODELS  # noqa: E402


def late_shares(alpha: dict, domains: list[str], drafters: list[str], requests: int, rounds: int, k: int, seed: int, overrides: dict) -> dict[str, float]:
    rng = random.Random(seed)
    config = RoutingConfig(policy="expertise", default_drafter="general", fusion_width=1, **overrides)
    router = DrafterRouter(config, [DrafterProfile(n) for n in drafters], DomainClassifier({}), ExpertiseStore(0.995), seed=seed)
    led = {d: [0, 0] for d in domains}
    for rep in range(requests):
        for domain in domains:
            routing = router.start("", domain_hint=domain)
            for _ in range(rounds):
                chosen = router.choose(routing)[0]
                hits = 0
                while hits < k and rng.random() < alpha[(chosen, domain)]:
                    hits += 1
                # as router/trees.py scores a drafter: its hits in a row, then whether it missed
                router.observe(routing, {chosen: (hits, 1 if hits < k else 0)})
                if rep >= requests - 3:
                    led[domain][0] += chosen == domain
                    led[domain][1] += 1
    return {d: hit / total for d, (hit, total) in led.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=str(DEMO_MODELS))
    ap.add_argument("--requests", default="8", help="comma-separated requests per domain to try")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--bar", type=float, default=0.6)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="RoutingConfig override, e.g. shared_evidence_cap=128")
    args = ap.parse_args()
    greedy = json.loads((Path(args.models) / "acceptance.json").read_text())["greedy"]
    drafters = sorted({key.split("|")[0] for key in greedy})
    domains = sorted({key.split("|")[1] for key in greedy})
    alpha = {(n, d): greedy[f"{n}|{d}|heldout"] for n in drafters for d in domains}
    overrides = {}
    for item in args.set:
        key, value = item.split("=", 1)
        overrides[key] = tuple(map(float, value.split(","))) if "," in value else float(value)
    print(f"| requests per domain | {' | '.join(domains)} | runs with every domain >= {args.bar} |")
    print("|---" * (len(domains) + 2) + "|")
    for requests in map(int, args.requests.split(",")):
        runs = [late_shares(alpha, domains, drafters, requests, args.rounds, args.k, seed, overrides) for seed in range(args.seeds)]
        means = [f"{statistics.mean(run[d] for run in runs):.2f}" for d in domains]
        passed = sum(min(run.values()) >= args.bar for run in runs)
        print(f"| {requests} | {' | '.join(means)} | {passed}/{args.seeds} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
