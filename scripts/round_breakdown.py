"""Where a served run's rounds went, by kind: from the router's per-round debug lines.

`specfleet serve` with SPECFLEET_LOG_LEVEL=DEBUG logs one line a round (router/scheduler.py `_round`). This
groups a run's rounds of one batch size by what they did: plain and unrouted (the measured check decoded them
plainly), plain (routed, nobody drafted; ranked where some request's hope made the plan rank drafters and plan
k), plain while new prompts were prefilled, plain while specialists scored
new prompts, drafting rounds that only probed (at most one draft token a request), and drafting rounds; for each,
how many, the median plan, draft-call, verify-call and wall times, the tokens committed a round, and its share of
the wall time. It is how docs/benchmarks/plan-cost.md found what the
default spends beside speculation off at four clients.

    SPECFLEET_LOG_LEVEL=DEBUG specfleet serve ... 2> serve.log
    .venv/bin/python scripts/round_breakdown.py serve.log --requests 4 [--skip ROUNDS] [--lines FIRST:END]

`--lines` reads only the log's lines [FIRST, END) (0-based, as `wc -l` counts them before and after one bench
run against the server), so that one run's rounds are told from another's: a speculation-off request's rounds
and the measured check's plain rounds look alike. "tokens a ms" is what the measured check compares (tokens
committed a round over its wall time, summed over the group's rounds).
"""

from __future__ import annotations

import argparse
import re
import statistics

LINE = re.compile(r"round: (.*)$")
KINDS = (
    "plain, unrouted (the measured check)",
    "plain",
    "plain, ranked (hopeful, not drafting)",
    "plain, prefilling prompts",
    "plain, scoring prompts",
    "probing (k <= 1 a request)",
    "drafting",
)


def rounds(path: str, skip: int, lines: tuple[int, int | None] = (0, None)) -> list[dict[str, float]]:
    found = []
    first, end = lines
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f):
            if number < first or (end is not None and number >= end):
                continue
            match = LINE.search(line)
            if match:
                found.append({k: float(v) for k, v in (field.split("=") for field in match.group(1).split())})
    return found[skip:]


def kind(r: dict[str, float]) -> str:
    if r["k"] == 0:
        if not r.get("routed", 1):
            return "plain, unrouted (the measured check)"
        if r["scored"] or r["prefills"]:
            return "plain, scoring prompts" if r["scored"] else "plain, prefilling prompts"
        return "plain, ranked (hopeful, not drafting)" if r.get("ranked", 0) else "plain"
    return "probing (k <= 1 a request)" if r["k"] <= r["requests"] else "drafting"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", help="the serve log with the router's debug lines")
    parser.add_argument("--requests", type=int, default=1, help="rounds of this many requests (default 1)")
    parser.add_argument("--skip", type=int, default=0, help="leave out the first SKIP round lines (an earlier run's)")
    parser.add_argument("--lines", default="", help="FIRST:END, only the log's lines [FIRST, END) (one run's; 0-based)")
    args = parser.parse_args()
    first, _, end = args.lines.partition(":")
    span = (int(first or 0), int(end) if end else None)
    chosen = [r for r in rounds(args.log, args.skip, span) if r["requests"] == args.requests]
    total = sum(r["wall_ms"] for r in chosen) or 1.0
    print(f"{len(chosen)} rounds of {args.requests} requests, {total / 1e3:.2f} s")
    print("| rounds | n | plan ms | draft ms | verify ms | wall ms | tokens a round | tokens a ms | share of wall |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in KINDS:
        group = [r for r in chosen if kind(r) == name]
        if not group:
            continue
        med = {key: statistics.median(r[key] for r in group) for key in ("plan_ms", "draft_ms", "verify_ms", "wall_ms")}
        committed, wall = sum(r["committed"] for r in group), sum(r["wall_ms"] for r in group)
        print(
            f"| {name} | {len(group)} | {med['plan_ms']:.2f} | {med['draft_ms']:.2f} | {med['verify_ms']:.2f} | "
            f"{med['wall_ms']:.2f} | {committed / len(group):.2f} | {committed / max(wall, 1e-9):.3f} | {wall / total:.0%} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
