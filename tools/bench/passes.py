"""What repeated passes say together: per system and load point, the median of its passes and the spread.

With `--interleave --repeat N`, each pass runs every load point on every system in turn, so a system's run and the
baseline's in the same pass saw the same machine. Their ratio is paired that way (`session.add_ratios`); across
passes, the median of those paired ratios is what a bar reads ("at least the baseline, median of passes"), and the
spread and the count of passes at or above 1.00x say how far the machine's noise reaches. A shared machine moves one
system 5-15% from pass to pass, so a single pass decides nothing.
"""

from __future__ import annotations

import statistics


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def across_passes(results: dict) -> list[dict]:
    """Per (system, load point) measured in two passes or more: tokens/s, the ratio to the baseline of the same pass
    and accepted tokens per verification, each as median, min and max over the passes; and how many passes the system
    served at least as many tokens/s as the baseline."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in results["runs"]:
        if run.get("status") == "ok":
            groups.setdefault((run["label"], run["load"].split("#")[0]), []).append(run)
    summary = []
    for (label, load), runs in groups.items():
        if len(runs) < 2:
            continue
        ratios = [r["speedup"] for r in runs if r.get("speedup") is not None]
        accepted = [a for r in runs if (a := (r.get("speculation") or {}).get("accepted_per_verification")) is not None]
        summary.append(
            {
                "label": label,
                "load": load,
                "passes": len(runs),
                "tokens_per_s": _spread([r["tokens_per_s"] for r in runs]),
                "ratio": _spread(ratios) if ratios else None,
                "passes_at_least_baseline": sum(1 for x in ratios if x >= 1.0),
                "accepted_per_verification": _spread(accepted) if accepted else None,
            }
        )
    return summary


def passes_table(results: dict) -> str:
    """The Markdown table of `across_passes` (results["across_passes"], or computed from the runs of results saved
    before it was stored); "" where no point ran twice."""
    rows = results.get("across_passes") or across_passes(results)
    if not rows:
        return ""

    def cell(spread: dict | None, fmt: str) -> str:
        if spread is None:
            return "–"
        return f"{fmt.format(spread['median'])} ({fmt.format(spread['min'])}–{fmt.format(spread['max'])})"

    lines = [
        f"| system | load | passes | out tok/s | × {results['baseline']} | passes ≥ 1.00× | accepted / verify |",
        "|" + "---|" * 7,
    ]
    for row in rows:
        at_least = f"{row['passes_at_least_baseline']}/{row['passes']}" if row["ratio"] else "–"
        lines.append(
            f"| {row['label']} | {row['load']} | {row['passes']} | {cell(row['tokens_per_s'], '{:.1f}')} "
            f"| {cell(row['ratio'], '{:.3f}×')} | {at_least} | {cell(row['accepted_per_verification'], '{:.2f}')} |"
        )
    return "\n".join(lines)
