"""The drafter: proposes the next k tokens for many sessions at once with a small model.

Per session and call: sync the session's tokens (its own previous drafts
followed by what the target accepted), then draft autoregressively. Step 1
feeds what each session's cache lacks, the few tokens committed since its
last call (a longer catch-up, such as a new prompt, is prefilled first, so
that it does not pad every other session); step j feeds draft j - 1. Every
step is one batched forward pass over the sessions still drafting.

Draft models of one shape stacked into one (`specfleet.engine.stack`) draft in
one pass per step together: requests routed to different specialists, or fused
from several, cost one pass a step rather than one per model.

Sessions of one call that share a lockstep group (one request's cooperating
draft models) draft in lockstep: at each step each proposes its token, and
all of them continue from the lead proposal (`specfleet.fusion.lead`), so the
router gets every model's proposal at every position of one main branch
without a network round trip per position.

Each draft token comes with the exact distribution it was drawn from:
greedy requests get a point mass on the draft model's argmax; sampled
requests draw from the draft model's distribution (shaped like the target's:
temperature, top-k, top-p), truncated to its `proposal_top_k` most likely
tokens and renormalised, and that truncated distribution is what is sent.
Drafter-invariant requests (a client-given seed) draw that token by the
exponential race keyed by (seed, position) that the verifier runs on the
target's distribution, so the draft is the target's token whenever the two
races agree.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import zlib
from dataclasses import dataclass, field

from specfleet.engine import LoadedModel, Session, SessionStore, UnknownSession, next_token_logits, prefill, prefill_shares, shaping
from specfleet.engine.guides import GuideState, session_guide
from specfleet.engine.stack import Stack, stack_models
from specfleet.fusion import lead
from specfleet.guides import GuideError
from specfleet.sampling import STREAM_DRAFT, SamplingParams
from drafter_service.ngram import NgramModel

log = logging.getLogger(__name__)

# Catch-ups up to this many tokens ride in the first draft step: a separate pass for them cost
# about a fifth of a draft call, and padding a step to this width costs a small model little.
STEP_CATCH_UP = 8


@dataclass
class DraftItem:
    session_id: str
    prefix_length: int
    new_token_ids: list[int]
    num_draft_tokens: int
    sampling: SamplingParams
    stop_below_confidence: float = 0.0
    score_context: bool = False
    lockstep_group: str = ""
    cache_salt: str = ""  # read with prefix_length = 0: the session's cached blocks are shared only under the same salt


@dataclass
class DraftResult:
    session_id: str
    known: bool
    token_ids: list[int] = field(default_factory=list)
    proposals: list[tuple[list[int], list[float]]] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    context_log_prob: float = 0.0  # mean over context_tokens, with score_context
    context_tokens: int = 0
    # Still prefilling its context in chunks (`_catch_up`): it proposes nothing this call, for want of its context,
    # not of a proposal, so the router does not score it as a miss.
    prefilling: bool = False


class DraftModel:
    """One draft model with its own sessions; `stack` and `member` when it drafts in a stack's passes."""

    def __init__(self, loaded: LoadedModel, store: SessionStore, proposal_top_k: int):
        self.loaded = loaded
        self.store = store
        self.proposal_top_k = proposal_top_k
        # Different draft models of one request draw independently.
        self.stream = STREAM_DRAFT + zlib.crc32(loaded.name.encode())
        self.stack: Stack | None = None
        self.member = 0

    @property
    def passes_with(self) -> object:
        """What this model's sessions share forward passes with: its stack, or itself alone."""
        return self.stack or self


def stack_draft_models(models: dict[str, DraftModel]) -> list[Stack]:
    """Stack the service's same-shape draft models (before any session exists); returns the stacks.

    The members of a stack share one KV pool, so they share one lock too: a release on one
    member never races a batch taking blocks of that pool through another."""
    by_loaded = {id(m.loaded): m for m in models.values()}
    stacks = stack_models([m.loaded for m in models.values()])
    for stack in stacks:
        lock = threading.RLock()
        for member, loaded in enumerate(stack.members):
            model = by_loaded[id(loaded)]
            model.stack, model.member, model.store.lock = stack, member, lock
    return stacks


def _prefill(entries: list[tuple[DraftModel, Session]], score: bool = False, ends: list[int] | None = None) -> list[tuple[float, int]]:
    """`prefill` (keep_last=1, or up to ends[i]) of sessions of many models, in one call per model or stack; results in input order."""
    results: list[tuple[float, int]] = [(0.0, 0)] * len(entries)
    calls: dict[int, list[int]] = {}
    for i, (model, _) in enumerate(entries):
        calls.setdefault(id(model.passes_with), []).append(i)
    for indices in calls.values():
        first = entries[indices[0]][0]
        sessions = [entries[i][1] for i in indices]
        upto = None if ends is None else [ends[i] for i in indices]
        if first.stack is None:
            done = prefill(first.loaded, sessions, score=score, ends=upto)
        else:
            done = first.stack.prefill(sessions, [entries[i][0].member for i in indices], score=score, ends=upto)
        for i, result in zip(indices, done):
            results[i] = result
    return results


def propose(drafting: list[Drafting], step: int) -> None:
    """One batched forward pass: each session's next token, its proposal and its confidence.

    Every session's model is the same one, or a member of the same stack. Each session feeds
    what its cache lacks (at least its last token); its logits are read at the last position it fed.
    An n-gram drafter (ngram.py) looks its sessions' proposals up instead."""
    first = drafting[0].model
    if isinstance(first, NgramModel):
        first.propose(drafting, step)
        return
    sessions = [d.session for d in drafting]
    if first.stack is None:
        logits, global_ids = next_token_logits(first.loaded, sessions), first.loaded.global_ids
    else:
        logits, global_ids = first.stack.next_token_logits(sessions, [d.model.member for d in drafting])
    params = [d.item.sampling for d in drafting]
    tokens, proposals, confidences = shaping.propose(
        global_ids,
        shaping.adjusted(params, logits, [(d.session.token_ids, [[]]) for d in drafting], global_ids, [_guide(d) for d in drafting]),
        params,
        [d.committed + step for d in drafting],
        [d.model.stream for d in drafting],
        first.proposal_top_k,
    )
    for d, token, proposal, confidence in zip(drafting, tokens, proposals, confidences):
        d.result.token_ids.append(token)
        d.result.proposals.append(proposal)
        d.result.confidences.append(confidence)


def _guide(d: Drafting) -> GuideState | None:
    """The session's guide state, or None where it has none or its guide cannot be compiled here (xgrammar missing):
    such a session drafts unguided, which the verification keeps lossless (drafts the guide disallows get p = 0)."""
    try:
        return session_guide(d.session, d.item.sampling.guide, d.model.loaded.guides)
    except GuideError as err:
        _warn_unguided(str(err))
        return None


@functools.cache
def _warn_unguided(reason: str) -> None:
    log.warning("drafting guided sessions unguided: %s", reason)


@dataclass
class Drafting:
    """One session being drafted in this call."""

    model: DraftModel
    item: DraftItem
    session: object
    result: DraftResult
    committed: int  # the session's length before drafting


def draft_batch(models: dict[str, DraftModel | NgramModel], tagged: list[tuple[str, DraftItem]], max_prefill_tokens: int = 0) -> list[DraftResult]:
    """Draft for (model name, item) pairs, every model's sessions batched per step; results in input order.

    max_prefill_tokens: positions the batch's catch-up prefills take at most (0: no limit; `_catch_up`)."""
    with contextlib.ExitStack() as locks:
        for name in sorted({name for name, _ in tagged}):
            locks.enter_context(models[name].store.lock)
        return _draft_batch(models, tagged, max_prefill_tokens)


def _catch_up(drafting: list[Drafting], budget: int) -> list[Drafting]:
    """Prefill the sessions more than STEP_CATCH_UP tokens behind (a new prompt), then return those that draft now.

    Chunked prefill, as the verifier's: with a budget, the shortest catch-ups go first (after what the prefix cache
    holds), and a session the budget cannot bring up to date is prefilled as far as it goes and proposes nothing
    this call (the router verifies without its drafts, which is always lossless); its next call goes on from there.
    So a long prompt never holds up the drafting of the sessions beside it for more than the budget's pass."""
    lagging = []
    for d in drafting:
        end = len(d.session.token_ids) - 1
        if isinstance(d.model, NgramModel) or end - d.session.kv_len <= STEP_CATCH_UP:
            continue
        d.session.reuse_prefix(d.model.loaded.pool, end)  # what the prefix cache holds costs nothing
        lagging.append((end - d.session.kv_len, d))
    lagging.sort(key=lambda t: t[0])
    entries, ends, waiting = [], [], set()
    for (need, d), share in zip(lagging, prefill_shares([need for need, _ in lagging], budget)):
        if share:
            entries.append((d.model, d.session))
            ends.append(d.session.kv_len + share)
        if share < need:
            waiting.add(id(d))
            d.result.prefilling = True
    _prefill(entries, ends=ends)
    return [d for d in drafting if id(d) not in waiting]


def _draft_batch(models: dict[str, DraftModel | NgramModel], tagged: list[tuple[str, DraftItem]], max_prefill_tokens: int) -> list[DraftResult]:
    results, drafting, scored = [], [], []
    for name, item in tagged:
        model = models[name]
        try:
            session = model.store.sync(item.session_id, item.prefix_length, item.new_token_ids, item.cache_salt)
        except UnknownSession:
            results.append(DraftResult(item.session_id, known=False))
            continue
        result = DraftResult(item.session_id, known=True)
        results.append(result)
        if item.score_context and not isinstance(model, NgramModel):  # no model, no score: the router skips it
            scored.append((model, result, session))
        if item.num_draft_tokens > 0:
            drafting.append(Drafting(model, item, session, result, committed=len(session.token_ids)))

    for (_, result, _), (total, count) in zip(scored, _prefill([(m, s) for m, _, s in scored], score=True)):
        result.context_log_prob, result.context_tokens = total / max(1, count), count
    for d in drafting:
        d.session.crop_kv(len(d.session.token_ids) - 1)  # the last token's logits draft the first token
    drafting = _catch_up(drafting, max_prefill_tokens)

    step, active = 0, drafting
    while active:
        passes: dict[int, list[Drafting]] = {}
        for d in active:
            passes.setdefault(id(d.model.passes_with), []).append(d)
        for mine in passes.values():
            propose(mine, step)
        # A session that proposed nothing at this step (an n-gram drafter without a match) is done.
        active = [d for d in active if len(d.result.token_ids) > step]
        # What each session continues from: its own token, or its lockstep group's lead token.
        groups: dict[str, list[Drafting]] = {}
        for d in active:
            if d.item.lockstep_group:
                groups.setdefault(d.item.lockstep_group, []).append(d)
        fed = {id(d): d.result.token_ids[-1] for d in active}
        for members in groups.values():
            leader = members[lead([m.result.confidences[-1] for m in members])]
            for m in members:
                fed[id(m)] = leader.result.token_ids[-1]
        still = []
        for d in active:
            d.session.token_ids.append(fed[id(d)])
            path_confidence = 1.0
            for c in d.result.confidences:
                path_confidence *= c
            more = len(d.result.token_ids) < d.item.num_draft_tokens
            # Lockstep members draft all k positions together; a lone session may stop early.
            if more and (d.item.lockstep_group or path_confidence >= d.item.stop_below_confidence):
                still.append(d)
        active = still
        step += 1
    # Only the stores this batch holds the locks of: another model's may be in a release on another thread, and its
    # budget was kept by its own last batch.
    in_use = {r.session_id for r in results if r.known}
    for name in {name for name, _ in tagged}:
        models[name].store.enforce_budget(protect=in_use)
    return results
