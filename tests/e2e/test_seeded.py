"""A client's seed fixes the output: the same tokens whatever was drafted, by whom, alongside what.

Seeded sampled requests take the drafter-invariant path (verification.py,
obligation 6): every token is the winner of an exponential race keyed by
(seed, position), drafters race their own distributions against the same
noise, and a draft is accepted iff it equals the target's winner.
"""

from __future__ import annotations

import concurrent.futures
import math

import pytest
import torch

from specfleet.engine.sampling import race, race_keys, race_noise
from specfleet.v1 import generation_pb2, generation_pb2_grpc
from tests.harness import NGRAM, Cluster, cluster_config, split_drafters, with_ngram
from tests.helpers import PROMPTS
from verifier_service.verification import verify_trees_greedy

V = 6  # vocabulary of the Markov stand-in for target and drafters
LENGTH = 3


def markov_table(seed: int, zero_below: float = 0.0) -> torch.Tensor:
    """[V, V] next-token distributions; entries below `zero_below` are cut (as top-p would)."""
    probs = (torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 1.5).softmax(dim=1)
    probs = torch.where(probs < zero_below, torch.zeros_like(probs), probs)
    return probs / probs.sum(dim=1, keepdim=True)


def raced_tokens(table: torch.Tensor, seeds: list[int], prev: torch.Tensor, position: int) -> torch.Tensor:
    """[S] each seed's race winner over table[prev] at this position."""
    keys = race_keys(seeds, [position] * len(seeds))
    return race(table[prev], race_noise(keys, torch.arange(V)))


def generate(target: torch.Tensor, drafter: torch.Tensor | None, depth: int, seeds: list[int]) -> tuple[torch.Tensor, int, int]:
    """[S, LENGTH] tokens after token 0 at position 0, by rounds of a raced draft chain of `depth`
    verified by the greedy walk on the target's race winners; also (drafted, accepted) counts."""
    samples = len(seeds)
    out = torch.full((samples, LENGTH), -1, dtype=torch.long)
    produced = torch.zeros(samples, dtype=torch.long)
    last = torch.zeros(samples, dtype=torch.long)
    drafted = accepted_total = 0
    rows = torch.arange(samples)
    while (produced < LENGTH).any():
        start = int(produced.min())  # sessions advance at different speeds: group by progress
        group = (produced == start).nonzero().flatten()
        group_seeds = [seeds[i] for i in group.tolist()]
        n = depth if drafter is not None else 0
        chain, prev = [], last[group]
        for level in range(n):  # the drafter races q for position start + 1 + level
            prev = raced_tokens(drafter, group_seeds, prev, start + 1 + level)
            chain.append(prev)
        contexts = [last[group]] + chain
        wanted = torch.stack([raced_tokens(target, group_seeds, c, start + 1 + j) for j, c in enumerate(contexts)], 1)
        tokens = torch.stack(chain, 1) if n else torch.zeros(len(group), 0, dtype=torch.long)
        verdicts = verify_trees_greedy(wanted.tolist(), tokens.tolist(), [list(range(-1, n - 1))] * len(group))
        num_accepted = torch.tensor([len(path) for path, _ in verdicts], dtype=torch.long)
        next_token = torch.tensor([token for _, token in verdicts], dtype=torch.long)
        drafted += n * len(group)
        accepted_total += int(num_accepted.sum())
        for j in range(n + 1):
            token = torch.where(num_accepted == j, next_token, tokens[:, min(j, n - 1)] if n else next_token)
            take = (num_accepted >= j) & (produced[group] < LENGTH)
            idx = group[take]
            out[rows[idx], produced[idx]] = token[take]
            last[idx] = token[take]
            produced[idx] += 1
    return out, drafted, accepted_total


def test_raced_tokens_are_distributed_as_the_target_and_do_not_depend_on_the_drafts():
    target = markov_table(1, zero_below=0.05)
    seeds = list(range(60_000))
    alone, _, _ = generate(target, None, 0, seeds)
    # Exact law of the first LENGTH tokens: V^3 = 216 outcomes. With n samples, E[TV] <= 0.5 sqrt(216 / n)
    # = 0.030, and TV exceeds its mean by t with probability <= exp(-2 n t^2) (McDiarmid): t = 0.011
    # for 1e-3. Noise that is not fresh per position, or a biased race, shifts TV by far more.
    exact = target[0][:, None, None] * target[:, :, None] * target[None, :, :]
    counts = torch.zeros(V, V, V)
    counts.index_put_(tuple(alone.T), torch.ones(len(seeds)), accumulate=True)
    tv = 0.5 * (counts / len(seeds) - exact).abs().sum().item()
    assert tv < 0.5 * math.sqrt(V**3 / len(seeds)) + math.sqrt(math.log(1e3) / (2 * len(seeds))), tv
    for kind, drafter, depth in [("close", 0.8 * target + 0.2 / V, 3), ("unrelated", markov_table(2), 2), ("copy", target, 4)]:
        speculated, drafted, accepted = generate(target, drafter, depth, seeds[:5000])
        assert torch.equal(speculated, alone[:5000]), kind
        assert drafted > 0 and (accepted > 0 or kind == "unrelated")
        if kind == "copy":
            assert accepted == drafted  # the same race over the same distribution always agrees


def race_acceptance(p: torch.Tensor, q: torch.Tensor, draws: int = 200_000) -> float:
    keys = race_keys(list(range(draws)), [0] * draws)
    noise = race_noise(keys, torch.arange(len(p)))
    return float((race(p.expand(draws, -1), noise) == race(q.expand(draws, -1), noise)).float().mean())


def test_race_acceptance_is_within_the_coupling_bound():
    """A raced draft is accepted with probability between (1 - TV) / (1 + TV) and rejection sampling's 1 - TV."""
    for seed in range(4):
        p, q = markov_table(10 + seed)[0], markov_table(20 + seed)[0]
        tv = 0.5 * float((p - q).abs().sum())
        rate = race_acceptance(p, q)
        assert (1 - tv) / (1 + tv) - 0.01 <= rate <= 1 - tv + 0.01, (rate, tv)


# --- through `specfleet serve` ---------------------------------------------------------------------------------

DRAFTERS = ["drafter-noisy", "drafter-random", "drafter-copy"]
SEEDS = range(16)
# The last one repeats itself, so that the n-gram drafter proposes.
SEEDED_PROMPTS = [PROMPTS[0], PROMPTS[1], PROMPTS[2], "a b c d a b c d a b c"]
MAX_TOKENS = 24


def fleet_config(family, **router) -> dict:
    """Several drafters on two services, the n-gram drafter among them, expertise routing, every request's tree
    fused from all four (in lockstep and across the services; fusion_below above any acceptance, adaptive
    speculation off, so that every round fuses whatever the router learns)."""
    config = with_ngram(split_drafters(cluster_config(family), family, DRAFTERS[:2], DRAFTERS[2:]), family)
    fused = {"fusion_width": 4, "fusion_below": 1.01, "adaptive_speculation": False}
    config["router"].update({"default_drafter": "drafter-noisy", "routing_policy": "expertise", **fused, **router})
    return config


def seeded_request(prompt: str, seed: int, disabled: bool = False) -> generation_pb2.GenerateRequest:
    shapes = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9), dict(temperature=0.9, top_k=5)]
    request = generation_pb2.GenerateRequest(prompt=prompt, max_tokens=MAX_TOKENS, seed=seed, stop_at_eos=False, **shapes[seed % len(shapes)])
    request.speculation.disabled = disabled
    return request


def run_seeded(cluster: Cluster, disabled: bool = False, load: bool = True) -> tuple[dict, int, list[set[str]]]:
    """Every (prompt, seed) request at once, among unseeded sampled traffic; returns tokens by key, accepted drafts
    and the drafters that drafted for each request."""
    keys = [(p, s) for p in SEEDED_PROMPTS for s in SEEDS]
    noise = [generation_pb2.GenerateRequest(prompt=p, max_tokens=40, temperature=0.8) for p in PROMPTS[6:14]] if load else []
    with cluster.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            busy = [pool.submit(stub.Generate, r, timeout=600) for r in noise]
            futures = {key: pool.submit(stub.Generate, seeded_request(*key, disabled=disabled), timeout=600) for key in keys}
            replies = {key: f.result() for key, f in futures.items()}
            for f in busy:
                f.result()
    drafted = [{d.drafter for d in r.speculation.drafters if d.draft_tokens > 0} for r in replies.values()]
    return {key: list(r.token_ids) for key, r in replies.items()}, sum(r.speculation.accepted_tokens for r in replies.values()), drafted


@pytest.fixture(scope="module")
def fleet(random_family, tmp_path_factory):
    cluster = Cluster(fleet_config(random_family), tmp_path_factory.mktemp("seeded"), "seeded").start()
    yield cluster
    cluster.stop()


def test_seeded_output_is_the_same_with_or_without_drafts_under_load_and_routing(fleet, random_family, tmp_path):
    plain, accepted, _ = run_seeded(fleet, disabled=True, load=False)
    assert accepted == 0
    assert len({tuple(t) for t in plain.values()}) == len(plain), "different seeds should give different outputs"
    for attempt in range(2):  # among other traffic, with what the router learned in between
        speculated, accepted, drafted = run_seeded(fleet)
        mismatched = [key for key in plain if speculated[key] != plain[key]]
        assert not mismatched, f"attempt {attempt}: {len(mismatched)} of {len(plain)} differ, e.g. {mismatched[:3]}"
        assert accepted > 0, "no draft was accepted, so drafting was not exercised"
        # Trees of several drafters, across the services, the n-gram drafter among them.
        assert any(set(DRAFTERS[:2]) & d and DRAFTERS[2] in d for d in drafted), drafted
        assert any(NGRAM in d for d in drafted), drafted
    other = Cluster(fleet_config(random_family, routing_policy="random", fusion_width=1), tmp_path, "random-routing").start()
    try:
        rerouted, accepted, _ = run_seeded(other)
    finally:
        other.stop()
    assert accepted > 0
    assert rerouted == plain
