"""Lossless verification of draft token trees: multi-step speculative sampling.

One function, `verify_trees`, decides for a batch of sessions which drafted
tokens the target accepts and which token it emits next. A chain of drafts is
the tree in which every node has one child.

Setting, per session. The committed context ends at the root. Draft node i has
token x_i, a parent (-1 for the root), and the distribution q_i that x_i was
really drawn from given its path: a point mass when the drafter chose
deterministically (greedy or confidence-fused tokens), a sparse truncated
distribution when it sampled. p_0 is the target's distribution after the root,
p_{i+1} after node i, shaped by the user's temperature, top-k and top-p
(a point mass on the argmax at temperature 0). Siblings are tried in node order.

The walk (SpecInfer's multi-step speculative sampling; a chain reduces to
Leviathan et al. / Chen et al. speculative sampling):
    cur = root, r = p_cur
    for each child c of cur, in order:
        accept x_c with probability min(1, r(x_c) / q_c(x_c))
        if accepted: cur = c, r = p_c, and continue with c's children
        else:        r = normalise(max(0, r - q_c))
    emit one token drawn from r
When cur has no children left to try, r is either p_cur itself (a leaf: the
bonus token) or the residual after its rejected children (the correction). The final
draw is by inverse CDF: the first token whose cumulative mass exceeds
u * sum(r), u uniform in [0, 1).

Proof obligations, each checked by tests/verifier_service/test_verification.py:
 1. Lossless: for every context, the first emitted token is distributed
    exactly as p_root, for any q_i and any number of siblings, provided each
    sibling's token was drawn from its q_i independently of the other
    siblings' tokens and of this module's random draws, and the sibling order
    was fixed without looking at the drawn tokens. (Induction over siblings:
    P(emit y) = P(accept y) + P(reject) * r'(y), and
    min(r(y), q(y)) + (1 - sum_z min(r(z), q(z))) * max(0, r(y) - q(y)) / Z = r(y).)
    Applied recursively down the accepted path, every emitted token is
    distributed as the target's next-token distribution given all tokens
    before it, so whole outputs are distributed as the target's.
    The router's trees (router/trees.py) meet the proviso however many
    drafters made them: lockstep siblings are drawn by different drafters
    given the same path; a chain from another service is drawn by its own
    drafter given its own tokens, which are the node's path in the tree (a
    chain shares a node only where both proposals are the same point mass,
    so the node's q is each one's); siblings come in routing order, fixed
    before drafting. Siblings ordered by their drawn tokens would break it
    (tests/mutants/lossless.yaml: cross-service-chains-in-confidence-order).
    The verifier's own lookup chains in plain passes (verifier.py
    `_looked_up`) meet it as a drafter's do: each token is drawn from the
    n-gram q it carries (`specfleet.engine.ngram.choose`), on a random
    stream of its own, given the chain before it; a chain claiming another
    q would not (lookup-sends-a-flatter-q).
 2. Greedy equality: when p is a point mass on the target's argmax, a token is
    accepted iff it is the argmax, and the emitted token is the argmax.
 3. Point-mass proposals: q = delta_x accepts x with probability p(x) and
    the residual is p without x, renormalised.
 4. Reproducible: the outcome is a deterministic function of the inputs,
    including the caller's uniforms (one per node, one for the final draw).
 5. `verify_trees_greedy` is `verify_trees` specialised to point-mass p: it
    returns the same verdict from the argmax ids alone. With r a point mass on
    y, a child is accepted iff its token is y, and rejecting a child leaves r
    on y (r - q keeps 1 - q(y) > 0 there), so the walk only compares ids.
 6. Drafter-invariant sessions (`SamplingParams.drafter_invariant`): the
    token that fills position t is y_t = argmax_v p_t(v) / E_t(v), with
    E_t(v) ~ Exp(1) i.i.d. over v, a function of (seed, t, v) alone
    (`specfleet.engine.sampling.race_noise`). Walking the tree with
    `verify_trees_greedy` on these y (a point mass on y_t, as in 5) emits y_t
    at every position whatever was drafted: drafts decide only how many
    positions one round fills. The exponential race gives
    P(y_t = v) = p_t(v) / sum(p_t), and E_t is independent of every draw that
    fixed the context before t (those use positions < t only), so y_t given the
    context is distributed exactly as p_t: lossless, and reproducible from the
    seed alone. A drafter that races its own q against the same E_t proposes
    y_t with probability at least sum_v min(p_t(v), q(v)) / (1 + TV(p_t, q))
    (Daliri, Musco and Suresh, 2024), somewhat below rejection sampling's
    sum_v min(p_t(v), q(v)); that is the price of invariance.

Shapes: B sessions; N draft nodes (padded per session); K entries per sparse
proposal; V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Residual mass below this is treated as empty. It can only be empty when the
# rejected proposals covered p entirely, which has probability zero; floating
# point can still get there, and then p itself is the right fallback.
_EMPTY_RESIDUAL = 1e-12


@dataclass
class TreeBatch:
    tokens: torch.Tensor  # [B, N] int64, draft token of each node
    parents: torch.Tensor  # [B, N] int64, parent node index, -1 for the root
    valid: torch.Tensor  # [B, N] bool, False for padding nodes
    q_ids: torch.Tensor  # [B, N, K] int64, support of each node's proposal distribution
    q_probs: torch.Tensor  # [B, N, K] float, probabilities on that support (0 for padding)

    @classmethod
    def from_lists(
        cls,
        tokens: list[list[int]],
        parents: list[list[int]],
        proposals: list[list[tuple[list[int], list[float]]]],
        num_nodes: int,
        device,
    ) -> "TreeBatch":
        """Sessions' trees (token ids, parents, per node its proposal's (ids, probs)) padded to N nodes and
        K entries, on the device. Padded in Python lists, converted once."""
        batch = len(tokens)
        k_max = max([len(ids) for session in proposals for ids, _ in session] or [1])
        rows_t, rows_p, rows_qi, rows_qp = [], [], [], []
        for toks, pars, props in zip(tokens, parents, proposals):
            pad = num_nodes - len(toks)
            rows_t.append(toks + [0] * pad)
            rows_p.append(pars + [-2] * pad)
            rows_qi.append([ids + [0] * (k_max - len(ids)) for ids, _ in props] + [[0] * k_max] * pad)
            rows_qp.append([probs + [0.0] * (k_max - len(probs)) for _, probs in props] + [[0.0] * k_max] * pad)
        parents_t = torch.tensor(rows_p, dtype=torch.long, device=device).reshape(batch, num_nodes)
        return cls(
            tokens=torch.tensor(rows_t, dtype=torch.long, device=device).reshape(batch, num_nodes),
            parents=parents_t,
            valid=parents_t > -2,
            q_ids=torch.tensor(rows_qi, dtype=torch.long, device=device).reshape(batch, num_nodes, k_max),
            q_probs=torch.tensor(rows_qp, dtype=torch.float32, device=device).reshape(batch, num_nodes, k_max),
        )


@dataclass
class Verdict:
    accepted: torch.Tensor  # [B, N] int64, accepted node indices root to leaf, -1 after the last
    num_accepted: torch.Tensor  # [B] int64
    next_token: torch.Tensor  # [B] int64, the correction or bonus token


def verify_trees(
    target_probs: torch.Tensor,  # [B, N + 1, V]: p after the root, then after each node
    trees: TreeBatch,
    uniforms: torch.Tensor,  # [B, N] in [0, 1), one per node
    final: torch.Tensor,  # [B] in [0, 1), the final draw's
) -> Verdict:
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
    # the last sum. One uniform a session, where a race over V needs V exponentials (docs/benchmarks/verify-overhead.md).
    cdf = residual.double().cumsum(dim=1)
    point = (final.to(cdf) * cdf[:, -1]).unsqueeze(1)
    next_token = torch.searchsorted(cdf, point, right=True).squeeze(1)
    return Verdict(accepted=accepted, num_accepted=num_accepted, next_token=next_token)


def verify_trees_greedy(
    target_ids: list[list[int]],  # per session: the target's token after the root, then after each node (N + 1)
    tokens: list[list[int]],  # per session: its nodes' tokens
    parents: list[list[int]],  # per session: its nodes' parents (-1: the root; below -1: padding, never accepted)
) -> list[tuple[list[int], int]]:
    """`verify_trees` for sessions at temperature 0: per session (accepted nodes root to leaf, next token), from
    the target's fixed tokens alone, without [B, N + 1, V] probabilities or noise. A walk over Python lists: the ids
    come to the host once (the caller's `tolist`), where a loop of tensor operations per node costs tens of
    microseconds each, and a plain pass's verdict took a fifth of a one-session pass of the demo target
    (docs/benchmarks/verify-overhead.md)."""
    verdicts = []
    for wanted_row, session_tokens, session_parents in zip(target_ids, tokens, parents):
        cur, wanted, path = -1, wanted_row[0], []
        for i, (token, parent) in enumerate(zip(session_tokens, session_parents)):
            if parent == cur and token == wanted:
                path.append(i)
                cur, wanted = i, wanted_row[i + 1]
        verdicts.append((path, wanted))
    return verdicts
