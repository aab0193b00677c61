"""A round's plan, and the context its stages share.

A round of one lane (router/scheduler.py) is: plan (`Planning.plan` returns a
`RoundPlan`), draft (`Drafting.draft(plan)` returns each request's `DraftTree`),
verify, commit and learn (`Verifying.verify(plan, trees)`). The plan is data handed
from stage to stage; what lasts beyond the round stays in `RequestState`.

The stages share one `RoundContext`: the scheduler's settings, the drafter services,
the routing policy, the speculation controller and the router's counters, so that a
config reload swaps the drafters and the policies in one place for all of them.
`RoundMeasures` tells adaptive speculation what each round delivered, counted
only among rounds of its own kind (`LaneKinds`).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable
from dataclasses import dataclass, field

from router.drafters import DrafterService
from router.request import DrafterCounts, RequestState
from router.routing import DrafterRouter
from router.speculation import SpeculationController
from specfleet import limits
from specfleet.config import SchedulingConfig

# A call's deadline grows by a second per this many new tokens it sends (prefilled there): a prefill
# rate no drafter or verifier falls below, so a call that catches a long context up is not cut short.
PREFILL_TOKENS_PER_S = 64.0


async def concurrently(calls: list[Awaitable]) -> list:
    """The calls' results, run concurrently as asyncio.gather runs them; a lone call (one replica, one part: the
    usual round) is awaited in place, without the task and the event-loop steps gather spends on it."""
    if len(calls) == 1:
        return [await calls[0]]
    return await asyncio.gather(*calls)


@dataclass
class SchedulerConfig:
    # The router's scheduling section (max_running, max_queued, rpc_timeout_s), taken whole.
    settings: SchedulingConfig = field(default_factory=SchedulingConfig)
    # Lanes: the section's pipeline_depth, resolved at start-up when it is 0 (the router chooses).
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
class RoundContext:
    config: SchedulerConfig
    drafters: dict[str, DrafterService]  # draft model name -> the service hosting it
    router: DrafterRouter
    controller: SpeculationController
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    telemetry: object | None = None  # specfleet.metrics.RouterTelemetry, when the router exports metrics


@dataclass
class RequestPlan:
    """One request's part of a round: who drafts for it, and how many positions each drafts.

    One drafter drafts a chain of k tokens. Cooperating drafters: the first in routing order
    drafts all k positions, the others their depth, the first positions only
    (router.fusion_depth). Those hosted by the first's service draft in lockstep with it, in
    its call (`lockstep`); each of the others drafts a chain of its own on its own service,
    concurrently, and the router merges the chains into the request's tree (router/trees.py).
    No drafters: plain decoding this round."""

    state: RequestState
    drafters: list[str] = field(default_factory=list)  # routing order; the first leads
    depths: list[int] = field(default_factory=list)  # draft positions per drafter, the first's is k
    lockstep: list[str] = field(default_factory=list)  # the lead and the drafters its service hosts, if two or more
    # Tokens the plan expects the helpers (drafters after the lead) to add, before FusionGain's efficiency
    # (router/drafter_choice.py); 0 where the plan did not weigh them (no helpers, or fusion by `fusion_below`).
    expected_gain: float = 0.0
    # The lead's per-token acceptance as routing predicted it, before `AcceptanceScale` (router/drafter_choice.py),
    # which verification checks against the lead's hits; 0 where no drafter drafts.
    acceptance: float = 0.0
    # Tokens to decode plainly in this round's verify call, one pass each (router.plain_steps; 1 where it drafts).
    plain_steps: int = 1

    @property
    def k(self) -> int:
        return self.depths[0] if self.depths else 0


def plain_steps_of(state: RequestState, most: int) -> int:
    """The tokens a request decodes in a round where no request drafts: up to `most`, as many as it may still produce;
    one in its first round, so that its first token streams as soon as its prompt is prefilled."""
    return max(1, min(most, state.remaining())) if state.rounds > 0 else 1


def plain_steps(requests: list[RequestPlan], most: int) -> None:
    """In a round where no request drafts, each request decodes its plain steps (`plain_steps_of`) in the round's
    verify call: the round's overhead (its plan, its calls, its commit) then comes once for them all."""
    if most <= 1 or any(r.k > 0 for r in requests):
        return
    for request in requests:
        request.plain_steps = plain_steps_of(request.state, most)


@dataclass
class RoundPlan:
    requests: list[RequestPlan]  # every request of the round, drafting or not, in the lane's order
    # What the cost model expects the round to take (ms), before what drafting rounds were measured to cost beyond
    # it and before the rows the verifier's lookup adds to its plain steps (router/cost_model.py
    # `CostModel.observe_round` compares it, with `lookup_rows`, with the wall time); None where no model weighed it.
    modelled_ms: float | None = None
    # The tokens the verifier's lookup proposed in the round's plain steps: rows its passes verified beyond a token
    # a session, which the plan left to the verifier (router/verifying.py).
    lookup_rows: int = 0
    # The round's longest draft call and longest verify call (ms, as the router saw them, failed ones
    # included): a stage's calls run concurrently, so the longest is what the round waited for.
    draft_calls_ms: float = 0.0
    verify_calls_ms: float = 0.0
    # Whether routing weighed the round's requests (the round speculates): not where it decodes plainly, unrouted,
    # scoring no prompt either (a prompt is scored in the first round that routes it), because the measured check
    # sent it there or because none of its requests drafts at all.
    routed: bool = True
    # Whether the plan ranked drafters and planned k: not where no request's hope could make it draft, nor where the
    # plan would neither draft nor probe at each request's best drafter (router/planning.py), nor where it is not routed.
    ranked: bool = False

    def drafting(self) -> list[RequestPlan]:
        return [r for r in self.requests if r.k > 0]

    def to_score(self) -> list[RequestState]:
        """The requests whose prompts the specialists score this round: those routing could not place, in a round
        that routes (they decode plainly meanwhile)."""
        return [r.state for r in self.requests if r.state.routing.awaits_scores] if self.routed else []

    def called(self, stage: str, wall_ms: float) -> None:
        """One call of the stage ("draft" or "verify") took wall_ms."""
        if stage == "draft":
            self.draft_calls_ms = max(self.draft_calls_ms, wall_ms)
        else:
            self.verify_calls_ms = max(self.verify_calls_ms, wall_ms)

    def modelled_with_lookup(self, per_row_ms: float) -> float | None:
        """The modelled time with the lookup's rows at `per_row_ms` each: what the round's wall time is compared with.
        Left out, a plain round whose chains were verified looks slower than modelled by their rows, and the rounds
        that draft look cheap beside it (`drafting_extra` below zero at four clients on one core)."""
        return None if self.modelled_ms is None else self.modelled_ms + per_row_ms * self.lookup_rows

    def router_ms(self, wall_ms: float) -> float:
        """The router's own time in a round of wall_ms: planning, building the calls, committing the results,
        what the round's longest draft and verify calls leave of it (the two stages run one after the other)."""
        return max(0.0, wall_ms - self.draft_calls_ms - self.verify_calls_ms)


class RecentLoad:
    """The load a round runs under, for adaptive speculation: the most requests running in the router over its last
    `rounds` rounds, not at this round's start alone. Requests that end together (equal lengths, a client's batch)
    leave the next rounds with one or two running while their clients' next requests arrive: judged at that load,
    where speculating was measured to pay (at one client), such a round routes its lone request and waits for the
    specialists to score its prompt while the others queue behind it (docs/benchmarks/plain-steps.md). A load that
    really falls is followed after `rounds` rounds."""

    def __init__(self, rounds: int = 8):
        self._recent: collections.deque[int] = collections.deque(maxlen=rounds)

    def observe(self, running: int) -> int:
        """A round starts with `running` requests in the router; the load it runs under."""
        self._recent.append(running)
        return max(self._recent)


class LaneKinds:
    """Each lane's kind of round in flight (or its last); None while the lane is idle. True is the kind that, right
    after a round of the other kind, first catches its drafters up on the tokens committed without them: drafting
    against plain rounds (what the cost model learns from), or speculating against rounds the measured check
    decoded plainly (what that check compares; router/speculation.py).

    A round measures its kind cleanly only among rounds of its own kind: another lane's round beside it shares
    the verifier (a plain round merged with, or queued behind, a drafting round's wider pass looks slow), and a
    round of kind True right after one of the other kind in its lane pays for the switch, not for its kind. A
    lane's first round after idle is a new request's: its drafters prefill the prompt, which the cost model's
    drafting term leaves out (`after_idle_clean` False), and which is part of what speculating costs a request,
    beside its prompt's prefill and scoring (True)."""

    def __init__(self, lanes: int, after_idle_clean: bool = False):
        self._kinds: list[bool | None] = [None] * lanes
        self._after_idle_clean = after_idle_clean

    def start(self, lane: int, kind: bool) -> bool:
        """The lane starts a round of this kind; whether it starts clean."""
        previous, self._kinds[lane] = self._kinds[lane], kind
        switched = kind and previous is not True and (previous is not None or not self._after_idle_clean)
        return not switched and self.beside_own_kind(lane, kind)

    def beside_own_kind(self, lane: int, kind: bool) -> bool:
        """Whether every other busy lane's round is of this one's kind."""
        return all(other is None or other == kind for i, other in enumerate(self._kinds) if i != lane)

    def idle(self, lane: int) -> None:
        self._kinds[lane] = None


class RoundMeasures:
    """What each lane's rounds teach adaptive speculation (router/speculation.py). The measured check compares the
    two ways a round can go: speculating (the plan routed it: drafting, probing, or every request at k = 0, with new
    prompts scored beside it) and plain decoding (the check sent it to k = 0, unrouted), so every cost of speculating
    (its plans, its probes, its prompts scored) is in speculating's rounds. The cost model learns what rounds that
    draft take beyond its prediction, against rounds that do not. Each counts a round only among rounds of its own
    kind (`LaneKinds`)."""

    def __init__(self, lanes: int):
        self._kinds = LaneKinds(lanes)  # drafting or not: the cost model's
        self._ways = LaneKinds(lanes, after_idle_clean=True)  # speculating or not: the measured check's

    def start(self, lane: int, plan: RoundPlan) -> tuple[bool, bool]:
        """The lane starts the planned round; whether it starts clean for the cost model, and for the check."""
        return self._kinds.start(lane, bool(plan.drafting())), self._ways.start(lane, plan.routed)

    def ended(
        self,
        lane: int,
        plan: RoundPlan,
        started: tuple[bool, bool],
        controller: SpeculationController,
        committed: int,
        wall_ms: float,
        running: int,
        scored: bool,
        prefilled: bool,
    ) -> tuple[bool, bool]:
        """The round (`start` said `started`) committed `committed` tokens in wall_ms with `running` requests in the
        router; scored: specialists scored prompts beside it; prefilled: the verifier prefilled a new request's prompt
        in it. Tells the controller; returns whether the round counted for the cost model and for the check."""
        drafted, speculated = bool(plan.drafting()), plan.routed
        # A prompt's prefill costs the verifier the same whichever way the lane decodes, and its rounds, several times
        # a decoding round's length, are the check's largest noise: the check leaves them out, but for those where
        # specialists score the prompt beside it, which is speculating's cost.
        in_way = started[1] and self._ways.beside_own_kind(lane, speculated) and (scored or not prefilled)
        controller.observe_round(len(plan.requests), committed, wall_ms, speculated, in_way, running, drafted)
        # Prompt scoring is no draft call's: the cost model leaves rounds with it out.
        clean = started[0] and self._kinds.beside_own_kind(lane, drafted) and not scored
        controller.observe_modelled(plan.modelled_with_lookup(controller.cost.lookup_row_ms()), wall_ms, drafted, clean, committed)
        return clean, in_way

    def idle(self, lane: int) -> None:
        self._kinds.idle(lane)
        self._ways.idle(lane)
