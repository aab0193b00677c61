"""What the stages of a round share: the scheduler's settings, its counters, and the live parts.

A round runs in three stages, each in its own module: admission and lanes
(`scheduler.py`), planning and drafting (`drafting.py`), verification, commit
and learning (`verifying.py`). They share one `Round` object, so that a config
reload swaps the drafters and the routing policy in one place for all of them.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from router.drafters import DrafterService
from router.request import DrafterCounts, RequestState
from router.routing import DrafterRouter
from router.speculation import SpeculationController
from specfleet import limits
from specfleet.v1 import common_pb2

# A call's deadline grows by a second per this many new tokens it sends (prefilled there): a prefill
# rate no drafter or verifier falls below, so a call that catches a long context up is not cut short.
PREFILL_TOKENS_PER_S = 64.0


@dataclass
class SchedulerConfig:
    max_running: int
    max_queued: int
    rpc_timeout_s: float
    pipeline_depth: int = 2
    # What one call to the verifier, and to each drafter service by name, may carry: larger
    # batches travel as several calls (specfleet/limits.py).
    verify_limits: limits.CallLimits = field(default_factory=limits.CallLimits)
    draft_limits: dict[str, limits.CallLimits] = field(default_factory=dict)


@dataclass
class RouterMetrics:
    rounds: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0  # the client went away (or its deadline passed on its side)
    drafter_errors: int = 0
    session_misses: int = 0
    verify_busy_ms: float = 0.0
    # (domain, drafter) -> counts, for the router's metrics.
    by_domain: dict = field(default_factory=lambda: collections.defaultdict(DrafterCounts))


@dataclass
class Round:
    config: SchedulerConfig
    drafters: dict[str, DrafterService]  # draft model name -> the service hosting it
    router: DrafterRouter
    controller: SpeculationController
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    telemetry: object | None = None  # specfleet.metrics.RouterTelemetry, when the router exports metrics


def sampling_proto(state: RequestState) -> common_pb2.SamplingParams:
    s = state.spec.sampling
    return common_pb2.SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed, drafter_invariant=s.drafter_invariant
    )
