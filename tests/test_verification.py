"""The verification math is lossless: outputs are distributed exactly as the target's.

A Markov "language model" over a small vocabulary stands in for the target and
the drafters, so the exact distribution of the first tokens of a generation is
known in closed form, and hundreds of thousands of seeded generations run in a
second, vectorised. Each generation runs verification rounds until it has two
tokens; the empirical joint distribution of those two tokens must match the
target's within total variation 0.02 (the sampling noise at this size is about
0.005). A negative control shows the check catches a proposal distribution
that lies about what the token was drawn from.
"""

from __future__ import annotations

import pytest
import torch

from specfleet.sampling import probs_from_logits, truncate
from verifier_service.verification import TreeBatch, verify_trees, verify_trees_greedy

V = 6  # vocabulary
SAMPLES = 200_000
LENGTH = 2  # tokens per generation whose joint distribution is checked


def target_table(temperature: float, top_k: int, top_p: float, seed: int = 0) -> torch.Tensor:
    """[V, V]: the target's next-token distribution after each token, shaped as the user asked."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(V, V, generator=gen) * 2.0
    return probs_from_logits(
        logits,
        torch.full((V,), temperature),
        torch.full((V,), top_k, dtype=torch.long),
        torch.full((V,), top_p),
    )


def drafter_table(kind: str, target: torch.Tensor, seed: int) -> torch.Tensor:
    """[V, V] draft distributions: good (close to the target), random, or bad (avoids the target's choice)."""
    gen = torch.Generator().manual_seed(100 + seed)
    if kind == "good":
        probs = 0.7 * target + 0.3 * torch.rand(V, V, generator=gen).softmax(dim=1)
    elif kind == "random":
        probs = (torch.randn(V, V, generator=gen) * 1.5).softmax(dim=1)
    elif kind == "bad":
        probs = (1.0 - target) ** 4
        probs = probs / probs.sum(dim=1, keepdim=True)
    else:
        raise ValueError(kind)
    # Drafters send a sparse, truncated distribution and must draw from exactly that.
    ids, trunc = truncate(probs, 4)
    return torch.zeros(V, V).scatter_(1, ids, trunc)


def greedy_table(table: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(table).scatter_(1, table.argmax(dim=1, keepdim=True), 1.0)


def simulate(
    target: torch.Tensor,
    drafters: list[torch.Tensor],
    depth: int,
    gen: torch.Generator,
    claimed: list[torch.Tensor] | None = None,
    constant_noise: bool = False,
) -> torch.Tensor:
    """[SAMPLES, LENGTH] first tokens of generations that start after token 0.

    Each round drafts a tree: one child of the root per drafter (siblings), and
    under each child a chain of depth - 1 more tokens from the same drafter.
    `claimed` replaces the distributions sent with the proposals (the negative control).
    `constant_noise` passes the fixed noise the verifier gives greedy sessions.
    """
    claimed = claimed or drafters
    out = torch.full((SAMPLES, LENGTH), -1, dtype=torch.long)
    produced = torch.zeros(SAMPLES, dtype=torch.long)
    last = torch.zeros(SAMPLES, dtype=torch.long)
    rows = torch.arange(SAMPLES)
    while (produced < LENGTH).any():
        tokens, parents, q_probs, contexts = [], [], [], []
        for d, table in enumerate(drafters):
            prev = last
            for level in range(depth):
                token = torch.multinomial(table[prev], 1, generator=gen).squeeze(1)
                tokens.append(token)
                parents.append(torch.full((SAMPLES,), -1 if level == 0 else len(tokens) - 2))
                q_probs.append(claimed[d][prev])
                contexts.append(token)
                prev = token
        n = len(tokens)
        trees = TreeBatch(
            tokens=torch.stack(tokens, 1),
            parents=torch.stack(parents, 1),
            valid=torch.ones(SAMPLES, n, dtype=torch.bool),
            q_ids=torch.arange(V).expand(SAMPLES, n, V),
            q_probs=torch.stack(q_probs, 1),
        )
        target_probs = torch.stack([target[last]] + [target[c] for c in contexts], 1)
        if constant_noise:
            uniforms, exponentials = torch.zeros(SAMPLES, n), torch.ones(SAMPLES, V)
        else:
            uniforms, exponentials = torch.rand(SAMPLES, n, generator=gen), torch.empty(SAMPLES, V).exponential_(generator=gen)
        verdict = verify_trees(target_probs, trees, uniforms, exponentials)
        # This round emits the accepted drafts, then the next token.
        accepted_tokens = trees.tokens.gather(1, verdict.accepted.clamp(min=0))
        for j in range(n + 1):
            token = accepted_tokens[:, j] if j < n else verdict.next_token
            token = torch.where(verdict.num_accepted == j, verdict.next_token, token)
            take = (verdict.num_accepted >= j) & (produced < LENGTH)
            out[rows[take], produced[take]] = token[take]
            last = torch.where(take, token, last)
            produced += take.long()
    return out


def joint_tv(samples: torch.Tensor, target: torch.Tensor) -> float:
    counts = torch.zeros(V, V)
    counts.index_put_((samples[:, 0], samples[:, 1]), torch.ones(len(samples)), accumulate=True)
    empirical = counts / counts.sum()
    exact = target[0].unsqueeze(1) * target  # P(y1) P(y2 | y1)
    return 0.5 * (empirical - exact).abs().sum().item()


SHAPES = [  # temperature, top_k, top_p
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.0, 3, 1.0),
    (0.7, 0, 0.8),
    (1.0, 4, 0.9),
]


@pytest.mark.parametrize("temperature,top_k,top_p", SHAPES)
@pytest.mark.parametrize(
    "drafter_kinds,depth",
    [
        (["good"], 3),  # a chain
        (["bad"], 2),  # a chain from a deliberately bad drafter
        (["good", "random", "bad"], 2),  # a tree: three drafters disagreeing
    ],
    ids=["chain-good", "chain-bad", "tree-3-drafters"],
)
def test_sampled_output_is_distributed_as_target(temperature, top_k, top_p, drafter_kinds, depth):
    target = target_table(temperature, top_k, top_p)
    drafters = [drafter_table(kind, target, i) for i, kind in enumerate(drafter_kinds)]
    samples = simulate(target, drafters, depth, torch.Generator().manual_seed(7))
    assert joint_tv(samples, target) < 0.02


def test_point_mass_proposals_are_lossless():
    """Greedy or fused drafters propose deterministically; q is then a point mass."""
    target = target_table(1.0, 0, 1.0)
    drafters = [greedy_table(drafter_table("random", target, 1)), greedy_table(drafter_table("bad", target, 2))]
    samples = simulate(target, drafters, 2, torch.Generator().manual_seed(8))
    assert joint_tv(samples, target) < 0.02


def test_check_detects_a_proposal_that_lies_about_its_distribution():
    """Negative control: sampled tokens claimed as point masses bias the output."""
    target = target_table(1.0, 0, 1.0)
    drafter = drafter_table("bad", target, 3)
    samples = simulate(target, [drafter], 2, torch.Generator().manual_seed(9), claimed=[greedy_table(drafter)])
    assert joint_tv(samples, target) > 0.05


@pytest.mark.parametrize("depth,siblings", [(1, 1), (4, 1), (8, 1), (3, 3)])
def test_greedy_emits_exactly_the_target_argmax(depth, siblings):
    target = greedy_table(target_table(1.0, 0, 1.0))
    drafters = [greedy_table(drafter_table(k, target_table(1.0, 0, 1.0), i)) for i, k in enumerate(["good", "random", "bad"][:siblings])]
    samples = simulate(target, drafters, depth, torch.Generator().manual_seed(10))
    first = target[0].argmax()
    assert (samples[:, 0] == first).all()
    assert (samples[:, 1] == target[first].argmax()).all()


def test_greedy_needs_no_noise():
    """The verifier skips random draws for greedy sessions: with constant noise a point-mass target
    still emits exactly its argmax chain, whatever the proposals (here sampled ones that disagree)."""
    target = greedy_table(target_table(1.0, 0, 1.0))
    drafters = [drafter_table(k, target_table(1.0, 0, 1.0), i) for i, k in enumerate(["good", "random", "bad"])]
    samples = simulate(target, drafters, 3, torch.Generator().manual_seed(11), constant_noise=True)
    expected = [0]
    for _ in range(LENGTH):
        expected.append(int(target[expected[-1]].argmax()))
    assert (samples == torch.tensor(expected[1:])).all()


def test_greedy_specialisation_gives_the_same_verdict():
    """verify_trees_greedy on argmax ids == verify_trees on the point masses, for random ragged trees
    whose tokens often hit the argmax, with point-mass and sparse sampled proposals (obligation 5)."""
    gen = torch.Generator().manual_seed(5)
    batch, num_nodes, k = 64, 9, 3
    logits = torch.randn(batch, num_nodes + 1, V, generator=gen)
    argmax = logits.argmax(dim=-1)
    parents = torch.full((batch, num_nodes), -2, dtype=torch.long)
    tokens = torch.zeros(batch, num_nodes, dtype=torch.long)
    for b in range(batch):
        n = int(torch.randint(0, num_nodes + 1, (1,), generator=gen))
        for i in range(n):
            parents[b, i] = int(torch.randint(-1, i, (1,), generator=gen))
            hit = torch.rand(1, generator=gen) < 0.6
            tokens[b, i] = argmax[b, parents[b, i] + 1] if hit else torch.randint(0, V, (1,), generator=gen)
    q_ids = torch.cat([tokens.unsqueeze(2), torch.randint(0, V, (batch, num_nodes, k - 1), generator=gen)], dim=2)
    sampled = torch.rand(batch, num_nodes, 1, generator=gen) < 0.5
    q_probs = torch.where(sampled, torch.full((batch, num_nodes, k), 1.0 / k), torch.tensor([1.0] + [0.0] * (k - 1)))
    trees = TreeBatch(tokens=tokens, parents=parents, valid=parents > -2, q_ids=q_ids, q_probs=q_probs)
    point_masses = torch.zeros(batch, num_nodes + 1, V).scatter_(2, argmax.unsqueeze(2), 1.0)
    general = verify_trees(point_masses, trees, torch.rand(batch, num_nodes, generator=gen), torch.ones(batch, V))
    greedy = verify_trees_greedy(argmax, trees)
    assert torch.equal(general.accepted, greedy.accepted)
    assert torch.equal(general.num_accepted, greedy.num_accepted)
    assert torch.equal(general.next_token, greedy.next_token)
    assert general.num_accepted.max() >= 2  # the trees exercise deep acceptance, not only rejections


def test_verdict_shapes_and_accepted_path():
    """A chain the target fully accepts yields every node plus a bonus token."""
    target = greedy_table(target_table(1.0, 0, 1.0))
    path, prev = [], 0
    for _ in range(3):
        prev = int(target[prev].argmax())
        path.append(prev)
    tokens = torch.tensor([path])
    trees = TreeBatch(
        tokens=tokens,
        parents=torch.tensor([[-1, 0, 1]]),
        valid=torch.ones(1, 3, dtype=torch.bool),
        q_ids=tokens.unsqueeze(2),
        q_probs=torch.ones(1, 3, 1),
    )
    target_probs = torch.stack([target[0]] + [target[t] for t in path]).unsqueeze(0)
    verdict = verify_trees(target_probs, trees, torch.rand(1, 3), torch.ones(1, V))
    assert verdict.accepted.tolist() == [[0, 1, 2]]
    assert verdict.num_accepted.tolist() == [3]
    assert verdict.next_token.item() == int(target[path[-1]].argmax())
