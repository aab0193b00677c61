"""One bench run's measuring: start each system, warm it up, run every load point on it, stop it.

`BenchSession` owns the run's results (rows, failures, errors, notes) and its progress bar; tools/bench/cli.py
builds it from the command line and calls `run`. Systems are black boxes (tools/bench/systems.py, vllm.py): a
point is their requests' outputs and timings, checked against the target alone, and their counters.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

from tools.bench import quiet, report, runner


@dataclasses.dataclass
class BenchSession:
    results: dict  # report's shape: rows go to results["runs"], problems to "failures", "errors", "notes"
    out_dir: pathlib.Path  # where each point's partial results are written as it ends
    requests: list  # the measured requests of every point (workload.Request, tokenized)
    warmup: list  # sent once to each system before its first point, at `warm_clients` clients
    warm_clients: int
    points: list[runner.LoadPoint]
    references: dict  # the target alone's greedy outputs by request id; empty where sampling
    eos: int | None
    seed: int
    measured_cpus: list[int]  # the cores the systems are pinned to; each point waits until they are idle
    repeat: int = 1  # passes over every point (--repeat)
    progress: object | None = None  # a rich Progress, or None (--no-progress)
    task: object | None = None

    def _say(self, text: str) -> None:
        if self.progress is not None:
            self.progress.update(self.task, description=text)

    def advance(self, n: int = 1) -> None:
        if self.progress is not None:
            self.progress.advance(self.task, n)

    @property
    def per_system(self) -> int:
        """Requests each system is sent over the whole run (`repeat` passes), for the progress bar."""
        return len(self.warmup) + len(self.requests) * len(self.points) * self.repeat

    async def run(self, systems: list, interleave: bool) -> None:
        """Every point on every system: interleaved (every system up at once, each point on each in turn, the
        order reversed every other pass), or each system in turn, started and stopped around its points."""
        if interleave:
            # A machine whose speed drifts during the run slows every system alike at every point.
            started = []
            try:
                for system in systems:
                    if await self.start(system):
                        started.append(system)
                        await self.warm_up(system)
                for repeat in range(1, self.repeat + 1):
                    order = started if repeat % 2 else started[::-1]
                    for p in self.points:
                        for system in order:
                            await self.measure(system, p, repeat)
            finally:
                for system in started:
                    await self.stop(system)
            return
        for system in systems:
            if not await self.start(system):
                continue
            try:
                await self.warm_up(system)
                for p in self.points:
                    await self.measure(system, p)
            finally:
                await self.stop(system)

    async def start(self, system) -> bool:
        """Start a system; one that cannot start gets failed or unavailable rows and is skipped."""
        from tools.bench.vllm import VLLMUnavailable

        desc = {**system.describe()}
        self.results["systems"].append(desc)
        self._say(f"{system.label}: starting")
        t0 = time.perf_counter()
        try:
            await system.start()
        except VLLMUnavailable as err:
            self._rows_without_numbers(system, "unavailable", str(err))
            self.results["notes"].append(f"{system.label}: unavailable: {err}")
            return False
        except Exception as err:  # a system that cannot start is an error of the run, reported in its row
            msg = f"{type(err).__name__}: {err}"
            self._rows_without_numbers(system, "failed", msg.splitlines()[0])
            self.results["errors"].append(f"{system.label} did not start: {msg}")
            return False
        desc["startup_s"] = round(time.perf_counter() - t0, 2)
        desc["command"] = getattr(system, "command", None)
        return True

    def _rows_without_numbers(self, system, status: str, message: str) -> None:
        for p in self.points:
            self.results["runs"].append({"label": system.label, "system": system.name, "load": p.label, "status": status, "message": message})
        self.advance(self.per_system)

    async def warm_up(self, system) -> None:
        if self.warmup:
            self._say(f"{system.label}: warm-up")
            await runner.run_load(system, self.warmup, runner.LoadPoint("closed", self.warm_clients), self.seed, self.advance)

    async def measure(self, system, p: runner.LoadPoint, repeat: int = 1) -> None:
        """One load point on one system, once its cores are idle: its row, and a failure for every output that
        differs from the target alone's."""
        label = p.label if repeat == 1 else f"{p.label}#{repeat}"
        self._say(f"{system.label}: {p.describe()}" + (f", pass {repeat}" if repeat > 1 else ""))
        settle_s = await quiet.until_idle(self.measured_cpus) if self.measured_cpus else 0.0
        if settle_s >= quiet.TIMEOUT_S:
            self.results["notes"].append(f"{label} of {system.label}: cores {self.measured_cpus} were still busy after {quiet.TIMEOUT_S:.0f} s")
        before = system.counters()
        records, start, end = await runner.run_load(system, self.requests, p, self.seed, self.advance)
        delta = runner.counters_delta(before, system.counters()) if before else {}
        m = runner.summarize(records, (start, end), self.references, self.eos, delta)
        self.results["runs"].append(
            {
                "label": system.label,
                "system": system.name,
                "load": label,
                "load_kind": "open" if p.kind == "replay" else p.kind,
                "load_value": p.value,
                "load_description": p.describe(),
                "repeat": repeat,
                "status": "ok",
                "settle_s": round(settle_s, 2),
                **m,
                "per_request": [_per_request(r) for r in sorted(records, key=lambda r: r.arrival)],
            }
        )
        if m["mismatches"]:
            ex = m["mismatch_examples"][0]
            self.results["failures"].append(
                f"{system.label} at {label}: {m['mismatches']}/{m['checked']} outputs differ from the target alone "
                f"(e.g. {ex['request']} from token {ex['first_diff']}: got {ex['got']}, want {ex['want']})"
            )
        if m["errors"]:
            self.results["errors"].append(f"{system.label} at {label}: {m['errors']} failed requests, e.g. {m['error_examples'][0]}")
        report.write_partial(self.results, self.out_dir)  # a run cut short (a deadline, Ctrl-C) keeps what it measured

    async def stop(self, system) -> None:
        self._say(f"{system.label}: stopping")
        await system.stop()


def _per_request(r: runner.Record) -> dict:
    out = r.output
    return {
        "id": r.request.id,
        "domain": r.request.domain,
        "tokens": len(out.token_ids),
        "latency_ms": round((out.t_done - r.arrival) * 1e3, 3),
        "ttft_ms": None if out.t_first is None else round((out.t_first - r.arrival) * 1e3, 3),
        "error": out.error,
        "stats": out.stats,
    }


def add_ratios(results: dict, baseline: str, labels: set[str]) -> None:
    """Each row's tokens/s and p50 latency over the baseline's at the same load point (and pass)."""
    base = {r["load"]: r for r in results["runs"] if r["label"] == baseline and r.get("status") == "ok"}
    for r in results["runs"]:
        b = base.get(r.get("load"))
        if r.get("status") == "ok" and b:
            r["speedup"] = r["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else None
            bl, rl = b["latency_ms"]["p50"], r["latency_ms"]["p50"]
            r["latency_p50_ratio"] = rl / bl if bl and rl else None
    if baseline not in labels:
        results["notes"].append(f"baseline {baseline!r} was not run: no ratios")
