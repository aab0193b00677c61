"""The verifier: checks many sessions' token trees against the target model in one forward pass.

Per session and round: sync the session's tokens (the client sends only what
changed), feed the last committed token followed by the tree's nodes with
tree attention, shape the target's logits into p as the request asked, run
`verification.verify_trees` (or, when every session in the batch is greedy,
`verify_trees_greedy` on the argmax ids alone), keep the KV of the accepted
path only, and append the accepted tokens and the next token to the session.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from specfleet.runtime import ForwardItem, LoadedModel, SessionStore, UnknownSession, forward_batch, prefill
from specfleet.sampling import STREAM_VERIFY, SamplingParams, generator_for, probs_from_logits
from verifier_service.verification import TreeBatch, verify_trees, verify_trees_greedy

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
            # Row j: which of [root, node 0, ..., node n-1] token j sees (itself and its ancestors).
            # Built in Python, one tensor at the end: per-element tensor ops cost more than the pass.
            depth = [0] * n
            rows = [[True] + [False] * n]
            for i, parent in enumerate(item.tree_parents):
                depth[i] = 1 if parent < 0 else depth[parent] + 1
                row = list(rows[parent + 1])
                row[i + 1] = True
                rows.append(row)
            forward_items.append(
                ForwardItem(
                    session,
                    [session.token_ids[-1], *item.tree_tokens],
                    [root_pos] + [root_pos + d for d in depth],
                    torch.tensor(rows) if n else None,
                )
            )
        logits = forward_batch(self.loaded, forward_items)  # [B, 1 + N, V]

        batch, width, vocab = logits.shape
        num_nodes = width - 1
        trees = self._tree_batch(live, num_nodes)
        params = [item.sampling for _, item, _ in live]
        if all(p.greedy for p in params):
            verdict = verify_trees_greedy(logits.argmax(dim=-1), trees)
        else:
            verdict = self._verify_sampled(live, params, logits, trees)

        results = []
        for b, (_, item, session) in enumerate(live):
            count = int(verdict.num_accepted[b])
            path = verdict.accepted[b, :count].tolist()
            session.commit([0] + [node + 1 for node in path])
            tokens = [item.tree_tokens[node] for node in path] + [int(verdict.next_token[b])]
            session.token_ids.extend(tokens)
            results.append(VerifyResult(item.session_id, known=True, accepted_nodes=path, token_ids=tokens))
        return results

    def _verify_sampled(self, live, params: list[SamplingParams], logits: torch.Tensor, trees: TreeBatch):
        """The general case: p shaped as each session asked, with its seeded noise."""
        batch, width, vocab = logits.shape
        num_nodes = width - 1
        per_row = lambda values, dtype: torch.tensor(values, dtype=dtype).repeat_interleave(width)  # noqa: E731
        target_probs = probs_from_logits(
            logits.reshape(batch * width, vocab),
            per_row([p.temperature for p in params], torch.float32),
            per_row([p.top_k for p in params], torch.long),
            per_row([p.top_p for p in params], torch.float32),
        ).reshape(batch, width, vocab)

        # A greedy session's p is a point mass, so its verdict does not depend on the noise
        # (verification.py, obligation 2): it gets constant noise instead of 8k random draws.
        uniforms = torch.zeros(batch, num_nodes)
        exponentials = torch.ones(batch, vocab)
        for b, (_, item, session) in enumerate(live):
            if not item.sampling.greedy:
                gen = generator_for(item.sampling.seed, len(session.token_ids), STREAM_VERIFY)
                uniforms[b] = torch.rand(num_nodes, generator=gen)
                exponentials[b].exponential_(generator=gen)
        return verify_trees(target_probs, trees, uniforms, exponentials)

    @staticmethod
    def _tree_batch(live, num_nodes: int) -> TreeBatch:
        batch = len(live)
        k_max = max([len(ids) for _, item, _ in live for ids, _ in item.proposals] or [1])
        # Padded to [B, N] / [B, N, K] in Python lists, converted once.
        tokens, parents, q_ids, q_probs = [], [], [], []
        for _, item, _ in live:
            pad = num_nodes - len(item.tree_tokens)
            tokens.append(item.tree_tokens + [0] * pad)
            parents.append(item.tree_parents + [-2] * pad)
            q_ids.append([ids + [0] * (k_max - len(ids)) for ids, _ in item.proposals] + [[0] * k_max] * pad)
            q_probs.append([probs + [0.0] * (k_max - len(probs)) for _, probs in item.proposals] + [[0.0] * k_max] * pad)
        parents_t = torch.tensor(parents, dtype=torch.long).reshape(batch, num_nodes)
        return TreeBatch(
            tokens=torch.tensor(tokens, dtype=torch.long).reshape(batch, num_nodes),
            parents=parents_t,
            valid=parents_t > -2,
            q_ids=torch.tensor(q_ids, dtype=torch.long).reshape(batch, num_nodes, k_max),
            q_probs=torch.tensor(q_probs, dtype=torch.float32).reshape(batch, num_nodes, k_max),
        )
