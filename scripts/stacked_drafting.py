"""CPU time of one drafter call (k = 4 draft steps) on the bundled drafters, each model in its own
passes against the models stacked into one pass (`specfleet/engine/stack.py`), or (--against kernel) the
stack on F.linear against the stack prepared as a drafter service prepares it (`Stack.prepare`: the bfloat16
kernel for passes of few rows, specfleet/engine/cpu_linear.py).

    .venv/bin/python scripts/stacked_drafting.py [--calls 60] [--against per-model|kernel]

Four requests of 120-token prompts, each call committing one token and drafting four, as a
router's rounds do: all on the general drafter; one specialist each; each fused from a
specialist and the general drafter (lockstep); each fused from two specialists (eight models).
Both layouts run the same calls, interleaved call by call; every draft must be identical (against the kernel,
whose sums run in another order, the share of identical drafts is printed).
Measures `time.thread_time()` (torch on one thread), so other load on the machine inflates it
little. Prints a table of median ms per call.
"""

import argparse
import random
import statistics
import time

from drafter_service.drafter import DraftItem, DraftModel, draft_batch, stack_draft_models
from specfleet.config import DEMO_MODELS
from specfleet.engine import SessionStore, configure_torch, load_model
from specfleet.sampling import SamplingParams

NAMES = ["general", "en", "de", "fr", "es", "it", "code", "structured"]
CASES = {
    "4 requests, general drafter": [("general", r, "") for r in range(4)],
    "4 requests, 4 specialists": [(NAMES[1 + r], r, "") for r in range(4)],
    "4 requests fused: specialist + general": [(NAMES[1 + r], r, f"g{r}") for r in range(4)] + [("general", r, f"g{r}") for r in range(4)],
    "4 requests fused: 2 specialists each (8 models)": [(NAMES[1 + 2 * r], r, f"g{r}") for r in range(3)]
    + [("structured", 3, "g3")]
    + [(NAMES[2 + 2 * r], r, f"g{r}") for r in range(3)]
    + [("general", 3, "g3")],
}


def load(stacked: bool, kernel: bool = False) -> dict[str, DraftModel]:
    linear = "auto" if kernel else "plain"
    models = {
        n: DraftModel(load_model(n, DEMO_MODELS / "drafters" / n, use_token_map=True, linear=linear), SessionStore(1 << 30, 1000), 16) for n in NAMES
    }
    if stacked:
        for stack in stack_draft_models(models):
            stack.prepare()
    return models


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=60)
    parser.add_argument("--against", choices=("per-model", "kernel"), default="per-model")
    args = parser.parse_args()
    configure_torch(1)
    if args.against == "kernel":
        layouts = {"stacked": load(True), "stacked, bfloat16 kernel": load(True, kernel=True)}
    else:
        layouts = {"per model": load(False), "stacked": load(True)}
    first, second = layouts
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 12000) for _ in range(120)] for _ in range(4)]
    greedy = SamplingParams()
    print(f"| call | {first} (ms) | {second} (ms) | ratio | identical drafts |\n|---|---|---|---|---|")
    for label, assign in CASES.items():
        times = {name: [] for name in layouts}
        drafts = {name: [] for name in layouts}
        lengths = {(name, m, r): 0 for name in layouts for m, r, _ in assign}
        for call in range(args.calls):
            for name, models in layouts.items():
                tagged = []
                for m, r, group in assign:
                    key = (name, m, r)
                    new = list(prompts[r]) if call == 0 else [prompts[r][call % len(prompts[r])]]
                    tagged.append((m, DraftItem(f"{m}-{r}", lengths[key], new, 4, greedy, lockstep_group=group)))
                    lengths[key] += len(new)
                started = time.thread_time()
                results = draft_batch(models, tagged)
                times[name].append(time.thread_time() - started)
                drafts[name].append([r.token_ids for r in results])
        same = sum(a == b for a, b in zip(drafts[first], drafts[second])) / args.calls
        assert same == 1 or args.against == "kernel", f"{label}: stacked drafts differ"
        a, b = (statistics.median(times[n][5:]) * 1e3 for n in layouts)
        print(f"| {label} | {a:.2f} | {b:.2f} | {b / a:.2f}x | {same:.0%} |")


if __name__ == "__main__":
    main()
