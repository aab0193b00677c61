"""How many requests does expertise routing need to learn each domain's specialist from acceptance alone?

A simulation, not a service: the router's own policy (`router.routing.DrafterRouter`, Thompson
sampling over the `ExpertiseStore`), fed Bernoulli acceptances at the bundled family's measured
greedy per-token rates (`models/demo/acceptance.json`, held-out). No drafter declares a
speciality and the client names the domain, as in a cold start without a prior. Per domain,
`--requests` requests of k = 4 drafts a round, domains interleaved (a request per domain at a
time); a request runs `--rounds` rounds, or with `--max-tokens` until it has that many tokens
(each round emits the drafts accepted in a row and the target's own token). `--spread` makes
prompts differ: each request shifts every drafter's log-odds of acceptance by the same normal
draw. The result is the share of the last `--late` requests' drafting rounds led by the domain's
specialist, averaged over `--seeds` runs, the lowest domain's share in the worst run, and how
many runs reach `--bar` in every domain, or with `--need N` in at least N domains.

`--adaptation` then measures what a router that converges gives up, after it has learned the
first `--requests` count per domain: how much of a request labelled code that behaves like de
(its rounds 10-30) leaves the code drafter, and how many de requests pass before the general
drafter leads three in a row when the de drafter drops to 0.5, or the general drafter rises to
0.9, in de (median and worst over the seeds; 200 means never).

    .venv/bin/python scripts/routing_convergence.py --requests 8,16,32,64 --adaptation
    .venv/bin/python scripts/routing_convergence.py --requests 8,16,32,64 --set shared_evidence_cap=32 --set request_weight=2
    # the protocol of tests/e2e/test_routing_convergence.py: three domains, their specialists and general
    .venv/bin/python scripts/routing_convergence.py --domains de,code,it --drafters general,de,code,it \\
        --requests 60 --max-tokens 32 --late 12 --bar 0.55 --need 2 --seeds 1500 --spread 0.5 \\
        --rate 'general|de=0.58' --rate 'de|de=0.71' --rate 'general|code=0.57' --rate 'code|code=0.65' \\
        --rate 'general|it=0.53' --rate 'it|it=0.62'
    # its control: no evidence shared between requests (each request learns alone)
    ... --set shared_evidence_cap=1e-9
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from router.domains import DomainClassifier  # noqa: E402
from router.expertise import ExpertiseStore  # noqa: E402
from router.routing import DrafterProfile, DrafterRouter, RoutingTuning  # noqa: E402
from specfleet.config import RoutingConfig  # noqa: E402
from specfleet.config import DEMO_MODELS  # noqa: E402


@dataclass
class Workload:
    alpha: dict  # (drafter, domain) -> per-token acceptance
    drafters: list[str]
    k: int = 4
    rounds: int = 10
    max_tokens: int = 0
    spread: float = 0.0


def make_router(drafters: list[str], seed: int, overrides: dict) -> DrafterRouter:
    config = RoutingConfig(routing_policy="expertise", default_drafter="general", fusion_width=1)
    profiles = [DrafterProfile(n) for n in drafters]
    return DrafterRouter(config, profiles, DomainClassifier({}), ExpertiseStore(0.995), seed=seed, tuning=RoutingTuning(**overrides))


def run_request(router: DrafterRouter, rng: random.Random, work: Workload, label: str, behaves_like: str = "", rounds: int = 0) -> list[str]:
    """One request the client labels `label`, accepted at the rates of `behaves_like` (default: the label): its rounds' leaders."""
    routing = router.start("", domain_hint=label)
    # how much easier or harder than the domain's average this prompt is, for every drafter alike
    shift = rng.gauss(0.0, work.spread) if work.spread else 0.0
    rates = {}
    for n in work.drafters:
        a = work.alpha[(n, behaves_like or label)]
        rates[n] = 1 / (1 + math.exp(-(math.log(a / (1 - a)) + shift)))
    produced, led = 0, []
    budget = work.max_tokens if work.max_tokens and not rounds else 0
    while (produced < budget - 1) if budget else (len(led) < (rounds or work.rounds)):  # the last token needs no drafts
        depth = min(work.k, budget - 1 - produced) if budget else work.k
        chosen = router.choose(routing)[0]
        hits = 0
        while hits < depth and rng.random() < rates[chosen]:
            hits += 1
        # as router/trees.py scores a drafter: its hits in a row, then whether it missed
        router.observe(routing, {chosen: (hits, 1 if hits < depth else 0)})
        produced += hits + 1
        led.append(chosen)
    return led


def learn(router: DrafterRouter, rng: random.Random, work: Workload, domains: list[str], requests: int, late: int) -> dict[str, float]:
    """`requests` requests per domain, domains interleaved; the specialist's share of the last `late` requests' rounds."""
    led = {d: [0, 0] for d in domains}
    for rep in range(requests):
        for domain in domains:
            chosen = run_request(router, rng, work, domain)
            if rep >= requests - late:
                led[domain][0] += chosen.count(domain)
                led[domain][1] += len(chosen)
    return {d: hit / max(1, total) for d, (hit, total) in led.items()}


def acceptance_stream(seed: int) -> random.Random:
    # Not the router's seed: the same stream would replay the router's own draws as acceptances,
    # and a drafter chosen for a high draw would then miss.
    return random.Random(f"acceptance {seed}")


def late_shares(work: Workload, domains: list[str], requests: int, seed: int, overrides: dict, late: int = 3) -> dict[str, float]:
    return learn(make_router(work.drafters, seed, overrides), acceptance_stream(seed), work, domains, requests, late)


def adaptation(work: Workload, domains: list[str], requests: int, seed: int, overrides: dict) -> tuple[float, int, int]:
    """After learning: (share of rounds 10-30 off the code drafter in a code-labelled request that behaves like de,
    de requests until general leads when the de drafter drops to 0.5, the same when general rises to 0.9)."""
    outcome = []
    for change in (None, {("de", "de"): 0.5}, {("general", "de"): 0.9}):
        router, rng = make_router(work.drafters, seed, overrides), acceptance_stream(seed)
        learn(router, rng, work, domains, requests, 0)
        if change is None:
            chosen = run_request(router, rng, work, "code", behaves_like="de", rounds=40)
            outcome.append(sum(c != "code" for c in chosen[10:30]) / 20)
            continue
        changed = Workload(**{**work.__dict__, "alpha": {**work.alpha, **change}})
        streak, passed = 0, 200
        for i in range(200):
            chosen = run_request(router, rng, changed, "de")
            streak = streak + 1 if chosen.count("general") > len(chosen) / 2 else 0
            if streak == 3:
                passed = i - 2
                break
        outcome.append(passed)
    return tuple(outcome)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=str(DEMO_MODELS))
    ap.add_argument("--requests", default="8", help="comma-separated requests per domain to try")
    ap.add_argument("--rounds", type=int, default=10, help="rounds a request (without --max-tokens)")
    ap.add_argument("--max-tokens", type=int, default=0, help="tokens a request instead of a fixed number of rounds")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--late", type=int, default=3, help="the last this many requests per domain are scored")
    ap.add_argument("--domains", default="", help="comma-separated domains (default: all)")
    ap.add_argument("--drafters", default="", help="comma-separated drafters served (default: all)")
    ap.add_argument("--spread", type=float, default=0.0, help="standard deviation of a per-request shift of every drafter's log-odds of acceptance")
    ap.add_argument("--rate", action="append", default=[], metavar="DRAFTER|DOMAIN=ALPHA", help="replace one measured rate, e.g. general|de=0.58")
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--bar", type=float, default=0.6)
    ap.add_argument("--need", type=int, default=0, help="domains that must reach --bar in a run (default: all)")
    ap.add_argument("--adaptation", action="store_true", help="also measure overturn and drift after the first --requests count")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="RoutingTuning override, e.g. shared_evidence_cap=128")
    args = ap.parse_args()
    greedy = json.loads((Path(args.models) / "acceptance.json").read_text())["greedy"]
    drafters = args.drafters.split(",") if args.drafters else sorted({key.split("|")[0] for key in greedy})
    domains = args.domains.split(",") if args.domains else sorted({key.split("|")[1] for key in greedy})
    alpha = {(n, d): greedy[f"{n}|{d}|heldout"] for n in drafters for d in {*domains, "de"}}
    for item in args.rate:
        key, value = item.split("=", 1)
        alpha[tuple(key.split("|", 1))] = float(value)
    work = Workload(alpha, drafters, args.k, args.rounds, args.max_tokens, args.spread)
    overrides = {}
    for item in args.set:
        key, value = item.split("=", 1)
        overrides[key] = tuple(map(float, value.split(","))) if "," in value else float(value)
    counts = [int(n) for n in args.requests.split(",")]
    need = args.need or len(domains)
    reach = "every domain" if need == len(domains) else f"{need} of {len(domains)} domains"
    print(f"| requests per domain | {' | '.join(domains)} | lowest domain, worst run | runs with {reach} >= {args.bar} |")
    print("|---" * (len(domains) + 3) + "|")
    for requests in counts:
        runs = [late_shares(work, domains, requests, seed, overrides, args.late) for seed in range(args.seeds)]
        means = [f"{statistics.mean(run[d] for run in runs):.2f}" for d in domains]
        worst = min(min(run.values()) for run in runs)
        passed = sum(sum(share >= args.bar for share in run.values()) >= need for run in runs)
        print(f"| {requests} | {' | '.join(means)} | {worst:.2f} | {passed}/{args.seeds} |", flush=True)
    if args.adaptation:
        runs = [adaptation(work, domains, counts[0], seed, overrides) for seed in range(args.seeds)]
        away, worse, better = zip(*runs)
        print(
            f"after {counts[0]} requests per domain: a code request behaving like de leaves the code drafter in {statistics.mean(away):.2f} of "
            f"its rounds 10-30 (worst run {min(away):.2f}); de drafter drops to 0.5: general leads after {statistics.median(worse):g} "
            f"de requests (worst {max(worse)}); general rises to 0.9: after {statistics.median(better):g} (worst {max(better)})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
