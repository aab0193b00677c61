"""tools/bench/passes.py: what repeated, interleaved passes say together."""

from __future__ import annotations

import pytest

from tools.bench.passes import across_passes, passes_table


def _run(label: str, load: str, tokens_per_s: float, speedup: float | None, accepted: float | None = None) -> dict:
    speculation = {"accepted_per_verification": accepted} if accepted is not None else {}
    return {"label": label, "load": load, "status": "ok", "tokens_per_s": tokens_per_s, "speedup": speedup, "speculation": speculation}


def test_the_ratio_is_the_median_of_each_pass_s_paired_ratio_not_the_ratio_of_medians():
    # The system beats the baseline in two passes of three, by a little, and loses the third by a lot: paired per
    # pass its median ratio is above 1, while its median tokens/s over the baseline's median is below.
    runs = [
        _run("base", "c1", 100.0, 1.0),
        _run("sys", "c1", 101.0, 1.01, 2.0),
        _run("base", "c1#2", 120.0, 1.0),
        _run("sys", "c1#2", 80.0, 80 / 120, 2.5),
        _run("base", "c1#3", 80.0, 1.0),
        _run("sys", "c1#3", 82.0, 82 / 80, 3.0),
        _run("sys", "c4", 50.0, None),  # one pass only: nothing to summarise
        {"label": "sys", "load": "c4#2", "status": "error", "message": "refused"},
    ]
    summary = {(row["label"], row["load"]): row for row in across_passes({"runs": runs})}
    assert set(summary) == {("base", "c1"), ("sys", "c1")}
    row = summary[("sys", "c1")]
    assert row["passes"] == 3 and row["passes_at_least_baseline"] == 2
    assert row["ratio"] == pytest.approx({"median": 1.01, "min": 80 / 120, "max": 82 / 80})
    assert row["tokens_per_s"] == {"median": 82.0, "min": 80.0, "max": 101.0}
    assert row["accepted_per_verification"] == {"median": 2.5, "min": 2.0, "max": 3.0}
    assert summary[("base", "c1")]["accepted_per_verification"] is None

    table = passes_table({"runs": runs, "baseline": "base"})
    assert "| sys | c1 | 3 | 82.0 (80.0–101.0) | 1.010× (0.667×–1.025×) | 2/3 | 2.50 (2.00–3.00) |" in table
    assert passes_table({"runs": runs[:2], "baseline": "base"}) == ""
