"""How long the router takes to plan one round (`Planning.plan`): routing, consolidation, k, helpers.

Synthetic rounds of 1, 4 and 16 requests among the demo family's eight drafters (seven specialists, the general
drafter), each request in a domain of its own in turn, adaptive speculation on, fusion_width 1; the best of five
timings of 300 plans each. Give a checkout's root to time that tree's router (an older commit: `git worktree add`).

    .venv/bin/python scripts/plan_cost.py [ROOT]

Timings on a shared machine move by a half between runs. `--plans N` runs N plans a size untimed, for an
instruction count that does not: the difference between two counts under callgrind, divided by the plans between
them, is what one plan executes (docs/benchmarks/plan-cost.md):

    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python scripts/plan_cost.py [ROOT] --sizes 4 --plans 600
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else str(Path(__file__).resolve().parents[1])
sys.path.insert(0, ROOT)

from router.drafters import DrafterService  # noqa: E402
from router.planning import Planning  # noqa: E402
from router.request import RequestSpec, RequestState  # noqa: E402
from router.rounds import RoundContext, SchedulerConfig  # noqa: E402
from router.domains import DomainClassifier  # noqa: E402
from router.expertise import ExpertiseStore  # noqa: E402
from router.routing import DrafterProfile, DrafterRouter  # noqa: E402
from router.speculation import SpeculationController  # noqa: E402

try:  # an older checkout (ROOT) keeps the cost model beside the controller
    from router.cost_model import CostModel  # noqa: E402
except ImportError:
    from router.speculation import CostModel  # noqa: E402
from specfleet.config import RoutingConfig, SpeculationConfig  # noqa: E402
from specfleet.sampling import SamplingParams  # noqa: E402

DOMAINS = ["code", "de", "en", "es", "fr", "it", "structured"]


def request(i: int) -> RequestState:
    spec = RequestSpec(
        request_id=f"s{i}",
        session_id=f"s{i}",
        prompt_ids=[1, 2, 3],
        max_tokens=32,
        sampling=SamplingParams(),
        stop=[],
        stop_at_eos=True,
        max_draft_tokens=4,
        domain="",
    )
    # Past its first round (which decodes plainly): it may draft, and a round without drafts decodes plain steps.
    return RequestState(spec=spec, tokenizer=None, eos_token_id=0, max_context=512, deadline=None, tokens=[1, 2, 3], rounds=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=ROOT, help="the checkout whose router is timed (default: this one)")
    parser.add_argument("--sizes", default="1,4,16", help="requests a round, comma separated")
    parser.add_argument("--plans", type=int, default=0, help="run this many plans a size untimed (for callgrind), after 50 warm-up plans")
    parser.add_argument(
        "--acceptance",
        type=float,
        default=None,
        help="give every drafter 256 draft tokens of evidence at this acceptance in every domain, so that rounds are planned "
        "as in steady traffic (default: no evidence, the priors alone)",
    )
    args = parser.parse_args()
    profiles = [DrafterProfile(d, [d]) for d in DOMAINS] + [DrafterProfile("general")]
    service = DrafterService("drafters", [SimpleNamespace(name="drafters-0")])
    router = DrafterRouter(
        RoutingConfig(routing_policy="expertise", default_drafter="general", fusion_width=1),
        profiles,
        DomainClassifier({}),
        ExpertiseStore(0.99),
    )
    controller = SpeculationController(CostModel(), settings=SpeculationConfig(remeasure_every=0))
    planning = Planning(RoundContext(SchedulerConfig(), {p.name: service for p in profiles}, router, controller))
    router.rng.seed(0)
    if args.acceptance is not None:
        for domain in DOMAINS:
            for profile in profiles:
                router.store.add(domain, profile.name, 256 * args.acceptance, 256 * (1 - args.acceptance))
    for n in (int(size) for size in args.sizes.split(",")):
        batch = [request(i) for i in range(n)]
        for i, state in enumerate(batch):
            state.routing = router.start("x", domain_hint=DOMAINS[i % len(DOMAINS)])
        for _ in range(50 + args.plans):
            planning.plan(batch, overlap=False)
        if args.plans:
            continue
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(300):
                planning.plan(batch, overlap=False)
            best = min(best, (time.perf_counter() - started) / 300 * 1e3)
        print(f"{n} requests, {len(profiles)} drafters: {best:.3f} ms a plan (best of 5 timings of 300)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
