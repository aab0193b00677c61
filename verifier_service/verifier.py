"""The verifier: checks many sessions' token trees against the target model in one forward pass.

Per session and round: sync the session's tokens (the client sends only what
changed), feed the last committed token followed by the tree's nodes with
tree attention, shape the target's logits into p as the request asked, run
`verification.verify_trees`, keep the KV of the accepted path only, and
append the accepted tokens and the next token to the session.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specfleet.runtime import ForwardItem, LoadedModel, SessionStore, UnknownSession, forward_batch, prefill
from specfleet.sampling import STREAM_VERIFY, SamplingParams, generator_for, probs_from_logits
from verifier_service.verification import TreeBatch, verify_trees

log = logging.getLogger(__name__)


@dataclass
class VerifyItem:
    session_id: str
    prefix_length: int
    new_token_ids: list[int]
    sampling: SamplingParams
    tree_tokens: list[int] = field(default_factory=list)
    tree_parents: list[int] = field(default_factory=list)
    # Per node: (token ids, probs) of the distribution its token was drawn from.
    proposals: list[tuple[list[int], list[float]]] = field(default_factory=list)


@dataclass
class VerifyResult:
    session_id: str
    known: bool
    accepted_nodes: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


def validate_item(item: VerifyItem, vocab_size: int, max_context: int) -> None:
    """Raise ValueError with a message naming the field for a malformed session."""
    n = len(item.tree_tokens)
    if len(item.tree_parents) != n or len(item.proposals) != n:
        raise ValueError(f"session {item.session_id}: tree.token_ids, tree.parents and tree.proposals must have equal lengths")
    for i, parent in enumerate(item.tree_parents):
        if not -1 <= parent < i:
            raise ValueError(f"session {item.session_id}: tree.parents[{i}] = {parent}; a parent must precede its child")
    for name, ids in [("new_token_ids", item.new_token_ids), ("tree.token_ids", item.tree_tokens)]:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"session {item.session_id}: {name} has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    for i, (ids, probs) in enumerate(item.proposals):
        if not ids or len(ids) != len(probs) or any(not 0 <= t < vocab_size for t in ids) or any(p < 0 for p in probs):
            raise ValueError(f"session {item.session_id}: tree.proposals[{i}] must be a non-empty distribution over vocabulary ids")
    if item.prefix_length < 0:
        raise ValueError(f"session {item.session_id}: sync.prefix_length must be >= 0")
    if item.prefix_length + len(item.new_token_ids) + n + 1 > max_context:
        raise ValueError(f"session {item.session_id}: context plus tree exceeds the model's {max_context} positions")
    if item.prefix_length == 0 and not item.new_token_ids:
        raise ValueError(f"session {item.session_id}: a new session needs at least one token")
    s = item.sampling
    if s.temperature < 0 or not 0 < s.top_p <= 1 or s.top_k < 0:
        raise ValueError(f"session {item.session_id}: sampling needs temperature >= 0, top_p in (0, 1], top_k >= 0")


class Verifier:
    def __init__(self, loaded: LoadedModel, store: SessionStore):
        self.loaded = loaded
        self.store = store
        self.sessions_verified = 0

    def verify_batch(self, items: list[VerifyItem]) -> list[VerifyResult]:
        with self.store.lock:
            return self._verify_batch(items)

    def _verify_batch(self, items: list[VerifyItem]) -> list[VerifyResult]:
        results: list[VerifyResult | None] = [None] * len(items)
        live: list[tuple[int, VerifyItem, object]] = []
        for idx, item in enumerate(items):
            try:
                session = self.store.sync(item.session_id, item.prefix_length, item.new_token_ids)
            except UnknownSession:
                results[idx] = VerifyResult(item.session_id, known=False)
                continue
            live.append((idx, item, session))
        if live:
            for (idx, _, _), result in zip(live, self._verify(live)):
                results[idx] = result
        self.store.enforce_budget(protect={item.session_id for _, item, _ in live})
        self.sessions_verified += len(live)
        return results

    def _verify(self, live) -> list[VerifyResult]:
        sessions = [session for _, _, session in live]
        prefill(self.loaded, sessions, keep_last=1)

        forward_items = []
        for _, item, session in live:
            root_pos = len(session.token_ids) - 1
            n = len(item.tree_tokens)
            depth = [0] * n
            attend = torch.zeros(n + 1, n + 1, dtype=torch.bool)
            attend[:, 0] = True
            for i, parent in enumerate(item.tree_parents):
                depth[i] = 1 if parent < 0 else depth[parent] + 1
                attend[i + 1, i + 1] = True
                if parent >= 0:
                    attend[i + 1] |= attend[parent + 1]
            forward_items.append(
                ForwardItem(
                    session,
                    [session.token_ids[-1], *item.tree_tokens],
                    [root_pos] + [root_pos + d for d in depth],
                    attend,
                )
            )
        logits = forward_batch(self.loaded, forward_items)  # [B, 1 + N, V]

        batch, width, vocab = logits.shape
        num_nodes = width - 1
        params = [item.sampling for _, item, _ in live]
        per_row = lambda values, dtype: torch.tensor(values, dtype=dtype).repeat_interleave(width)  # noqa: E731
        target_probs = probs_from_logits(
            logits.reshape(batch * width, vocab),
            per_row([p.temperature for p in params], torch.float32),
            per_row([p.top_k for p in params], torch.long),
            per_row([p.top_p for p in params], torch.float32),
        ).reshape(batch, width, vocab)

        k_max = max([len(ids) for _, item, _ in live for ids, _ in item.proposals] or [1])
        trees = TreeBatch(
            tokens=torch.zeros(batch, num_nodes, dtype=torch.long),
            parents=torch.full((batch, num_nodes), -2, dtype=torch.long),
            valid=torch.zeros(batch, num_nodes, dtype=torch.bool),
            q_ids=torch.zeros(batch, num_nodes, k_max, dtype=torch.long),
            q_probs=torch.zeros(batch, num_nodes, k_max),
        )
        # A greedy session's p is a point mass, so its verdict does not depend on the noise
        # (verification.py, obligation 2): it gets constant noise instead of 8k random draws.
        uniforms = torch.zeros(batch, num_nodes)
        exponentials = torch.ones(batch, vocab)
        for b, (_, item, session) in enumerate(live):
            n = len(item.tree_tokens)
            trees.tokens[b, :n] = torch.tensor(item.tree_tokens, dtype=torch.long)
            trees.parents[b, :n] = torch.tensor(item.tree_parents, dtype=torch.long)
            trees.valid[b, :n] = True
            for i, (ids, probs) in enumerate(item.proposals):
                trees.q_ids[b, i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
                trees.q_probs[b, i, : len(ids)] = torch.tensor(probs)
            if not item.sampling.greedy:
                gen = generator_for(item.sampling.seed, len(session.token_ids), STREAM_VERIFY)
                uniforms[b] = torch.rand(num_nodes, generator=gen)
                exponentials[b].exponential_(generator=gen)
        verdict = verify_trees(target_probs, trees, uniforms, exponentials)

        results = []
        for b, (_, item, session) in enumerate(live):
            count = int(verdict.num_accepted[b])
            path = verdict.accepted[b, :count].tolist()
            session.commit([0] + [node + 1 for node in path])
            tokens = [item.tree_tokens[node] for node in path] + [int(verdict.next_token[b])]
            session.token_ids.extend(tokens)
            results.append(VerifyResult(item.session_id, known=True, accepted_nodes=path, token_ids=tokens))
        return results
