"""The verification walk of `verifier_service.verification.verify_trees`, vectorised over sessions: the reference the
statistical tests run (200,000 sessions a round, where a walk per session in Python takes seconds), and that
`verify_trees` is checked against, verdict for verdict, in tests/verifier_service/test_verification.py.

Shapes: B sessions; N draft nodes (padded per session); K entries per sparse proposal; V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verifier_service.verification import _EMPTY_RESIDUAL


@dataclass
class TreeBatch:
    tokens: torch.Tensor  # [B, N] int64, draft token of each node
    parents: torch.Tensor  # [B, N] int64, parent node index, -1 for the root
    valid: torch.Tensor  # [B, N] bool, False for padding nodes
    q_ids: torch.Tensor  # [B, N, K] int64, support of each node's proposal distribution
    q_probs: torch.Tensor  # [B, N, K] float, probabilities on that support (0 for padding)


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B, N] int64, accepted node indices root to leaf, -1 after the last
    num_accepted: torch.Tensor  # [B] int64
    next_token: torch.Tensor  # [B] int64, the correction or bonus token


def verify_trees_batched(
    target_probs: torch.Tensor,  # [B, N + 1, V]: p after the root, then after each node
    trees: TreeBatch,
    uniforms: torch.Tensor,  # [B, N] in [0, 1), one per node
    final: torch.Tensor,  # [B] in [0, 1), the final draw's
) -> Verdict:
    """`verify_trees`' walk with every session of the batch in step: a loop over node indices of tensor operations on
    [B, V] residuals. Its per-node cost does not grow with B, which the statistical tests need."""
    batch, num_nodes = trees.tokens.shape
    rows = torch.arange(batch, device=target_probs.device)

    cur = torch.full((batch,), -1, dtype=torch.long, device=target_probs.device)
    residual = target_probs[:, 0].clone()  # [B, V]
    accepted = torch.full((batch, num_nodes), -1, dtype=torch.long, device=target_probs.device)
    num_accepted = torch.zeros(batch, dtype=torch.long, device=target_probs.device)

    for i in range(num_nodes):
        # Sessions for which node i is the next untried child of the current node.
        trying = trees.valid[:, i] & (trees.parents[:, i] == cur)
        if not trying.any():
            continue
        token = trees.tokens[:, i]
        # q_i(x_i): sum over the support, since a sparse support may list x_i once at most
        # but the caller need not have put it first.
        q_of_token = (trees.q_probs[:, i] * (trees.q_ids[:, i] == token.unsqueeze(1))).sum(dim=1)
        r_of_token = residual.gather(1, token.unsqueeze(1)).squeeze(1)
        # Accept with probability min(1, r/q): u < r/q, written without division.
        accept = trying & (uniforms[:, i] * q_of_token < r_of_token)
        reject = trying & ~accept

        if accept.any():
            accepted[rows[accept], num_accepted[accept]] = i
            num_accepted += accept.long()
            cur = torch.where(accept, torch.full_like(cur, i), cur)
            residual = torch.where(accept.unsqueeze(1), target_probs[:, i + 1], residual)
        if reject.any():
            reduced = residual.scatter_add(1, trees.q_ids[:, i], -trees.q_probs[:, i]).clamp_(min=0.0)
            mass = reduced.sum(dim=1, keepdim=True)
            fallback = target_probs[rows, cur + 1]
            reduced = torch.where(mass > _EMPTY_RESIDUAL, reduced / mass.clamp(min=_EMPTY_RESIDUAL), fallback)
            residual = torch.where(reject.unsqueeze(1), reduced, residual)

    # Inverse CDF: the first index whose cumulative mass exceeds u * sum(r) is v with probability r(v) / sum(r); a
    # token of no mass adds nothing to the sum, so it is never the first. In float64, and u < 1 keeps u * sum(r) below
    # the last sum.
    cdf = residual.double().cumsum(dim=1)
    point = (final.to(cdf) * cdf[:, -1]).unsqueeze(1)
    next_token = torch.searchsorted(cdf, point, right=True).squeeze(1)
    return Verdict(accepted=accepted, num_accepted=num_accepted, next_token=next_token)


def as_lists(trees: TreeBatch, uniforms: torch.Tensor, final: torch.Tensor) -> tuple:
    """A padded batch as `verify_trees` takes it (after target_probs): tokens, parents, proposals, uniforms, final."""
    tokens, parents, q_ids, q_probs = trees.tokens.tolist(), trees.parents.tolist(), trees.q_ids.tolist(), trees.q_probs.tolist()
    sizes = trees.valid.sum(dim=1).tolist()
    for b, n in enumerate(sizes):
        assert trees.valid[b, :n].all(), "padding nodes come after a session's nodes"
    return (
        [row[:n] for row, n in zip(tokens, sizes)],
        [row[:n] for row, n in zip(parents, sizes)],
        [list(zip(ids[:n], probs[:n])) for ids, probs, n in zip(q_ids, q_probs, sizes)],
        uniforms.tolist(),
        final.tolist(),
    )


def as_verdict(verdicts: list[tuple[list[int], int]], num_nodes: int) -> Verdict:
    """`verify_trees`' (or `verify_trees_greedy`'s) paths as a padded `Verdict`."""
    accepted = torch.full((len(verdicts), num_nodes), -1, dtype=torch.long)
    for b, (path, _) in enumerate(verdicts):
        accepted[b, : len(path)] = torch.tensor(path, dtype=torch.long)
    num_accepted = torch.tensor([len(path) for path, _ in verdicts], dtype=torch.long)
    return Verdict(accepted, num_accepted, torch.tensor([token for _, token in verdicts], dtype=torch.long))
