"""Lossless verification of draft token trees: multi-step speculative sampling.

One function, `verify_trees`, decides for a batch of sessions which drafted
tokens the target accepts and which token it emits next. A chain of drafts is
the tree in which every node has one child.

Setting, per session. The committed context ends at the root. Draft node i has
token x_i, a parent (-1 for the root), and the distribution q_i that x_i was
really drawn from given its path: a point mass when the drafter chose
deterministically (greedy or confidence-fused tokens), a sparse truncated
distribution when it sampled. p_0 is the target's distribution after the root,
p_{i+1} after node i, shaped as the request asked: its logit bias, its
penalties on the tokens that row's context holds (the session's tokens and the
path to node i) and min_tokens by the row's position (`shaping.adjusted`), then temperature, min-p, top-k and top-p (a point
mass on the argmax at temperature 0). Siblings are tried in node order.

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
    q would not (lookup-sends-a-flatter-q). A guided session's forced chains
    (verifier.py `_forced`) meet it too: each token is a point mass fixed by
    the grammar's state after the path before it, whatever anything draws. A
    lookup chain cut where its guide disallows a token is cut by what was
    drawn, which the proviso forbids: the verifier cuts only chains of
    sessions whose tokens are fixed (5 and 6 below), which emit the same
    whatever they are offered.
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
 7. The statistical tests of 1-3 run the walk vectorised over sessions
    (tests/verifier_service/reference_walk.py); `verify_trees` walks each
    session in Python and returns the same verdicts from the same draws, up to
    float rounding (its residual's sums are float64 where the reference's are
    float32), on random ragged trees with siblings below siblings, sparse and
    point-mass proposals, supports listing an id twice, and point-mass p whose
    residuals empty.

Shapes: B sessions; N draft nodes (the batch's widest tree); V vocabulary.
"""

from __future__ import annotations

from itertools import islice

import torch

# Residual mass below this is treated as empty. It can only be empty when the
# rejected proposals covered p entirely, which has probability zero; floating
# point can still get there, and then p itself is the right fallback.
_EMPTY_RESIDUAL = 1e-12


def verify_trees(
    target_probs: torch.Tensor,  # [B, N + 1, V]: p after the root, then after each node (rows past a session's nodes unread)
    tokens: list[list[int]],  # per session: its nodes' tokens
    parents: list[list[int]],  # per session: its nodes' parents (-1: the root)
    proposals: list[list[tuple[list[int], list[float]]]],  # per session, per node: q's support and probabilities
    uniforms: list[list[float]],  # per session: a draw in [0, 1) per node
    final: list[float],  # per session: the final draw's, in [0, 1)
) -> list[tuple[list[int], int]]:
    """The walk above, per session: (accepted nodes root to leaf, next token).

    All the walk reads of p before its final draw is p at each node's token and its proposal's support (a rejection
    changes the residual there alone), so those values come to the host in one gather and each session walks its
    nodes in Python; the final draw reads one row per session on the device. A loop of tensor operations per node
    costs tens of microseconds each on a CPU and a synchronisation per node on a GPU
    (docs/benchmarks/verify-overhead.md). tests/verifier_service/reference_walk.py walks the same trees vectorised
    over sessions, for the statistical tests' 200,000 sessions a round; a test checks both give the same verdicts."""
    values = iter(_node_values(target_probs, tokens, parents, proposals))
    walks = [_walk(*session, values) for session in zip(tokens, parents, proposals, uniforms)]
    next_tokens = _final_draws(target_probs, [(cur, residual) for _, cur, residual in walks], final)
    return [(path, token) for (path, _, _), token in zip(walks, next_tokens)]


def _node_values(target_probs, tokens, parents, proposals) -> list[float]:
    """p after each node's parent at the node's token, then at each id of its proposal, node after node, in one
    gather from the device."""
    batch, width, vocab = target_probs.shape
    rows, columns = [], []
    for b, (session_tokens, session_parents, session_proposals) in enumerate(zip(tokens, parents, proposals)):
        for token, parent, (ids, _) in zip(session_tokens, session_parents, session_proposals):
            rows += [b * width + parent + 1] * (1 + len(ids))
            columns += [token, *ids]
    if not rows:
        return []
    device = target_probs.device
    flat = target_probs.reshape(batch * width, vocab)
    return flat[torch.tensor(rows, device=device), torch.tensor(columns, device=device)].tolist()


def _walk(tokens, parents, proposals, uniforms, values) -> tuple[list[int], int, dict[int, float]]:
    """One session's walk: (accepted nodes, the node it ends at, the residual there where it differs from p).

    `values` yields each node's p values (`_node_values`), tried or not. The residual r is p_cur times `scale` except
    on the tokens in `changed`: rejecting a child lowers r on that child's support alone, and renormalising scales
    every token alike."""
    cur, path, changed, scale = -1, [], {}, 1.0
    for i, (token, parent, (ids, probs)) in enumerate(zip(tokens, parents, proposals)):
        p_token, *p_support = islice(values, 1 + len(ids))
        if parent != cur:
            continue
        q = {}  # id: (q(id), p(id)); an id listed twice holds the sum of its entries
        for v, q_v, p_v in zip(ids, probs, p_support):
            q[v] = (q[v][0] + q_v if v in q else q_v, p_v)
        r_token = changed[token] if token in changed else p_token * scale
        # Accept with probability min(1, r/q): u < r/q, written without division.
        if uniforms[i] * (q[token][0] if token in q else 0.0) < r_token:
            path.append(i)
            cur, changed, scale = i, {}, 1.0
            continue
        removed = 0.0  # r sums to 1: what max(0, r - q) takes from it
        for v, (q_v, p_v) in q.items():
            before = changed[v] if v in changed else p_v * scale
            changed[v] = max(before - q_v, 0.0)
            removed += before - changed[v]
        mass = 1.0 - removed
        if mass > _EMPTY_RESIDUAL:
            scale /= mass
            changed = {v: r_v / mass for v, r_v in changed.items()}
        else:
            changed, scale = {}, 1.0
    return path, cur, {v: r_v / scale for v, r_v in changed.items()}


def _final_draws(target_probs, ends: list[tuple[int, dict[int, float]]], final: list[float]) -> list[int]:
    """Each session's next token, drawn from the residual at the node it ended at: p after that node, with the
    tokens its rejected children changed set to their residual (on p's scale, which the draw does not depend on).

    Inverse CDF: the first index whose cumulative mass exceeds u * sum(r) is v with probability r(v) / sum(r); a
    token of no mass adds nothing to the sum, so it is never the first. In float64, and u < 1 keeps u * sum(r) below
    the last sum. One uniform a session, where a race over V needs V exponentials."""
    batch, width, vocab = target_probs.shape
    device = target_probs.device
    rows = torch.tensor([b * width + cur + 1 for b, (cur, _) in enumerate(ends)], device=device)
    residual = target_probs.reshape(batch * width, vocab)[rows].double()
    changes = [(b, v, r_v) for b, (_, changed) in enumerate(ends) for v, r_v in changed.items()]
    if changes:
        at_b, at_v, r = zip(*changes)
        residual[torch.tensor(at_b, device=device), torch.tensor(at_v, device=device)] = torch.tensor(r, dtype=torch.float64, device=device)
    cdf = residual.cumsum(dim=1)
    point = (torch.tensor(final, dtype=torch.float64, device=device) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, point, right=True).squeeze(1).tolist()


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
