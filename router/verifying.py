"""Verification, commit and learning, steps 3 and 4 of a round (router/scheduler.py has the whole round).

`verify` takes the round's plan (router/rounds.py) and the trees drafted for it.
Every request's tree goes to the verifier replica holding its sessions, one
call per replica (split to the verifier's per-call limits); the verifier merges
concurrent calls into one forward pass. The accepted tokens plus the target's
next token are committed; each drafter's proposals are scored against what the
target emitted, and the routing and cost models learn from it. A verifier that
lost a session is sent the full token ids next round; a replica that fails
hands its requests to a live one (router/verifiers.py), which rebuilds their KV
from the token ids, and nothing of the failed call is committed.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

import grpc

from router import api, messages
from router.request import DrafterCounts
from router.rounds import PREFILL_TOKENS_PER_S, RequestPlan, RoundContext, RoundPlan, concurrently
from router.transport import TransportError
from router.trees import DraftTree
from router.verifiers import VerifierPool
from specfleet import limits

log = logging.getLogger(__name__)


def fed_tokens(session: messages.VerifySession) -> int:
    """The tokens a session feeds the verifier's first pass of a call: its new tokens (a new prompt, or the whole
    context on a replica that lost it; one where the verifier holds them all: the last committed token, whose row
    predicts the next) and its tree."""
    return max(1, len(session.sync.new_token_ids)) + len(session.tree.token_ids)


def prefills(session: messages.VerifySession) -> bool:
    """Whether the session feeds the verifier more than the token that predicts (a new prompt, a rebuilt context).
    A call with such a session teaches the cost model nothing: a prefill's rows cost the pass about 0.6 times what the
    start-up fit charges a verified row (a 64-token prompt 9.5 ms against 16 modelled on the demo target here), so
    learned from, prompts pull the scale of drafted passes down and plain steps beside them look dear: drafting
    cheap."""
    return len(session.sync.new_token_ids) > 1


# The name the verifier's lookup in plain steps (router.lookup_tokens) is counted under among a request's drafters.
LOOKUP = "lookup"

# A verify call may take this many times the modelled pass, and at least the floor, before its
# replica counts as hung: the call also waits behind other callers' passes, merged at the verifier.
VERIFY_DEADLINE_FACTOR = 20.0
VERIFY_DEADLINE_FLOOR_S = 10.0


@dataclass
class VerifyCall:
    """One request's session in a Verify call: its tree, if it drafted, and what travels."""

    request: RequestPlan
    tree: DraftTree | None
    session: messages.VerifySession


def _entries(
    tokens: list[int], logprobs: list[float], top_ids: list[int], top_lps: list[float], ranks: list[int] | None = None
) -> list[api.TokenLogprobs]:
    """The verifier's flat log-probabilities (each token's, then `top` alternatives a token) as one TokenLogprobs a token."""
    top = len(top_ids) // len(logprobs) if logprobs else 0
    return [
        api.TokenLogprobs(
            token_id=token,
            logprob=logprobs[i],
            top=[api.TokenLogprob(t, lp) for t, lp in zip(top_ids[i * top : (i + 1) * top], top_lps[i * top : (i + 1) * top])],
            rank=ranks[i] if ranks else 0,
        )
        for i, token in enumerate(tokens)
    ]


def token_logprobs(verified: messages.VerifiedSession) -> list[api.TokenLogprobs]:
    """The log-probabilities of a round's tokens."""
    return _entries(verified.token_ids, verified.logprobs, verified.top_token_ids, verified.top_logprobs)


def prompt_logprobs(verified: messages.PromptLogprobs, prompt_ids: list[int]) -> list[api.TokenLogprobs]:
    """The log-probabilities of a context (its tokens past the first), one TokenLogprobs per prompt token past the
    first: the context may hold output too, where the verifier was sent the request again after losing it."""
    tokens = prompt_ids[1:]
    return _entries(tokens, verified.logprobs, verified.top_token_ids, verified.top_logprobs, verified.ranks)


class Verifying:
    def __init__(self, context: RoundContext, verifiers: VerifierPool):
        self.context = context
        self.verifiers = verifiers

    async def verify(self, plan: RoundPlan, trees: dict[str, DraftTree]) -> None:
        """Every request's tree (trees: by session id) to the replica holding its sessions, one call per replica, concurrently."""
        by_replica: dict[str, list[RequestPlan]] = collections.defaultdict(list)
        waiting = []
        for request in plan.requests:
            replica = self.verifiers.place(request.state)
            (by_replica[replica] if replica is not None else waiting).append(request)
        await concurrently([self._on(replica, requests, trees, plan) for replica, requests in by_replica.items()])
        for request in waiting:
            if self.verifiers.waited_too_long(request.state):
                request.state.error = (
                    grpc.StatusCode.UNAVAILABLE,
                    f"no verifier replica has answered for {self.verifiers.wait_s:.0f}s (router.verifier_wait_s); retry",
                )
        if waiting and not by_replica:
            # No replica is live: wait for the next probe instead of spinning through empty rounds.
            await asyncio.sleep(min(0.5, max(0.05, self.verifiers.next_probe_in())))

    def _timeout_s(self, sessions: list[messages.VerifySession], prefill_tokens: int) -> float:
        """A verify call's deadline: a multiple of the modelled pass plus what it may prefill (`prefill_tokens`: new
        tokens, and the rest of a prompt prefilled in chunks), so that a hung replica's requests move on in
        seconds, not after rpc_timeout_s."""
        tokens = sum(1 + len(s.tree.token_ids) for s in sessions)
        expected_s = self.context.controller.cost.verify_ms(len(sessions), tokens) / 1e3
        deadline = max(VERIFY_DEADLINE_FLOOR_S, VERIFY_DEADLINE_FACTOR * expected_s)
        deadline += prefill_tokens / PREFILL_TOKENS_PER_S
        return min(self.context.config.settings.rpc_timeout_s, deadline)

    async def _on(self, replica: str, requests: list[RequestPlan], trees: dict[str, DraftTree], plan: RoundPlan) -> None:
        """The replica's requests in calls within the verifier's per-call limits, concurrently."""
        units = []
        for request in requests:
            state = request.state
            diff = state.verifier_mirror.diff(state.tokens)
            tree = trees.get(state.spec.session_id)
            # The lookup is speculation: a round the measured check sent to plain decoding (unrouted) runs without it,
            # so that the check weighs speculating, lookup included, against k = 0 (router/measured_goodput.py).
            lookup = min(self.context.config.settings.lookup_tokens, state.spec.max_draft_tokens) if request.plain_steps > 1 and plan.routed else 0
            session = messages.VerifySession(
                sync=messages.SessionSync.of(state.spec.session_id, diff, state.spec.cache_salt),
                tree=tree.token_tree() if tree else messages.TokenTree(),
                sampling=state.spec.sampling,
                logprobs=state.spec.logprobs,
                top_logprobs=state.spec.top_logprobs,
                # Asked until answered (once): the verifier computes them as it prefills the whole context.
                prompt_logprobs=state.spec.prompt_logprobs is not None and state.prompt_logprobs is None,
                prompt_top_logprobs=state.spec.prompt_logprobs or 0,
                plain_steps=request.plain_steps,
                lookup_tokens=lookup,
                # Chains' tokens past what the request keeps would be cut: the call stops there.
                max_tokens=state.remaining() if lookup else 0,
            )
            units.append([VerifyCall(request, tree, session)])
        parts = limits.split(units, lambda call: limits.verify_tokens(call.session), self.context.config.verify_limits)
        await concurrently([self._call(replica, part, plan) for part in parts])

    async def _call(self, replica: str, part: list[VerifyCall], plan: RoundPlan) -> None:
        metrics, cost, telemetry = self.context.metrics, self.context.controller.cost, self.context.telemetry
        states = [call.request.state for call in part]
        sessions = [call.session for call in part]
        started = time.perf_counter()
        try:
            prefill = sum(c.request.state.verifier_mirror.prefill_tokens(c.session.sync.new_token_ids) for c in part)
            reply = await self.verifiers.replicas[replica].verify(sessions, self._timeout_s(sessions, prefill))
        except TransportError as err:
            plan.called("verify", (time.perf_counter() - started) * 1e3)
            if err.invalid_argument:
                log.error("verifier replica %s refused the round (%s)", replica, err)
                for state in states:
                    state.verifier_mirror.reset()
                    state.error = (grpc.StatusCode.INTERNAL, f"the verifier refused the round: {err}")
            else:
                # Nothing was committed: the requests verify again next round, on a live replica.
                self.verifiers.failed(replica, states, err)
            return
        self.verifiers.succeeded(states)
        wall = (time.perf_counter() - started) * 1e3
        plan.called("verify", wall)
        if telemetry is not None:
            telemetry.replica_sessions.labels(replica=replica).inc(len(part))
            telemetry.verify_call.observe(wall / 1e3)
            telemetry.call_phases("verify", wall, reply.compute_ms, reply.queue_ms)
        # The passes' work less what went to calls that shared a pass with this one (a prompt prefilled beside the last
        # of its plain steps) is its batch's; a batch merged from several calls reports it to every caller: count this
        # call's share as busy time, and scale this call's sessions and tokens up to the batch for the cost model.
        work = reply.compute_ms - reply.shared_ms
        metrics.verify_busy_ms += work * len(sessions) / max(reply.batch_size, len(sessions))
        if not any(prefills(s) for s in sessions):
            fed = sum(fed_tokens(s) for s in sessions)
            # The verifier's lookup adds its chains' rows to the passes (router.lookup_tokens).
            rows = sum(v.lookup_proposed for v in reply.sessions)
            share = reply.batch_size / max(1, len(sessions))
            cost.observe_verify(round(len(sessions) * share), round(fed * share), work, reply.passes, round(rows * share))
        cost.observe_calls(verify_overhead_ms=wall - reply.compute_ms)
        self._learn_lookup(part, reply.sessions, plan)
        for call, verified in zip(part, reply.sessions):
            state = call.request.state
            state.timing_ms["verify_wall"] += wall
            state.timing_ms["verify_compute"] += reply.compute_ms
            state.timing_ms["verify_queue"] += reply.queue_ms
            if not verified.known:
                # Lost by the verifier: send everything next round. No tokens were committed.
                metrics.session_misses += 1
                state.verifier_mirror.reset()
                continue
            state.cached_tokens = max(state.cached_tokens, verified.cached_tokens)
            if verified.prefilling:
                # A long prompt prefilled in chunks: the verifier holds the tokens synced, nothing was committed;
                # the request verifies again next round.
                state.verifier_mirror.held = list(state.tokens)
                state.verifier_mirror.unfilled = len(state.tokens)
                continue
            state.rounds += 1
            if call.tree is not None:
                self._learn(call.request, call.tree, verified.accepted_nodes, verified.token_ids)
            if verified.lookup_proposed:
                self._looked_up(state, verified.lookup_proposed, verified.lookup_accepted)
            if verified.prompt_logprobs is not None and call.session.prompt_logprobs:
                state.prompt_logprobs = prompt_logprobs(verified.prompt_logprobs, state.spec.prompt_ids)
            state.commit(verified.token_ids, token_logprobs(verified) if state.spec.logprobs else None)
            state.verifier_mirror.held = list(state.tokens)
            state.verifier_mirror.unfilled = 0

    def _learn_lookup(self, part: list[VerifyCall], verified: list[messages.VerifiedSession], plan: RoundPlan) -> None:
        """What the verifier's lookup added to the call's plain steps, for the cost model: its tokens a pass weigh
        plain rounds against drafting ones, and its rows are part of what the round is compared with (`RoundPlan`)."""
        passes = proposed = accepted = 0
        for call, result in zip(part, verified):
            if call.session.lookup_tokens and result.known and not result.prefilling:
                passes += len(result.token_ids) - result.lookup_accepted  # each pass commits one token beyond the chain's
                proposed += result.lookup_proposed
                accepted += result.lookup_accepted
        plan.lookup_rows += proposed
        self.context.controller.cost.observe_lookup(len(part), passes, proposed, accepted)

    def _looked_up(self, state, proposed: int, accepted: int) -> None:
        """Count what the verifier's lookup drafted in the request's plain steps, as drafter `LOOKUP` (`--stats`,
        the usage's speculation and the draft-token metrics)."""
        state.draft_tokens += proposed
        state.accepted_tokens += accepted
        counts = state.per_drafter.setdefault(LOOKUP, DrafterCounts())
        counts.rounds += 1
        counts.draft_tokens += proposed
        counts.accepted_tokens += accepted
        if self.context.telemetry is not None:
            self.context.telemetry.looked_up(proposed, accepted)

    def _learn(self, request: RequestPlan, tree: DraftTree, accepted_nodes: list[int], emitted: list[int]) -> None:
        """Count drafted and accepted tokens, and score each drafter's proposals against what was emitted (an empty
        tree too: its drafters were asked and proposed nothing)."""
        metrics, state = self.context.metrics, request.state
        state.draft_tokens += len(tree.tokens)
        state.accepted_tokens += len(accepted_nodes)
        if self.context.telemetry is not None:
            self.context.telemetry.verified(state, request.drafters, tree, accepted_nodes)
        accepted_owners = collections.Counter(d for node in accepted_nodes for d in tree.owners[node])
        outcomes = tree.outcomes(accepted_nodes, emitted)
        for drafter, (hits, _) in outcomes.items():
            counts = state.per_drafter.setdefault(drafter, DrafterCounts())
            counts.rounds += 1
            counts.draft_tokens += sum(1 for owners in tree.owners if drafter in owners)
            counts.accepted_tokens += accepted_owners[drafter]
            by_domain = metrics.by_domain[(state.routing.domain, drafter)]
            by_domain.rounds += 1
            by_domain.draft_tokens += len(tree.proposed[drafter])
            by_domain.accepted_tokens += hits
        self.context.router.observe(state.routing, outcomes)
        controller = self.context.controller
        for drafter, depth in zip(request.drafters, request.depths):
            if drafter in tree.proposed:  # its reply arrived
                controller.fill.observe(drafter, len(tree.proposed[drafter]), depth)
        lead = request.drafters[0] if request.drafters else ""
        if lead in outcomes and request.acceptance > 0:
            controller.acceptance_scale.observe(lead, request.acceptance, request.k, outcomes[lead][0])
        if request.expected_gain > 0:
            # What the helpers added: the tree's accepted tokens beyond the lead's own run of hits.
            added = len(accepted_nodes) - outcomes.get(request.drafters[0], (0, 0))[0]
            controller.fusion_gain.observe(request.expected_gain, max(0, added))
