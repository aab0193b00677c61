"""Runs systems against load points, checks outputs against the target alone, and computes the metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import pathlib
import statistics
import time
from dataclasses import dataclass, field

from tools.bench.catalog import SYSTEMS
from tools.bench.systems import MODEL_FREE, Family, HFTarget, Output, Settings, System
from tools.bench.workload import Request, poisson_arrivals

REPO = pathlib.Path(__file__).resolve().parent.parent.parent


# --- the model family ------------------------------------------------------------------------------------------


def resolve_family(models: str, drafter: str | None, cache: pathlib.Path) -> Family:
    """auto: the demo models when built, else the random family; demo; random; or a directory laid out like models/demo."""
    from specfleet.config import DEMO_MODELS

    def from_dir(root: pathlib.Path, name: str) -> Family:
        # models/demo layout (target/, drafters/<name>/) or the random family's (target/, drafter-<name>/)
        target = root / "target"
        candidates = sorted((root / "drafters").iterdir()) if (root / "drafters").is_dir() else sorted(root.glob("drafter-*"))
        drafters = {d.name: d for d in candidates if (d / "config.json").exists()}
        if not (target / "config.json").exists() or not drafters:
            raise FileNotFoundError(f"{root}: expected target/ and drafters/<name>/ (or drafter-<name>/) model directories")
        if (root / "drafters").is_dir():
            # The model-free n-gram drafter, a member of `specfleet serve`'s demo fleet (its path: the target's tokenizer).
            drafters[MODEL_FREE] = target
        return Family(name, target, drafters, _pick(drafters, drafter, "general" if "general" in drafters else "drafter-noisy"))

    if models == "demo" or (models == "auto" and (DEMO_MODELS / "target" / "config.json").exists()):
        return from_dir(DEMO_MODELS, "demo")
    if models in ("auto", "random"):
        from specfleet.random_models import ensure_random_family

        # 32-wide heads: vLLM's CPU attention refuses the 16-wide heads of the test family.
        paths = ensure_random_family(cache / "bench-random-models", head_dim=32)
        drafters = {n: paths[n] for n in ("drafter-noisy", "drafter-copy", "drafter-random")}
        return Family("random", paths["target"], drafters, _pick(drafters, drafter, "drafter-noisy"))
    return from_dir(pathlib.Path(models), str(models))


def _pick(drafters: dict, wanted: str | None, default: str) -> str:
    if wanted:
        if wanted not in drafters:
            raise ValueError(f"--drafter {wanted!r}: not one of {sorted(drafters)}")
        return wanted
    return default if default in drafters else next(iter(drafters))


# --- load points -----------------------------------------------------------------------------------------------


@dataclass
class LoadPoint:
    kind: str  # "closed" (N concurrent clients) or "open" (Poisson arrivals at rate r/s) or "replay"
    value: float

    @property
    def label(self) -> str:
        if self.kind == "closed":
            return f"c{int(self.value)}"
        if self.kind == "replay":
            return "replay"
        return f"r{self.value:g}"

    def describe(self) -> str:
        if self.kind == "closed":
            return f"closed loop, {int(self.value)} client(s)"
        if self.kind == "replay":
            return "open loop, recorded arrivals"
        return f"open loop, Poisson {self.value:g} req/s"


@dataclass
class Record:
    request: Request
    output: Output
    arrival: float  # perf_counter at which the request was due (open loop) or sent (closed loop)


async def run_load(system: System, requests: list[Request], point: LoadPoint, seed: int, on_done=None) -> tuple[list[Record], float, float]:
    """Send the requests at this load point; returns the records and the wall span (start, end)."""
    records: list[Record] = []
    start = time.perf_counter()

    async def one(req: Request, due: float):
        out = await system.generate(req)
        records.append(Record(req, out, due))
        if on_done:
            on_done()

    if point.kind == "closed":
        queue = list(requests)

        async def client():
            while queue:
                req = queue.pop(0)
                await one(req, time.perf_counter())

        await asyncio.gather(*(client() for _ in range(max(1, int(point.value)))))
    else:
        if point.kind == "replay":
            arrivals = [r.arrival_s or 0.0 for r in requests]
        else:
            arrivals = poisson_arrivals(len(requests), point.value, seed)
        tasks = []
        for req, offset in sorted(zip(requests, arrivals), key=lambda x: x[1]):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, start + offset)))
        await asyncio.gather(*tasks)
    end = time.perf_counter()
    return records, start, end


# --- the reference: the target alone, greedy (transformers generate) -----------------------------------------------


def reference_outputs(family: Family, settings: Settings, requests: list[Request], on_done=None) -> dict[tuple, list[int]]:
    """Greedy target-only output ids for every distinct (prompt, max_tokens)."""
    import torch

    torch.set_num_threads(settings.threads)
    ref = HFTarget(family, dataclasses.replace(settings, cpus=None))
    ref.model = HFTarget.load(family.target, settings.dtype, settings.device)
    out: dict[tuple, list[int]] = {}
    for req in requests:
        key = (tuple(req.prompt_ids), req.max_tokens)
        if key not in out:
            out[key] = ref._generate_sync(req, time.perf_counter()).token_ids
        if on_done:
            on_done()
    return out


def compare(ids: list[int], ref: list[int], eos: int | None) -> int | None:
    """None when equal (trailing EOS ignored), else the index of the first differing token."""
    a, b = list(ids), list(ref)
    for seq in (a, b):
        while seq and eos is not None and seq[-1] == eos:
            seq.pop()
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


# --- metrics ----------------------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    if len(v) == 1:
        return v[0]
    pos = (len(v) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _mean(values):
    return statistics.fmean(values) if values else None


def summarize(records: list[Record], span: tuple[float, float], references: dict, eos: int | None, counters_delta: dict) -> dict:
    ok = [r for r in records if r.output.error is None]
    errors = [f"{r.request.id}: {r.output.error}" for r in records if r.output.error]
    mismatches = []
    for r in ok:
        ref = references.get((tuple(r.request.prompt_ids), r.request.max_tokens))
        if ref is None:
            continue
        where = compare(r.output.token_ids, ref, eos)
        if where is not None:
            mismatches.append(
                {"request": r.request.id, "first_diff": where, "got": r.output.token_ids[where : where + 5], "want": ref[where : where + 5]}
            )
    # wall: from the first request's arrival to the last completion
    t0 = min((r.arrival for r in records), default=span[0])
    t1 = max((r.output.t_done for r in records), default=span[1])
    wall = max(1e-9, t1 - t0)
    out_tokens = sum(len(r.output.token_ids) for r in ok)
    latency = [(r.output.t_done - r.arrival) * 1e3 for r in ok]
    ttft = [(r.output.t_first - r.arrival) * 1e3 for r in ok if r.output.t_first is not None]
    tpot = [
        (r.output.t_done - r.output.t_first) * 1e3 / (len(r.output.token_ids) - 1)
        for r in ok
        if r.output.t_first is not None and len(r.output.token_ids) > 1
    ]
    per_req_tps = [len(r.output.token_ids) / max(1e-9, r.output.t_done - r.arrival) for r in ok]
    m = {
        "requests": len(records),
        "errors": len(errors),
        "error_examples": errors[:5],
        "checked": sum(1 for r in ok if (tuple(r.request.prompt_ids), r.request.max_tokens) in references),
        "mismatches": len(mismatches),
        "mismatch_examples": mismatches[:5],
        "wall_s": wall,
        "output_tokens": out_tokens,
        "tokens_per_s": out_tokens / wall,
        "request_tokens_per_s_mean": _mean(per_req_tps),
        "ttft_ms": {"mean": _mean(ttft), "p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
        "tpot_ms": {"mean": _mean(tpot), "p50": pct(tpot, 50), "p90": pct(tpot, 90), "p99": pct(tpot, 99)},
        "latency_ms": {"mean": _mean(latency), "p50": pct(latency, 50), "p90": pct(latency, 90), "p99": pct(latency, 99)},
    }
    spec = [r for r in ok if r.output.stats]
    if spec:
        m["speculation"] = speculation_summary(spec)
    if counters_delta:
        m["server_counters"] = counters_delta
        busy_s = counters_delta.get("specfleet:verify_busy_seconds_total")
        if busy_s is not None and "speculation" in m:
            # exact: the verifier's reported compute over this load point's wall time
            m["speculation"]["verifier_busy_fraction_estimate"] = m["speculation"]["verifier_busy_fraction"]
            m["speculation"]["verifier_busy_fraction"] = busy_s / wall
            m["speculation"]["verifier_busy_source"] = "router /metrics verify_busy_seconds_total / wall"
        if counters_delta.get("specfleet:rounds_total") and "speculation" in m:
            m["speculation"]["server_rounds"] = counters_delta["specfleet:rounds_total"]
        drafts = counters_delta.get("vllm:spec_decode_num_draft_tokens")
        accepted = counters_delta.get("vllm:spec_decode_num_accepted_tokens")
        n_drafts = counters_delta.get("vllm:spec_decode_num_drafts")
        if drafts:
            m["speculation"] = {
                "source": "vLLM /metrics",
                "draft_tokens": drafts,
                "accepted_tokens": accepted,
                "acceptance_rate": (accepted or 0) / drafts,
                "accepted_per_verification": (accepted or 0) / n_drafts if n_drafts else None,
            }
    return m


def speculation_summary(records: list[Record]) -> dict:
    tot = lambda key: sum(r.output.stats.get(key, 0.0) for r in records)  # noqa: E731
    rounds = tot("rounds")
    draft, accepted = tot("draft_tokens"), tot("accepted_tokens")
    latency_ms = sum((r.output.t_done - r.arrival) * 1e3 for r in records)
    per_drafter: dict[str, dict] = {}
    per_domain: dict[str, dict] = {}
    for r in records:
        for name, d in r.output.stats.get("drafters", {}).items():
            for bucket in (
                per_drafter.setdefault(name, {}),
                per_domain.setdefault(f"{r.request.domain}/{name}", {"domain": r.request.domain, "drafter": name}),
            ):
                for k in ("rounds", "draft_tokens", "accepted_tokens"):
                    bucket[k] = bucket.get(k, 0) + d[k]
    routed: dict[str, dict[str, int]] = {}  # true domain -> the router's assigned domain -> requests
    for r in records:
        if r.output.stats.get("routed_domain") is not None:
            by = routed.setdefault(r.request.domain, {})
            key = r.output.stats["routed_domain"] or "(none)"
            by[key] = by.get(key, 0) + 1
    for bucket in [*per_drafter.values(), *per_domain.values()]:
        bucket["acceptance_rate"] = bucket["accepted_tokens"] / bucket["draft_tokens"] if bucket["draft_tokens"] else None
        bucket["accepted_per_verification"] = bucket["accepted_tokens"] / bucket["rounds"] if bucket["rounds"] else None
    out_tokens = sum(len(r.output.token_ids) for r in records)
    dw, dc, vw, vc = tot("draft_wall_ms"), tot("draft_compute_ms"), tot("verify_wall_ms"), tot("verify_compute_ms")
    dq, vq, router = tot("draft_queue_ms"), tot("verify_queue_ms"), tot("router_ms")
    per_round = lambda x: x / rounds if rounds else None  # noqa: E731
    return {
        "source": "specfleet SpeculationStats",
        "rounds": rounds,
        "draft_tokens": draft,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / draft if draft else None,
        "accepted_per_verification": accepted / rounds if rounds and draft else None,
        "tokens_per_round": out_tokens / rounds if rounds else None,
        "per_drafter": per_drafter,
        "per_domain": per_domain,
        "routed_domains": routed,
        # Σ verify compute over Σ request lifetime: exact at one client, an approximation otherwise (it assumes
        # concurrent requests share verify batches); replaced by the router's own counter when it exports one.
        "verifier_busy_fraction": vc / latency_ms if latency_ms else None,
        "per_round_ms": {
            "draft_wall": per_round(dw),
            "draft_compute": per_round(dc),
            "verify_wall": per_round(vw),
            "verify_compute": per_round(vc),
            # network: the calls' wall less the servers' compute, split into the servers' queues and transport.
            "network": per_round((dw - dc) + (vw - vc)),
            "draft_network": per_round(dw - dc),
            "verify_network": per_round(vw - vc),
            "draft_queue": per_round(dq),
            "verify_queue": per_round(vq),
            "draft_transport": per_round(dw - dc - dq),
            "verify_transport": per_round(vw - vc - vq),
            "queue": per_round(dq + vq),
            "transport": per_round((dw - dc - dq) + (vw - vc - vq)),
            "router": per_round(router),  # the router's own time in the round, beside its calls
        },
    }


def counters_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0)}


# --- one benchmark ----------------------------------------------------------------------------------------------


@dataclass
class SystemSpec:
    name: str
    label: str
    kwargs: dict = field(default_factory=dict)


def parse_system(text: str) -> SystemSpec:
    """NAME or LABEL=NAME (e.g. 'k8=specfleet'); systems are listed in catalog.SYSTEMS."""
    label, _, name = text.partition("=") if "=" in text else (text, "", text)
    name = name.strip()
    if name == "specfleet-attached":
        raise ValueError("specfleet-attached needs an address: use --attach LABEL=HOST:PORT[:off]")
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")
    return SystemSpec(name=name, label=label.strip())
