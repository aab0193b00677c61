"""The verification math is lossless: outputs are distributed exactly as the target's.

Two independent parts.

Shaping. `probs_from_logits` (temperature, then top-k, then top-p) is compared,
within float tolerance, with `reference_probs` below: plain numpy written from
the specification, sharing no code with `specfleet.sampling`.

Verification. A Markov "language model" over V tokens stands in for the target
and the drafters: the target's next-token distribution depends only on the
last token, so the exact law of every generated token is known in closed form.
The verifier sees what the real one sees (`probs_from_logits` of the target's
logits); the expected law comes from `reference_probs`. Each of SAMPLES seeded
generations starts at a uniformly drawn token y_0 and runs draft-and-verify
rounds (the same tree shape every round) until it has `length` tokens, one
more than the tree's depth, so every node of a tree can change the checked
output. For each position j = 1..length the empirical law of the pair
(y_{j-1}, y_j) must match the exact one, pi_{j-1}(a) * T[a, b], in total
variation.

Threshold (`tv_threshold`), for one table of M outcomes with exact probabilities
p_i from n independent generations:
  - mean: E|p^_i - p_i| <= sqrt(Var p^_i) = sqrt(p_i (1 - p_i) / n) (Jensen), so
    E[TV] <= 0.5 * sum_i sqrt(p_i (1 - p_i) / n), at most 0.5 * sqrt(M / n);
  - spread: changing one generation moves one count between two cells and TV
    by at most 1/n, so by McDiarmid P(TV >= E[TV] + t) <= exp(-2 n t^2);
    t = sqrt(ln(tables / FALSE_FAILURE) / (2 n)), with a union bound over the
    test's `tables` tables, makes a false failure of a correct verifier at most
    FALSE_FAILURE = 1e-6 per test.
At n = 200,000 and M = 36 this is 0.009 to 0.011; a correct verifier measures
0.3 to 0.5 of it, and each mutant in tests/mutants/verification.yaml that a
sampled test catches measures 4 to 100 times it. The seeds make every test
deterministic; the threshold says why the verdict is not luck.

The rounds run the walk vectorised over sessions (reference_walk.py), which
takes 200,000 sessions a round in tenths of a second; `verify_trees`, the
verifier's walk per session in Python, is checked against it verdict for
verdict (obligation 7), and against exact cases of its own.

Every test here that can pass vacuously also asserts that the paths it is
about carry real mass (rejections, corrections, acceptance at depth 3 and
below), and the known-bad changes in tests/mutants/verification.yaml must each
make some test here fail.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from specfleet.engine.sampling import probs_from_logits
from tests.verifier_service.reference_walk import TreeBatch, Verdict, as_lists, as_verdict, verify_trees_batched
from verifier_service.verification import verify_trees, verify_trees_greedy

V = 6  # vocabulary of the Markov models
SAMPLES = 200_000
FALSE_FAILURE = 1e-6  # probability that a correct verifier fails one statistical test
# SPECFLEET_TEST_DEVICE=cuda gives `verify_trees` its p on a GPU in the tests that check it against the reference and
# by hand (scripts/device-check sets it); everything else here runs on the CPU.
DEVICE = os.environ.get("SPECFLEET_TEST_DEVICE", "cpu")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tensors here are small (200,000 x 6): intra-op threads cost more than they give,
    and far more on a shared two-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------
# Independent reference for probability shaping


def reference_probs(logits, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The specification, in float64: temperature, then top-k, then top-p, ties to the lower id.

    Temperature 0 is a point mass on the argmax (lowest id on ties). top_k keeps the k
    largest scaled logits (0 or k >= V: all). top_p keeps the smallest prefix of the
    sorted top-k distribution whose mass reaches top_p; the top token is always kept.
    The kept tokens' probabilities are renormalised.
    """
    logits = np.asarray(logits, dtype=np.float64)
    vocab = len(logits)
    out = np.zeros(vocab)
    if temperature <= 0:
        out[int(np.argmax(logits))] = 1.0  # np.argmax returns the first maximum
        return out
    scaled = logits / temperature
    order = sorted(range(vocab), key=lambda token: (-scaled[token], token))
    if 0 < top_k < vocab:
        order = order[:top_k]
    weights = np.exp(scaled[order] - scaled[order[0]])
    probs = weights / weights.sum()
    kept, mass = 0, 0.0
    while kept < len(order):
        mass += probs[kept]
        kept += 1
        if mass >= top_p:
            break
    out[order[:kept]] = probs[:kept] / probs[:kept].sum()
    return out


def top_p_is_ambiguous(logits, temperature: float, top_k: int, top_p: float) -> bool:
    """Whether some prefix mass lies within float32 rounding of top_p, where float32 and
    float64 may legitimately keep a different number of tokens."""
    if temperature <= 0 or top_p >= 1:
        return False
    scaled = np.asarray(logits, dtype=np.float64) / temperature
    ordered = np.sort(scaled)[::-1]
    if 0 < top_k < len(ordered):
        ordered = ordered[:top_k]
    probs = np.exp(ordered - ordered[0])
    probs /= probs.sum()
    return bool((np.abs(np.cumsum(probs) - top_p) < 1e-5).any())


def shaped(logits: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    """probs_from_logits with one setting per row (scalars broadcast)."""
    rows = logits.shape[0]
    as_row = lambda value, dtype: torch.as_tensor(value, dtype=dtype).expand(rows).clone()  # noqa: E731
    return probs_from_logits(logits, as_row(temperature, torch.float32), as_row(top_k, torch.long), as_row(top_p, torch.float32))


# Hand-computed cases: p = (0.1, 0.4, 0.2, 0.3) at temperature 1; sorted: 1, 3, 2, 0.
P4 = [0.1, 0.4, 0.2, 0.3]
EDGE_CASES = [  # logits, temperature, top_k, top_p, expected
    ("no-limit", np.log(P4), 1.0, 0, 1.0, P4),
    ("top-k-equals-V", np.log(P4), 1.0, 4, 1.0, P4),
    ("top-k-above-V", np.log(P4), 1.0, 9, 1.0, P4),
    ("top-k-2", np.log(P4), 1.0, 2, 1.0, [0, 4 / 7, 0, 3 / 7]),
    ("top-k-1", np.log(P4), 1.0, 1, 1.0, [0, 1, 0, 0]),
    ("top-p-keeps-two", np.log(P4), 1.0, 0, 0.65, [0, 4 / 7, 0, 3 / 7]),
    ("top-p-keeps-three", np.log(P4), 1.0, 0, 0.75, [0, 4 / 9, 2 / 9, 3 / 9]),
    ("top-p-reached-exactly", np.zeros(4), 1.0, 0, 0.5, [0.5, 0.5, 0, 0]),
    ("tiny-top-p", np.log(P4), 1.0, 0, 1e-6, [0, 1, 0, 0]),
    ("top-p-after-top-k", np.log(P4), 1.0, 2, 0.5, [0, 1, 0, 0]),
    ("temperature-2", np.log(P4), 2.0, 0, 1.0, list(np.sqrt(P4) / np.sqrt(P4).sum())),
    ("temperature-half", np.log(P4), 0.5, 0, 1.0, list(np.square(P4) / np.square(P4).sum())),
    ("greedy", np.log(P4), 0.0, 0, 1.0, [0, 1, 0, 0]),
    ("greedy-tie-lowest-id", [1.0, 3.0, 3.0, 2.0], 0.0, 0, 1.0, [0, 1, 0, 0]),
    ("greedy-ignores-truncation", [1.0, 3.0, 3.0, 2.0], 0.0, 1, 0.1, [0, 1, 0, 0]),
    ("top-k-tie-lower-ids", [1.0, 2.0, 2.0, 2.0, 0.0], 1.0, 2, 1.0, [0, 0.5, 0.5, 0, 0]),
    ("top-p-tie-lower-ids", [0.0, 1.0, 1.0, 1.0], 1.0, 0, 0.5, [0, 0.5, 0.5, 0]),
]


@pytest.mark.parametrize("logits,temperature,top_k,top_p,expected", [c[1:] for c in EDGE_CASES], ids=[c[0] for c in EDGE_CASES])
def test_shaping_edge_cases(logits, temperature, top_k, top_p, expected):
    """Values worked out by hand, alone (no-truncation and greedy fast paths) and inside a batch
    whose other row truncates (the sort path), and the same from the reference."""
    row = torch.tensor(np.array([logits]), dtype=torch.float32)
    alone = shaped(row, temperature, top_k, top_p)[0]
    other = torch.tensor([[0.0] * (len(logits) - 1) + [1.0]])
    batched = probs_from_logits(
        torch.cat([row, other]),
        torch.tensor([temperature, 1.0]),
        torch.tensor([top_k, 1]),
        torch.tensor([top_p, 0.5]),
    )[0]
    np.testing.assert_allclose(alone.numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(batched.numpy(), expected, atol=1e-6)
    np.testing.assert_allclose(reference_probs(logits, temperature, top_k, top_p), expected, atol=1e-12)


@pytest.mark.parametrize("vocab", [6, 16])
def test_shaping_matches_the_reference_on_random_rows(vocab):
    """Thousands of rows with mixed settings in one batch, and each setting alone; a third of the
    rows have coarse logits, so ties (at the top, at the top-k and top-p boundaries) are common."""
    rng = np.random.default_rng(vocab)
    rows = 3000
    logits = rng.normal(size=(rows, vocab)) * 2.0
    logits[::3] = np.round(logits[::3])
    temperature = rng.choice([0.0, 0.3, 0.7, 1.0, 1.6, 4.0], size=rows)
    top_k = rng.choice([0, 1, 2, 3, vocab - 1, vocab, vocab + 3], size=rows)
    top_p = rng.choice([1.0, 0.95, 0.8, 0.5, 0.2, 1e-4, -1.0], size=rows)
    top_p = np.where(top_p < 0, rng.uniform(size=rows), top_p)
    clear = np.array([not top_p_is_ambiguous(logits[b], temperature[b], top_k[b], top_p[b]) for b in range(rows)])
    assert clear.mean() > 0.97  # the rounded rows put some top-p boundaries exactly on a tie's mass
    expected = np.stack([reference_probs(logits[b], temperature[b], top_k[b], top_p[b]) for b in range(rows)])

    batch = probs_from_logits(
        torch.tensor(logits, dtype=torch.float32),
        torch.tensor(temperature, dtype=torch.float32),
        torch.tensor(top_k),
        torch.tensor(top_p, dtype=torch.float32),
    ).numpy()
    np.testing.assert_allclose(batch[clear], expected[clear], atol=2e-6)
    # The same support: nothing the specification drops is kept, nothing it keeps is dropped. (Past
    # 1e-6, because float32's prefix mass reaches 1 before the last tokens of mass ~1e-8 at top_p = 1.)
    assert (batch[clear][expected[clear] == 0] == 0).all()
    assert (batch[clear][expected[clear] > 1e-6] > 0).all()

    # Each distinct setting alone: all-greedy and no-truncation batches take their own paths.
    for setting in {(t, k, p) for t, k, p in zip(temperature, top_k, top_p) if p in (1.0, 0.5, 1e-4)}:
        mask = clear & (temperature == setting[0]) & (top_k == setting[1]) & (top_p == setting[2])
        alone = shaped(torch.tensor(logits[mask], dtype=torch.float32), *setting).numpy()
        np.testing.assert_allclose(alone, expected[mask], atol=2e-6, err_msg=str(setting))


def test_truncation_ties_keep_the_lower_ids_in_a_large_vocabulary():
    vocab = 64
    logits = torch.zeros(2, vocab)
    logits[:, vocab // 2] = 1.0  # one top token, then 63 tied ones
    got = probs_from_logits(logits, torch.ones(2), torch.tensor([3, 0]), torch.tensor([1.0, 0.3]))
    expected = np.stack([reference_probs(logits[0].numpy(), 1.0, 3, 1.0), reference_probs(logits[1].numpy(), 1.0, 0, 0.3)])
    np.testing.assert_allclose(got.numpy(), expected, atol=1e-6)


def test_a_row_without_top_p_keeps_its_whole_support_whatever_it_is_batched_with():
    """In float32 a row's cumulative mass reaches 1.0 before its tail ends; only rows that ask for top-p truncate."""
    logits = torch.linspace(0.0, -40.0, 64).expand(2, 64).clone()  # a long tail of tiny probabilities
    alone = probs_from_logits(logits[:1], torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1))
    batched = probs_from_logits(logits, torch.ones(2), torch.tensor([0, 5]), torch.tensor([1.0, 0.5]))
    assert torch.equal(alone[0] > 0, batched[0] > 0)
    assert torch.allclose(alone[0], batched[0])


def test_min_p_keeps_the_tokens_at_least_min_p_times_the_top_one_before_top_k_and_top_p_and_rows_apart():
    """vLLM's min_p, on the tempered distribution and before top-k and top-p: p = (0.1, 0.4, 0.2, 0.3); min_p 0.5
    keeps the tokens >= 0.2 (ids 1, 3, 2), then top_p 0.7 the prefix reaching it within those: 0.4 / 0.9 then 0.3 /
    0.9 (0.78); a row without min_p batched beside it keeps its whole support."""
    logits = torch.tensor(P4).log().expand(3, 4).clone()
    got = probs_from_logits(logits, torch.ones(3), torch.zeros(3, dtype=torch.long), torch.tensor([1.0, 0.7, 1.0]), torch.tensor([0.5, 0.5, 0.0]))
    np.testing.assert_allclose(got[0].numpy(), [0.0, 4 / 9, 2 / 9, 3 / 9], atol=1e-6)
    np.testing.assert_allclose(got[1].numpy(), [0.0, 4 / 7, 0.0, 3 / 7], atol=1e-6)
    np.testing.assert_allclose(got[2].numpy(), P4, atol=1e-6)
    # At temperature 2 the tempered p is sqrt(P4), renormalised: 0.1's token is then half the top one's, kept at 0.45.
    hot = probs_from_logits(logits[:1], torch.full((1,), 2.0), torch.zeros(1, dtype=torch.long), torch.ones(1), torch.tensor([0.45]))
    assert bool((hot[0] > 0).all())


# ---------------------------------------------------------------------------------------------
# The Markov world: target, proposals, trees


def target_logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 2.0


def reference_table(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[V, V] float64: the exact target law after each token, from the reference."""
    return torch.tensor(np.stack([reference_probs(row, temperature, top_k, top_p) for row in logits.numpy()]))


def sparse_top(table: torch.Tensor, keep: int) -> torch.Tensor:
    """Each row's `keep` most likely tokens, renormalised: drafters send and sample from truncated laws."""
    order = torch.sort(-table, dim=1, stable=True).indices[:, :keep]
    kept = torch.zeros_like(table).scatter_(1, order, table.gather(1, order))
    return kept / kept.sum(dim=1, keepdim=True)


def point_mass(table: torch.Tensor, rank: int) -> torch.Tensor:
    """A deterministic proposal: each row's rank-th most likely token (0 = argmax), lower ids first on ties."""
    token = torch.sort(-table, dim=1, stable=True).indices[:, rank]
    return torch.zeros_like(table).scatter_(1, token.unsqueeze(1), 1.0)


def proposals(target: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    """[V, V] float64 proposal laws by name. "good" is close to the target, "random" unrelated,
    "adversarial" puts its mass where the target has little or none; "<name>-top<r>" is the point
    mass on that law's r-th choice."""
    gen = torch.Generator().manual_seed(100 + seed)
    noise = (torch.randn(V, V, generator=gen) * 1.5).softmax(dim=1).double()
    tables = {
        "good": sparse_top(0.7 * target + 0.3 * noise, 4),
        "random": sparse_top((torch.randn(V, V, generator=gen) * 1.5).softmax(dim=1).double(), 4),
        "adversarial": sparse_top((1.0 - target) ** 4 + 1e-3, 3),
    }
    for name in list(tables):
        for rank in range(3):
            tables[f"{name}-top{rank + 1}"] = point_mass(tables[name], rank)
    return tables


@dataclass(frozen=True)
class Tree:
    """One round's draft tree, the same shape every round. Node i draws its token from the law
    tables[i] at its context (its parent's token; for the root's children the last committed token)."""

    parents: tuple[int, ...]
    tables: tuple[str, ...]

    @property
    def depth(self) -> int:
        depth = [0] * len(self.parents)
        for i, parent in enumerate(self.parents):
            depth[i] = 1 if parent < 0 else depth[parent] + 1
        return max(depth)


def chain(table: str, depth: int) -> Tree:
    return Tree(parents=tuple(range(-1, depth - 1)), tables=(table,) * depth)


def full_tree(levels: list[list[str]], depth_first: bool = False) -> Tree:
    """Every node of level l - 1 has one child per entry of levels[l], in that order (siblings
    below siblings). Nodes are numbered breadth first, or depth first; verification accepts either."""
    parents: list[int] = []
    tables: list[str] = []

    def grow(parent: int, level: int) -> None:
        for table in levels[level]:
            parents.append(parent)
            tables.append(table)
            if level + 1 < len(levels):
                grow(len(parents) - 1, level + 1)

    if depth_first:
        grow(-1, 0)
    else:
        frontier = [-1]
        for level in levels:
            next_frontier = []
            for parent in frontier:
                for table in level:
                    parents.append(parent)
                    tables.append(table)
                    next_frontier.append(len(parents) - 1)
            frontier = next_frontier
    return Tree(parents=tuple(parents), tables=tuple(tables))


TREES = {
    "chain-good": chain("good", 4),
    "chain-random": chain("random", 4),
    # Three disagreeing drafters, two children under each node, two under each of those.
    "wide-mixed": full_tree([["good", "random", "adversarial"], ["good", "random"], ["random", "good"]]),
    # Independent siblings drawn from one law (they repeat each other's tokens), depth first.
    "wide-iid": full_tree([["random"] * 3, ["random"] * 2, ["random"]], depth_first=True),
    # A deterministic token tree: each node's children are the drafter's top choices.
    "wide-point-mass": full_tree([["good-top1", "good-top2", "good-top3"], ["good-top1", "good-top2"], ["good-top1"], ["good-top1"]]),
    # Point masses next to sampled siblings, a point mass repeated, an adversary below.
    "wide-point-mass-and-sampled": full_tree([["random-top1", "random", "random-top1"], ["adversarial", "good-top1"], ["good", "adversarial-top1"]]),
}


@dataclass
class Stats:
    rounds: int = 0
    tried: int = 0  # draft nodes whose acceptance was tested
    rejected: int = 0
    corrections: int = 0  # rounds that ended by drawing from a residual after rejections
    bonuses: int = 0  # rounds that accepted a leaf and drew from its target law
    deep: int = 0  # rounds that accepted a node at depth 3 or more

    def __str__(self) -> str:
        return (
            f"rejected {self.rejected / max(self.tried, 1):.2f} of tried nodes, corrections {self.corrections / self.rounds:.2f} "
            f"and bonuses {self.bonuses / self.rounds:.2f} of rounds, depth >= 3 accepted in {self.deep / self.rounds:.2f}"
        )


def draw(laws: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row of [m, V] float64 laws, by inverse CDF (never a zero-probability token)."""
    cdf = laws.cumsum(dim=1)
    cdf = cdf / cdf[:, -1:]
    u = torch.rand(laws.shape[0], 1, generator=gen, dtype=torch.float64)
    return (u >= cdf).sum(dim=1)


def as_sparse(laws: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[m, V] -> [m, width] ids and float32 probs: the support, least likely first (the verifier must
    not assume any order), padded with zero-probability ids."""
    ids = torch.sort(laws, dim=1, stable=True).indices[:, -width:]
    return ids, laws.gather(1, ids).float()


def greedy_verdict(target_ids: torch.Tensor, trees: TreeBatch) -> Verdict:
    """`verify_trees_greedy`'s paths as a `Verdict`, to compare with the reference walk and share its bookkeeping."""
    parents = torch.where(trees.valid, trees.parents, torch.full_like(trees.parents, -2))
    return as_verdict(verify_trees_greedy(target_ids.tolist(), trees.tokens.tolist(), parents.tolist()), trees.tokens.shape[1])


def simulate(
    target_probs: torch.Tensor,  # [V, V] float32, what the verifier sees after each token
    tables: dict[str, torch.Tensor],
    tree: Tree,
    length: int,
    gen: torch.Generator,
    mode: str = "sampled",
    claimed: dict[str, torch.Tensor] | None = None,
    samples: int = SAMPLES,
) -> tuple[torch.Tensor, Stats]:
    """[samples, length + 1] generations (column 0 is the start token), and what the rounds did.

    mode: "sampled" (the reference walk with fresh noise), "constant-noise" (the reference walk with the fixed
    noise the verifier gives greedy sessions) or "greedy" (verify_trees_greedy on argmax ids).
    claimed: laws sent in place of the ones the tokens were drawn from (the negative control).
    """
    claimed = claimed or tables
    nodes = len(tree.parents)
    parents = torch.tensor(tree.parents)
    has_children = torch.zeros(nodes + 1, dtype=torch.bool)  # index 0: the root
    has_children[parents + 1] = True
    width = max(int((claimed[name] > 0).sum(dim=1).max()) for name in tree.tables)
    sparse = {name: as_sparse(claimed[name], width) for name in set(tree.tables)}  # per context token

    out = torch.full((samples, length + 1), -1, dtype=torch.long)
    out[:, 0] = torch.randint(0, V, (samples,), generator=gen)
    produced = torch.zeros(samples, dtype=torch.long)
    stats = Stats()
    argmax = target_probs.argmax(dim=1)
    while (active := (produced < length).nonzero().squeeze(1)).numel():
        m = active.numel()
        last = out[active, produced[active]]
        tokens = torch.empty(m, nodes, dtype=torch.long)
        q_ids = torch.empty(m, nodes, width, dtype=torch.long)
        q_probs = torch.empty(m, nodes, width)
        for i, (parent, name) in enumerate(zip(tree.parents, tree.tables)):
            context = last if parent < 0 else tokens[:, parent]
            tokens[:, i] = draw(tables[name][context], gen)
            q_ids[:, i], q_probs[:, i] = sparse[name][0][context], sparse[name][1][context]
        trees = TreeBatch(tokens=tokens, parents=parents.expand(m, nodes), valid=torch.ones(m, nodes, dtype=torch.bool), q_ids=q_ids, q_probs=q_probs)
        contexts = torch.cat([last.unsqueeze(1), tokens], dim=1)  # [m, nodes + 1]
        if mode == "greedy":
            verdict = greedy_verdict(argmax[contexts], trees)
        elif mode == "constant-noise":
            verdict = verify_trees_batched(target_probs[contexts], trees, torch.zeros(m, nodes), torch.zeros(m))
        else:
            uniforms = torch.rand(m, nodes, generator=gen)
            verdict = verify_trees_batched(target_probs[contexts], trees, uniforms, torch.rand(m, generator=gen))

        # The round emits the accepted drafts, then the next token.
        steps = torch.arange(nodes + 1)
        emitted = torch.cat([tokens.gather(1, verdict.accepted.clamp(min=0)), torch.zeros(m, 1, dtype=torch.long)], dim=1)
        emitted.scatter_(1, verdict.num_accepted.unsqueeze(1), verdict.next_token.unsqueeze(1))
        position = produced[active].unsqueeze(1) + 1 + steps
        keep = (steps <= verdict.num_accepted.unsqueeze(1)) & (position <= length)
        out[active.unsqueeze(1).expand(m, nodes + 1)[keep], position[keep]] = emitted[keep]
        produced[active] += keep.sum(dim=1)

        # Which nodes were tried: the children of the accepted path's nodes (and of the root), up
        # to and including the accepted one; all children of where the walk ended.
        on_path = torch.zeros(m, nodes + 1, dtype=torch.bool)
        on_path[:, 0] = True
        taken = torch.full((m, nodes + 1), nodes, dtype=torch.long)  # the accepted child, if any
        for level in range(nodes):
            node = verdict.accepted[:, level]
            hit = node >= 0
            if not hit.any():
                break
            on_path[hit.nonzero().squeeze(1), node[hit] + 1] = True
            taken[hit.nonzero().squeeze(1), parents[node[hit]] + 1] = node[hit]
        tried = on_path[:, parents + 1] & (torch.arange(nodes) <= taken[:, parents + 1])
        final = verdict.accepted.gather(1, (verdict.num_accepted - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        final = torch.where(verdict.num_accepted > 0, final, torch.full_like(final, -1))
        stats.rounds += m
        stats.tried += int(tried.sum())
        stats.rejected += int(tried.sum() - verdict.num_accepted.sum())
        stats.corrections += int(has_children[final + 1].sum())
        stats.bonuses += int((~has_children[final + 1]).sum())
        stats.deep += int((verdict.num_accepted >= 3).sum())
    return out, stats


# ---------------------------------------------------------------------------------------------
# The statistic


def tv_threshold(exact: torch.Tensor, n: int, tables: int) -> float:
    """Total variation that n samples of the law `exact` exceed with probability at most
    FALSE_FAILURE / tables (module docstring: mean bound plus McDiarmid)."""
    p = exact.double().flatten()
    mean_bound = 0.5 * torch.sqrt(p * (1 - p) / n).sum().item()
    return mean_bound + math.sqrt(math.log(tables / FALSE_FAILURE) / (2 * n))


def pair_tvs(out: torch.Tensor, target: torch.Tensor) -> list[tuple[float, float]]:
    """(TV, threshold) of the law of (y_{j-1}, y_j) for each generated position j."""
    n, columns = out.shape
    marginal = torch.full((V,), 1.0 / V, dtype=torch.float64)  # y_0 is uniform
    results = []
    for j in range(1, columns):
        exact = marginal.unsqueeze(1) * target  # P(y_{j-1} = a, y_j = b)
        counts = torch.bincount(out[:, j - 1] * V + out[:, j], minlength=V * V).double()
        tv = 0.5 * (counts / n - exact.flatten()).abs().sum().item()
        results.append((tv, tv_threshold(exact, n, columns - 1)))
        marginal = marginal @ target
    return results


def worst(results: list[tuple[float, float]]) -> float:
    """The largest TV as a fraction of its threshold: a correct verifier stays below 1."""
    return max(tv / threshold for tv, threshold in results)


def describe(results: list[tuple[float, float]]) -> str:
    return "TV/threshold per position: " + ", ".join(f"{tv:.4f}/{threshold:.4f}" for tv, threshold in results)


# ---------------------------------------------------------------------------------------------
# Lossless sampling

SHAPES = [  # temperature, top_k, top_p
    (1.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.6, 3, 1.0),
    (0.7, 0, 0.8),
    (1.0, 4, 0.9),
]


def world(temperature: float, top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """What the verifier sees (probs_from_logits), the exact law (reference), and the proposals."""
    logits = target_logits()
    seen = shaped(logits, temperature, top_k, top_p)
    exact = reference_table(logits, temperature, top_k, top_p)
    return seen, exact, proposals(exact, seed=1)


# Chains are cheap and take every shape; each wide tree (about five times the nodes) takes two,
# so that the file stays fast on two cores.
CASES = [(name, shape) for name in ("chain-good", "chain-random") for shape in SHAPES] + [
    ("wide-mixed", SHAPES[0]),
    ("wide-mixed", SHAPES[2]),
    ("wide-iid", SHAPES[3]),
    ("wide-iid", SHAPES[4]),
    ("wide-point-mass", SHAPES[0]),
    ("wide-point-mass", SHAPES[1]),
    ("wide-point-mass-and-sampled", SHAPES[3]),
    ("wide-point-mass-and-sampled", SHAPES[4]),
]


@pytest.mark.parametrize(
    "tree_name,temperature,top_k,top_p", [(name, *shape) for name, shape in CASES], ids=[f"{name}-t{t}-k{k}-p{p}" for name, (t, k, p) in CASES]
)
def test_sampled_output_is_distributed_as_target(tree_name, temperature, top_k, top_p):
    tree = TREES[tree_name]
    seen, exact, tables = world(temperature, top_k, top_p)
    out, stats = simulate(seen, tables, tree, tree.depth + 1, torch.Generator().manual_seed(7))
    results = pair_tvs(out, exact)
    print(f"{tree_name} t={temperature} k={top_k} p={top_p}: worst {worst(results):.2f}; {stats}")
    assert worst(results) < 1.0, f"{describe(results)}; {stats}"
    # The paths this tree is about carry real mass: rejections and corrections every time,
    # acceptance at depth 3 and below wherever a good drafter leads.
    assert stats.rejected > 0.1 * stats.tried and stats.corrections > 0.1 * stats.rounds, stats
    if tree_name in ("chain-good", "wide-mixed", "wide-point-mass"):
        assert stats.deep > 0.05 * stats.rounds, stats


def test_check_detects_a_proposal_that_lies_about_its_distribution():
    """Negative control, at the threshold the tests above pass: sampled tokens claimed as point
    masses on themselves are always accepted, so the output follows the drafter."""
    seen, exact, tables = world(1.0, 0, 1.0)
    tree = chain("random", 2)
    lies = {"random": tables["random-top1"]}  # claims the argmax of its law; it drew elsewhere too
    out, stats = simulate(seen, tables, tree, tree.depth + 1, torch.Generator().manual_seed(9), claimed=lies)
    results = pair_tvs(out, exact)
    assert worst(results) > 2.0, describe(results)


# ---------------------------------------------------------------------------------------------
# Greedy


def argmax_chain(start: torch.Tensor, exact: torch.Tensor, length: int) -> torch.Tensor:
    chains = [start]
    for _ in range(length):
        chains.append(exact.argmax(dim=1)[chains[-1]])
    return torch.stack(chains, dim=1)


@pytest.mark.parametrize("mode", ["sampled", "constant-noise", "greedy"])
@pytest.mark.parametrize("tree_name", ["chain-good", "wide-mixed", "wide-point-mass", "wide-point-mass-and-sampled"])
def test_greedy_emits_exactly_the_target_argmax(tree_name, mode):
    """At temperature 0 the output is the target's argmax chain, token for token, whatever the
    proposals and noise: through verify_trees with random or constant noise and through
    verify_trees_greedy. The proposals here are built around the argmax, so deep acceptance happens."""
    logits = target_logits()
    seen = shaped(logits, 0.0, 0, 1.0)
    exact = reference_table(logits, 0.0, 0, 1.0)
    tables = proposals(reference_table(logits, 1.0, 0, 1.0), seed=1)
    tree = TREES[tree_name]
    # Exact equality needs no statistics, so fewer generations do.
    out, stats = simulate(seen, tables, tree, tree.depth + 1, torch.Generator().manual_seed(10), mode=mode, samples=20_000)
    expected = argmax_chain(out[:, 0], exact, tree.depth + 1)
    mismatched = (out != expected).any(dim=1)
    assert not mismatched.any(), (
        f"{int(mismatched.sum())} generations differ, e.g. {out[mismatched][:3].tolist()} != {expected[mismatched][:3].tolist()}"
    )
    assert stats.deep > 0.05 * stats.rounds and stats.rejected > 0.1 * stats.tried, stats


def random_trees(gen: torch.Generator, logits: torch.Tensor, k: int) -> TreeBatch:
    """Random ragged trees over logits [B, N + 1, V] (siblings below siblings, up to depth N) whose tokens often hit
    the argmax after their parent; proposals of k ids (the token first, ids may repeat), half of them point masses
    on the token, half uniform over the k."""
    batch, num_nodes = logits.shape[0], logits.shape[1] - 1
    argmax = logits.argmax(dim=-1)
    parents = torch.full((batch, num_nodes), -2, dtype=torch.long)
    tokens = torch.zeros(batch, num_nodes, dtype=torch.long)
    sizes = torch.randint(0, num_nodes + 1, (batch,), generator=gen)
    for i in range(num_nodes):
        # Mostly the previous node (deep chains), else any earlier node or the root (siblings).
        parent = torch.where(
            torch.rand(batch, generator=gen) < 0.6, torch.full((batch,), i - 1), (torch.rand(batch, generator=gen) * (i + 1)).long() - 1
        )
        parents[:, i] = torch.where(i < sizes, parent, torch.full_like(parent, -2))
        hit = torch.rand(batch, generator=gen) < 0.6
        wanted = argmax.gather(1, (parents[:, i] + 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        tokens[:, i] = torch.where(hit, wanted, torch.randint(0, V, (batch,), generator=gen))
    q_ids = torch.cat([tokens.unsqueeze(2), torch.randint(0, V, (batch, num_nodes, k - 1), generator=gen)], dim=2)
    sampled = torch.rand(batch, num_nodes, 1, generator=gen) < 0.5
    q_probs = torch.where(sampled, torch.full((batch, num_nodes, k), 1.0 / k), torch.tensor([1.0] + [0.0] * (k - 1)))
    return TreeBatch(tokens=tokens, parents=parents, valid=parents > -2, q_ids=q_ids, q_probs=q_probs)


def test_greedy_specialisation_gives_the_same_verdict():
    """verify_trees_greedy on argmax ids == the walk on the point masses, for random ragged trees with point-mass and
    sparse sampled proposals (obligation 5)."""
    gen = torch.Generator().manual_seed(5)
    batch, num_nodes = 2048, 12
    logits = torch.randn(batch, num_nodes + 1, V, generator=gen)
    trees = random_trees(gen, logits, k=3)
    argmax = logits.argmax(dim=-1)
    point_masses = torch.zeros(batch, num_nodes + 1, V).scatter_(2, argmax.unsqueeze(2), 1.0)
    general = verify_trees_batched(point_masses, trees, torch.rand(batch, num_nodes, generator=gen), torch.rand(batch, generator=gen))
    greedy = greedy_verdict(argmax, trees)
    assert torch.equal(general.accepted, greedy.accepted)
    assert torch.equal(general.num_accepted, greedy.num_accepted)
    assert torch.equal(general.next_token, greedy.next_token)
    assert (general.num_accepted >= 4).sum() > 50  # deep acceptance, not only rejections


def test_the_walk_per_session_gives_the_reference_verdict():
    """verify_trees == the reference walk vectorised over sessions, verdict for verdict, from the same draws
    (obligation 7): random ragged trees, sparse and point-mass proposals with repeated ids, sessions whose p is a
    softmax or a point mass on the argmax, and proposals that put all their mass on a point-mass p's token while
    drafting another (rejecting them empties the residual, which falls back to p)."""
    gen = torch.Generator().manual_seed(7)
    batch, num_nodes = 4096, 10
    logits = torch.randn(batch, num_nodes + 1, V, generator=gen) * 2
    trees = random_trees(gen, logits, k=3)
    argmax = logits.argmax(dim=-1)
    probs = logits.softmax(dim=-1)
    point_mass = torch.rand(batch, generator=gen) < 0.25
    probs[point_mass] = torch.zeros(int(point_mass.sum()), num_nodes + 1, V).scatter_(2, argmax[point_mass].unsqueeze(2), 1.0)
    # A node drafting another token than the argmax, with its proposal's whole mass on the argmax after its parent.
    covering = point_mass.unsqueeze(1) & (torch.rand(batch, num_nodes, generator=gen) < 0.3)
    wanted = argmax.gather(1, (trees.parents + 1).clamp(min=0))
    trees.tokens = torch.where(covering, (wanted + 1) % V, trees.tokens)
    trees.q_ids[:, :, 0] = torch.where(covering, trees.tokens, trees.q_ids[:, :, 0])
    trees.q_ids[:, :, 1] = torch.where(covering, wanted, trees.q_ids[:, :, 1])
    trees.q_probs = torch.where(covering.unsqueeze(2), torch.tensor([0.0, 1.0, 0.0]), trees.q_probs)
    uniforms, final = torch.rand(batch, num_nodes, generator=gen), torch.rand(batch, generator=gen)

    reference = verify_trees_batched(probs, trees, uniforms, final)
    walked = as_verdict(verify_trees(probs.to(DEVICE), *as_lists(trees, uniforms, final)), num_nodes)
    differ = (walked.accepted != reference.accepted).any(dim=1) | (walked.next_token != reference.next_token)
    assert not differ.any(), f"{int(differ.sum())} sessions differ, e.g. session {int(differ.nonzero()[0])}"
    # The paths that matter carry mass: deep acceptance, siblings tried after a rejection, emptied residuals.
    # A session that accepted nothing tried and rejected every child of the root.
    assert (reference.num_accepted >= 3).sum() > 100
    rejected_all = reference.num_accepted == 0
    assert (rejected_all & ((trees.parents == -1).sum(dim=1) >= 2)).sum() > 100
    assert (rejected_all & (covering & (trees.parents == -1)).any(dim=1)).sum() > 100


def test_a_batch_of_greedy_and_sampled_rows_shapes_each_as_it_asked():
    """Greedy rows beside sampled ones are point masses on their argmax, and the sampled rows their softmax, in one
    call (a sampled batch alone skips the point masses)."""
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    temperature = torch.tensor([0.0, 1.0, 0.5])
    probs = probs_from_logits(logits, temperature, torch.zeros(3, dtype=torch.long), torch.ones(3))
    assert torch.equal(probs[0], torch.zeros(V).scatter_(0, logits[0].argmax().unsqueeze(0), 1.0))
    torch.testing.assert_close(probs[1], logits[1].softmax(dim=0))
    torch.testing.assert_close(probs[2], (logits[2] / 0.5).softmax(dim=0))
    sampled = probs_from_logits(logits[1:], temperature[1:], torch.zeros(2, dtype=torch.long), torch.ones(2))
    torch.testing.assert_close(sampled, probs[1:])


def test_the_final_draw_never_emits_a_token_of_no_mass():
    """The inverse CDF at the ends of [0, 1): u = 0 and the largest float32 below 1 land on the first and the last token
    with mass, never on the tokens of none around them (a draw that took the first cumulative sum reaching u * sum(r)
    would take the token before the mass at u = 0)."""
    probs = torch.zeros(1, 1, V)
    probs[0, 0, 2], probs[0, 0, 4] = 0.25, 0.75
    below_one = float(torch.tensor([1.0]).nextafter(torch.tensor([0.0])))
    for u, token in [(0.0, 2), (0.2499, 2), (0.25, 4), (below_one, 4)]:
        assert verify_trees(probs.to(DEVICE), [[]], [[]], [[]], [[]], [u]) == [([], token)], u


def test_a_rejected_sibling_leaves_its_residual_for_the_next_and_the_final_draw():
    """Worked by hand: p = (0.5, 0.3, 0.2) after the root, siblings x = 0 and x = 1 with point-mass proposals. The first
    is accepted iff u < 0.5; rejected, r = (0, 0.6, 0.4), so the second is accepted iff u < 0.6; rejected too, r = (0,
    0, 1) and the final draw is token 2 whatever its u. Accepting a node moves on to p after it: (0, 0, 1) after node
    0, (0.1, 0.1, 0.8) after node 1."""
    probs = torch.zeros(1, 3, V)
    probs[0, 0, :3] = torch.tensor([0.5, 0.3, 0.2])
    probs[0, 1, 2] = 1.0
    probs[0, 2, :3] = torch.tensor([0.1, 0.1, 0.8])
    probs = probs.to(DEVICE)
    tree = ([[0, 1]], [[-1, -1]], [[([0], [1.0]), ([1], [1.0])]])
    assert verify_trees(probs, *tree, [[0.49, 0.0]], [0.0]) == [([0], 2)]
    assert verify_trees(probs, *tree, [[0.51, 0.59]], [0.05]) == [([1], 0)]
    assert verify_trees(probs, *tree, [[0.51, 0.59]], [0.15]) == [([1], 1)]
    assert verify_trees(probs, *tree, [[0.51, 0.61]], [0.0]) == [([], 2)]
    assert verify_trees(probs, *tree, [[0.51, 0.61]], [0.99]) == [([], 2)]


def test_verdict_shapes_and_accepted_path():
    """A chain the target fully accepts yields every node plus a bonus token."""
    target = reference_table(target_logits(), 0.0, 0, 1.0).float()
    path, prev = [], 0
    for _ in range(3):
        prev = int(target[prev].argmax())
        path.append(prev)
    target_probs = torch.stack([target[0]] + [target[t] for t in path]).unsqueeze(0)
    chain = ([path], [[-1, 0, 1]], [[([t], [1.0]) for t in path]])
    assert verify_trees(target_probs, *chain, torch.rand(1, 3).tolist(), [0.5]) == [([0, 1, 2], int(target[path[-1]].argmax()))]
