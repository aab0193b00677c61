"""The router's Prometheus metrics: requests, tokens, speculation, calls, replicas, and what its
scheduler counts and learns, read at scrape time. Names and buckets as in `specfleet.metrics`
(vLLM's where the meaning is the same); the endpoint that serves them is `specfleet.metrics`'.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specfleet.metrics import E2E_BUCKETS, ITL_BUCKETS, PASS_BUCKETS, TOKEN_BUCKETS, TTFT_BUCKETS

# Where a round's time goes (specfleet:round_phase_seconds): each draft and verify call's server compute,
# server queue and transport (the rest of its wall time), and the router's own time per round.
ROUND_PHASES = ("draft_compute", "draft_queue", "draft_transport", "verify_compute", "verify_queue", "verify_transport", "router")


class RouterTelemetry:
    """The router's request, token and speculation metrics; the scheduler reports to it."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        r = self.registry = CollectorRegistry()
        Gauge("specfleet:num_requests_running", "Requests being generated.", registry=r).set_function(lambda: scheduler.running)
        Gauge("specfleet:num_requests_waiting", "Requests queued for admission.", registry=r).set_function(lambda: scheduler.waiting)
        lanes = Gauge("specfleet:pipeline_lane_requests", "Requests in each pipeline lane.", ["lane"], registry=r)
        for i in range(len(scheduler._lanes)):
            lanes.labels(lane=str(i)).set_function(lambda i=i: len(scheduler._lanes[i]))
        self.ttft = Histogram(
            "specfleet:time_to_first_token_seconds", "Time from admission to the first output token.", buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "specfleet:inter_token_latency_seconds",
            "Time between output tokens (a round's tokens share its interval).",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram("specfleet:e2e_request_latency_seconds", "Time from admission to the last token.", buckets=E2E_BUCKETS, registry=r)
        self._add_request_histograms(r)
        self.success = Counter("specfleet:request_success", "Requests finished, by reason (eos, length, stop).", ["finished_reason"], registry=r)
        self.failed = Counter("specfleet:request_failure", "Requests refused or ended with an error, by gRPC status.", ["code"], registry=r)
        self.cancelled = Counter("specfleet:request_cancelled", "Requests whose client went away before the end.", registry=r)
        self.prompt_tokens = Counter("specfleet:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("specfleet:generation_tokens", "Output tokens streamed.", registry=r)
        self.drafts = Counter("specfleet:spec_decode_num_drafts", "Draft trees verified (one per request and drafting round).", registry=r)
        self.draft_tokens = Counter("specfleet:spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.accepted = Counter("specfleet:spec_decode_num_accepted_tokens", "Draft tokens the target accepted.", registry=r)
        self.accepted_per_pos = Counter(
            "specfleet:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by their depth in the draft (0: first).",
            ["position"],
            registry=r,
        )
        self.routing = Counter(
            "specfleet:routing_decisions", "Drafting rounds led by each drafter, per request domain.", ["drafter", "domain"], registry=r
        )
        self.fusion_width = Histogram(
            "specfleet:fusion_width", "Drafters cooperating on one request's drafting round.", buckets=(1, 2, 3, 4, 6, 8), registry=r
        )
        self.draft_call = Histogram(
            "specfleet:draft_call_seconds",
            "Wall time of one Draft call, as the router sees it.",
            ["drafter_service"],
            buckets=PASS_BUCKETS,
            registry=r,
        )
        self.verify_call = Histogram(
            "specfleet:verify_call_seconds", "Wall time of one Verify call, as the router sees it.", buckets=PASS_BUCKETS, registry=r
        )
        self.round_phase = Histogram(
            "specfleet:round_phase_seconds",
            "Where a round's time goes: each call's server compute, server queue and transport (the rest of its wall time), "
            "and the router's own time per round (the round's wall time less its longest draft and verify calls).",
            ["phase"],
            buckets=PASS_BUCKETS,
            registry=r,
        )
        # Every phase is exported from the start, at zero; its child is looked up once (labels() locks and hashes, every call).
        self.phases = {phase: self.round_phase.labels(phase=phase) for phase in ROUND_PHASES}
        up = Gauge(
            "specfleet:verifier_replica_up", "1 while the router sends rounds to this verifier replica, 0 while it skips it.", ["replica"], registry=r
        )
        for name in scheduler.verifiers.replicas:
            up.labels(replica=name).set_function(lambda name=name: float(scheduler.verifiers.breaker.allow(name)))
        self.replica_sessions = Counter(
            "specfleet:verifier_replica_sessions", "Request rounds each verifier replica verified.", ["replica"], registry=r
        )
        r.register(_RoundState(scheduler))
        self._token_times: dict[int, tuple[float, float]] = {}  # id(state) -> when its first and its last tokens went out

    def _add_request_histograms(self, r: CollectorRegistry) -> None:
        """A finished request's phases and lengths, as vLLM's request_* histograms: queue (admission to its first round),
        prefill (to its first token), decode (first to last token), inference (first round to last token)."""
        self.phase_seconds = {
            phase: Histogram(f"specfleet:request_{phase}_time_seconds", doc, buckets=E2E_BUCKETS, registry=r)
            for phase, doc in (
                ("queue", "Time a finished request waited for its first round."),
                ("prefill", "Time from a finished request's first round to its first token."),
                ("decode", "Time from a finished request's first token to its last."),
                ("inference", "Time from a finished request's first round to its last token."),
            )
        }
        self.lengths = {
            name: Histogram(f"specfleet:request_{name}", doc, buckets=TOKEN_BUCKETS, registry=r)
            for name, doc in (
                ("prompt_tokens", "Prompt tokens of a finished request."),
                ("generation_tokens", "Output tokens of a finished request."),
                ("params_max_tokens", "The max_tokens a finished request ran with."),
            )
        }

    def call_phases(self, stage: str, wall_ms: float, compute_ms: float, queue_ms: float) -> None:
        """One draft or verify call (stage) took wall_ms at the router, of which the server reported compute_ms
        in its pass and queue_ms in its batch queue; the rest is transport."""
        self.phases[f"{stage}_compute"].observe(compute_ms / 1e3)
        self.phases[f"{stage}_queue"].observe(queue_ms / 1e3)
        # Never below zero: the server's float32 milliseconds may round past the router's own measure.
        self.phases[f"{stage}_transport"].observe(max(0.0, wall_ms - compute_ms - queue_ms) / 1e3)

    def published(self, state, chunk) -> None:
        """A chunk went to the client (Scheduler._publish)."""
        now = time.monotonic()
        n = len(chunk.token_ids)
        if n:
            self.generation_tokens.inc(n)
            first, last = self._token_times.get(id(state), (now, None))
            if last is None:
                self.ttft.observe(now - state.admitted_at)
            else:
                for _ in range(n):
                    self.itl.observe((now - last) / n)
            self._token_times[id(state)] = (first, now)
        if chunk.final:
            first, _ = self._token_times.pop(id(state), (None, None))
            self.e2e.observe(now - state.admitted_at)
            self.success.labels(finished_reason=state.finish_reason).inc()
            self.prompt_tokens.inc(len(state.spec.prompt_ids))
            self._finished(state, first, now)

    def _finished(self, state, first: float | None, now: float) -> None:
        """A finished request's phases (those it reached: `first`, when its first tokens went out) and lengths."""
        scheduled = state.scheduled_at
        if scheduled is not None:
            self.phase_seconds["queue"].observe(scheduled - state.admitted_at)
            self.phase_seconds["inference"].observe(now - scheduled)
            if first is not None:
                self.phase_seconds["prefill"].observe(first - scheduled)
                self.phase_seconds["decode"].observe(now - first)
        self.lengths["prompt_tokens"].observe(len(state.spec.prompt_ids))
        self.lengths["generation_tokens"].observe(len(state.output_ids))
        self.lengths["params_max_tokens"].observe(state.spec.max_tokens)

    def cancelled_request(self, state) -> None:
        """Its client went away before the end (Scheduler._publish drops it)."""
        self._token_times.pop(id(state), None)
        self.cancelled.inc()

    def failed_with(self, state, code) -> None:
        self._token_times.pop(id(state), None)
        self.failed.labels(code=getattr(code, "name", str(code))).inc()

    def verified(self, state, drafters: list[str], tree, accepted_nodes: list[int]) -> None:
        """One request's draft tree came back from verification (router/verifying.py, Verifying._learn);
        drafters: who drafted it this round, in routing order."""
        if not tree.tokens:
            return
        self.drafts.inc()
        self.draft_tokens.inc(len(tree.tokens))
        self.accepted.inc(len(accepted_nodes))
        for position in range(len(accepted_nodes)):
            self.accepted_per_pos.labels(position=str(position)).inc()
        if drafters:
            domain = (state.routing.domain if state.routing else "") or "-"
            self.routing.labels(drafter=drafters[0], domain=domain).inc()
            self.fusion_width.observe(len(drafters))

    def looked_up(self, proposed: int, accepted: int) -> None:
        """The verifier's lookup drafted `proposed` tokens in one request's plain steps, `accepted` of them kept
        (router/verifying.py): counted among the draft tokens, as vLLM counts its n-gram proposer's."""
        self.draft_tokens.inc(proposed)
        self.accepted.inc(accepted)


class _RoundState:
    """What the router's scheduler counts and learns, read at scrape time: drafts and acceptance per drafter
    and domain, rounds, failures, verifier time, verifier replica moves, learned expertise, the cost model."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        shared = self.scheduler.context
        m = shared.metrics
        yield CounterMetricFamily(
            "specfleet:verifier_replica_moves", "Requests moved off a failed verifier replica to a live one.", value=self.scheduler.verifiers.moves
        )
        yield CounterMetricFamily("specfleet:rounds", "Draft-and-verify rounds, one per lane and pass.", value=m.rounds)
        yield CounterMetricFamily(
            "specfleet:drafter_errors", "Failed Draft calls (their requests decoded that round without drafts).", value=m.drafter_errors
        )
        yield CounterMetricFamily(
            "specfleet:session_misses", "Sessions a verifier or drafter had lost and was sent again whole.", value=m.session_misses
        )
        yield CounterMetricFamily(
            "specfleet:verify_busy_seconds", "Verifier compute time reported for this router's Verify calls.", value=m.verify_busy_ms / 1e3
        )
        proposed = CounterMetricFamily(
            "specfleet:drafter_draft_tokens", "Tokens each drafter proposed, per request domain.", labels=["drafter", "domain"]
        )
        accepted = CounterMetricFamily(
            "specfleet:drafter_accepted_tokens",
            "Proposals of each drafter that matched the target's tokens, per domain.",
            labels=["drafter", "domain"],
        )
        for (domain, drafter), counts in sorted(m.by_domain.items()):
            proposed.add_metric([drafter, domain or "-"], counts.draft_tokens)
            accepted.add_metric([drafter, domain or "-"], counts.accepted_tokens)
        yield proposed
        yield accepted
        expertise = GaugeMetricFamily(
            "specfleet:expertise_acceptance",
            "Learned per-token acceptance (posterior mean without prior) per drafter and domain.",
            labels=["drafter", "domain"],
        )
        for (domain, drafter), e in sorted(shared.router.store.snapshot().items()):
            if e.accepted + e.rejected > 0:
                expertise.add_metric([drafter, domain or "-"], e.accepted / (e.accepted + e.rejected))
        yield expertise
        cost = shared.controller.cost
        model = GaugeMetricFamily("specfleet:cost_model_ms", "The fitted cost model adaptive speculation plans with.", labels=["term"])
        for term, ms in [
            ("verify_base", cost.verify_scale * cost.verify_base),
            ("verify_per_session", cost.verify_scale * cost.verify_per_session),
            ("verify_per_token", cost.verify_scale * cost.verify_per_token),
            ("lookup_row", cost.lookup_row_ms()),
            ("draft_base", cost.draft_base),
            ("draft_per_token", cost.draft_per_token),
            ("drafting_extra", cost.drafting_extra),
        ]:
            model.add_metric([term], ms)
        yield model
