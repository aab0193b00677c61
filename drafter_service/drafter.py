"""The drafter: proposes the next k tokens for many sessions at once with a small model.

Per session and call: sync the session's tokens (its own previous drafts
followed by what the target accepted), then draft autoregressively. Step 1
feeds what each session's cache lacks, the few tokens committed since its
last call (a longer catch-up, such as a new prompt, is prefilled first, so
that it does not pad every other session); step j feeds draft j - 1. Every
step is one batched forward pass over the sessions still drafting.

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
import zlib
from dataclasses import dataclass, field

import torch

from specfleet.fusion import lead
from specfleet.runtime import ForwardItem, LoadedModel, SessionStore, UnknownSession, forward_batch, prefill
from specfleet.sampling import (
    STREAM_DRAFT,
    SamplingParams,
    generator_for,
    probs_from_logits,
    race,
    race_keys,
    race_noise,
    sample_sparse,
    truncate,
)

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


@dataclass
class DraftResult:
    session_id: str
    known: bool
    token_ids: list[int] = field(default_factory=list)
    proposals: list[tuple[list[int], list[float]]] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    context_log_prob: float = 0.0  # mean over context_tokens, with score_context
    context_tokens: int = 0


class DraftModel:
    """One draft model with its own sessions."""

    def __init__(self, loaded: LoadedModel, store: SessionStore, proposal_top_k: int):
        self.loaded = loaded
        self.store = store
        self.proposal_top_k = proposal_top_k
        # Different draft models of one request draw independently.
        self.stream = STREAM_DRAFT + zlib.crc32(loaded.name.encode())

    def propose(self, drafting: list[Drafting], step: int) -> None:
        """One batched forward pass: each session's next token, its proposal and its confidence.

        Each session feeds what its cache lacks (at least its last token); its logits are
        read at the last position it fed."""
        forward_items = [
            ForwardItem(d.session, d.session.token_ids[d.session.kv_len :], list(range(d.session.kv_len, len(d.session.token_ids))))
            for d in drafting
        ]
        fed = [len(item.input_ids) for item in forward_items]
        logits = forward_batch(self.loaded, forward_items)
        logits = logits[torch.arange(len(fed)), torch.tensor(fed) - 1]
        params = [d.item.sampling for d in drafting]
        if all(p.greedy for p in params):
            # No sampling machinery: the argmax and its point mass.
            local_tokens = logits.argmax(dim=1)
            confidences = logits.softmax(dim=1).gather(1, local_tokens.unsqueeze(1)).squeeze(1)
            tokens = self.loaded.global_ids(local_tokens).tolist()
            proposals = [([t], [1.0]) for t in tokens]
        else:
            probs = probs_from_logits(
                logits,
                torch.tensor([p.temperature for p in params]),
                torch.tensor([p.top_k for p in params], dtype=torch.long),
                torch.tensor([p.top_p for p in params]),
            )
            ids, q = truncate(probs, self.proposal_top_k)
            local_tokens = torch.empty(len(drafting), dtype=torch.long, device=ids.device)
            raced = [b for b, p in enumerate(params) if p.raced]
            drawn = [b for b, p in enumerate(params) if not p.raced]
            if drawn:
                gens = [generator_for(params[b].seed, drafting[b].committed + step, self.stream) for b in drawn]
                local_tokens[drawn] = sample_sparse(ids[drawn], q[drawn], gens)
            if raced:
                # The verifier races p against the same noise (verification.py, obligation 6).
                keys = race_keys([params[b].seed for b in raced], [drafting[b].committed + step for b in raced], device=ids.device)
                winners = race(q[raced], race_noise(keys, self.loaded.global_ids(ids[raced])))
                local_tokens[raced] = ids[raced].gather(1, winners.unsqueeze(1)).squeeze(1)
            # Confidence: the model's own probability of its token; for greedy requests,
            # at temperature 1, since the point mass says nothing.
            confidence_probs = torch.where(torch.tensor([p.greedy for p in params]).unsqueeze(1), logits.softmax(dim=1), probs)
            confidences = confidence_probs.gather(1, local_tokens.unsqueeze(1)).squeeze(1)
            # Positions along the logits are vocabulary ids unless the model has a token map.
            tokens = self.loaded.global_ids(local_tokens).tolist()
            proposals = [
                ([t for t, p in zip(row_ids, row_q) if p > 0], [p for p in row_q if p > 0])
                for row_ids, row_q in zip(self.loaded.global_ids(ids).tolist(), q.tolist())
            ]
        for d, token, proposal, confidence, n in zip(drafting, tokens, proposals, confidences.tolist(), fed):
            d.session.commit(list(range(n)))
            d.result.token_ids.append(token)
            d.result.proposals.append(proposal)
            d.result.confidences.append(confidence)


@dataclass
class Drafting:
    """One session being drafted in this call."""

    model: DraftModel
    item: DraftItem
    session: object
    result: DraftResult
    committed: int  # the session's length before drafting


def draft_batch(models: dict[str, DraftModel], tagged: list[tuple[str, DraftItem]]) -> list[DraftResult]:
    """Draft for (model name, item) pairs, every model's sessions batched per step; results in input order."""
    with contextlib.ExitStack() as locks:
        for name in sorted({name for name, _ in tagged}):
            locks.enter_context(models[name].store.lock)
        return _draft_batch(models, tagged)


def _draft_batch(models: dict[str, DraftModel], tagged: list[tuple[str, DraftItem]]) -> list[DraftResult]:
    results, drafting, scored = [], [], []
    for name, item in tagged:
        model = models[name]
        try:
            session = model.store.sync(item.session_id, item.prefix_length, item.new_token_ids)
        except UnknownSession:
            results.append(DraftResult(item.session_id, known=False))
            continue
        result = DraftResult(item.session_id, known=True)
        results.append(result)
        if item.score_context:
            scored.append((model, result, session))
        if item.num_draft_tokens > 0:
            drafting.append(Drafting(model, item, session, result, committed=len(session.token_ids)))

    for model in models.values():
        mine = [(result, session) for m, result, session in scored if m is model]
        for (result, _), (total, count) in zip(mine, prefill(model.loaded, [session for _, session in mine], score=True)):
            result.context_log_prob, result.context_tokens = total / max(1, count), count
    for model in models.values():
        mine = [d.session for d in drafting if d.model is model]
        for session in mine:
            session.crop_kv(len(session.token_ids) - 1)  # the last token's logits draft the first token
        prefill(model.loaded, [s for s in mine if len(s.token_ids) - s.kv_len > STEP_CATCH_UP], keep_last=1)

    step, active = 0, drafting
    while active:
        for model in models.values():
            mine = [d for d in active if d.model is model]
            if mine:
                model.propose(mine, step)
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
    in_use = {r.session_id for r in results if r.known}
    for model in models.values():
        model.store.enforce_budget(protect=in_use)
    return results
