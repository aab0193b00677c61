"""The drafter: proposes the next k tokens for many sessions at once with a small model.

Per session and call: sync the session's tokens (its own previous drafts
followed by what the target accepted), then draft autoregressively. Step 1
feeds each session's last committed token; step j feeds draft j - 1. Every
step is one batched forward pass over the sessions still drafting.

Each draft token comes with the exact distribution it was drawn from:
greedy requests get a point mass on the draft model's argmax; sampled
requests draw from the draft model's distribution (shaped like the target's:
temperature, top-k, top-p), truncated to its `proposal_top_k` most likely
tokens and renormalised, and that truncated distribution is what is sent.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from specfleet.runtime import ForwardItem, LoadedModel, SessionStore, UnknownSession, forward_batch, prefill
from specfleet.sampling import STREAM_DRAFT, SamplingParams, generator_for, probs_from_logits, sample_sparse, truncate


@dataclass
class DraftItem:
    session_id: str
    prefix_length: int
    new_token_ids: list[int]
    num_draft_tokens: int
    sampling: SamplingParams
    stop_below_confidence: float = 0.0
    score_context: bool = False


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

    def draft_batch(self, items: list[DraftItem]) -> list[DraftResult]:
        with self.store.lock:
            return self._draft_batch(items)

    def _draft_batch(self, items: list[DraftItem]) -> list[DraftResult]:
        results: list[DraftResult | None] = [None] * len(items)
        live, scored = [], []
        for idx, item in enumerate(items):
            try:
                session = self.store.sync(item.session_id, item.prefix_length, item.new_token_ids)
            except UnknownSession:
                results[idx] = DraftResult(item.session_id, known=False)
                continue
            results[idx] = DraftResult(item.session_id, known=True)
            if item.score_context:
                scored.append((results[idx], session))
            if item.num_draft_tokens > 0:
                live.append((results[idx], item, session))
        if scored:
            for (result, _), (total, count) in zip(scored, prefill(self.loaded, [s for _, s in scored], score=True)):
                result.context_log_prob, result.context_tokens = total / max(1, count), count
        if live:
            self._draft(live)
        self.store.enforce_budget(protect={item.session_id for _, item, _ in live} | {r.session_id for r, _ in scored})
        return results

    def _draft(self, live) -> None:
        prefill(self.loaded, [session for _, _, session in live], keep_last=1)
        committed = {id(session): len(session.token_ids) for _, _, session in live}
        active = live
        step = 0
        while active:
            forward_items = [ForwardItem(s, [s.token_ids[-1]], [len(s.token_ids) - 1]) for _, _, s in active]
            logits = forward_batch(self.loaded, forward_items)
            params = [item.sampling for _, item, _ in active]
            probs = probs_from_logits(
                logits[:, 0],
                torch.tensor([p.temperature for p in params]),
                torch.tensor([p.top_k for p in params], dtype=torch.long),
                torch.tensor([p.top_p for p in params]),
            )
            ids, q = truncate(probs, self.proposal_top_k)
            gens = [generator_for(p.seed, committed[id(s)] + step, self.stream) for p, (_, _, s) in zip(params, active)]
            tokens = sample_sparse(ids, q, gens)
            # Confidence: the model's own probability of its token; for greedy requests,
            # at temperature 1, since the point mass says nothing.
            confidence_probs = torch.where(
                torch.tensor([p.greedy for p in params]).unsqueeze(1), logits[:, 0].softmax(dim=1), probs
            )
            confidences = confidence_probs.gather(1, tokens.unsqueeze(1)).squeeze(1)

            still = []
            for b, (result, item, session) in enumerate(active):
                session.commit([0])
                token = int(tokens[b])
                keep = q[b] > 0
                result.token_ids.append(token)
                result.proposals.append((ids[b][keep].tolist(), q[b][keep].tolist()))
                result.confidences.append(float(confidences[b]))
                session.token_ids.append(token)
                path_confidence = 1.0
                for c in result.confidences:
                    path_confidence *= c
                if len(result.token_ids) < item.num_draft_tokens and path_confidence >= item.stop_below_confidence:
                    still.append((result, item, session))
            active = still
            step += 1
