"""Sampled output through `specfleet serve` is distributed exactly as the target model's, end to end.

Four disagreeing drafters (a copy of the target, a perturbed copy, the model-free n-gram
drafter, a random model) fuse into token trees of depth 4: the copy, the perturbed copy and
the n-gram drafter share a drafter service and draft in lockstep, the random model drafts a
chain of its own on a second service, merged into the same tree; proposals are truncated to their 4 most likely tokens, so that even
the copy's drafts are often rejected and the residual draws carry real mass. Each request
samples 5 tokens; the router's per-request draft length is fixed at 4.

The statistic is exact for any number of tokens: for every sample and position j, with
p_j = p(. | prompt, x_<j) the target's shaped conditional (a plain `transformers`
forward pass; a logit bias and penalties, temperature, top-k and top-p written out here, not taken from specfleet),
tokens ranked by descending p_j and U uniform,
    u_j = P_j(token ranked before x_j) + U * p_j(x_j)
(the randomised probability integral transform). If the output is the target's, the u_j
are i.i.d. U(0, 1) (the chain rule makes them independent across positions too); the
density of u_j is the ratio (emitted law) / p_j laid out from the most to the least
likely token, so too-likely tokens pull u_j towards 0 and too-unlikely ones towards 1.
Each position's u_j, and all positions pooled, get a Kolmogorov-Smirnov test whose
threshold comes from the Dvoretzky-Kiefer-Wolfowitz-Massart bound
P(D_n > eps) <= 2 exp(-2 n eps^2), valid for every n: with every check of every
setting counted (Bonferroni), a correct system fails this file with probability at
most FALSE_FAILURE. A token with p_j = 0 is a failure outright. The statistic is blind
only to mass moved between tokens of nearly equal p_j (neighbours in the ranking); the
mutants in tests/mutants/lossless.yaml (wrong acceptance, wrong residual, a proposal
other than the one drawn from, p shaped without temperature, top-p or top-k) all move
mass between likely and unlikely tokens, and each is caught. The bias-and-penalties setting
uses negative penalties (the output's tokens made likelier), so that a row's p depends
strongly on the tree path above it: a verifier penalizing every row as the root's
(tests/mutants/sampling.yaml: tree-rows-ignore-their-paths) fails it at 1.6-2 times the threshold.
The guided setting (structured output: a regular expression of lowercase letters and spaces) gives the
tokens outside it p_j = 0 on both sides; a verifier that ignores the guide emits them.

Requests without a seed take the router's random seed; seeded ones (seeds 0..n-1, one a
sample) may take another lossless path (noise shared by drafters and verifier per seed
and position); both must pass. So must a target split over two ranks (`tensor_parallel_size: 2`).

Negative control, in the same test: the same statistic on a cluster started from a copy
of the tree in which the verifier accepts every draft unchecked on the path the case takes
(tests/mutants/lossless.yaml: `accept-every-draft` for rejection sampling,
`accept-every-fixed-draft` for the seeded race) must reject it at every setting.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass

import pytest
import torch

from specfleet.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.harness import NGRAM, Cluster, cluster_config, split_drafters, with_ngram
from tests.helpers import PROMPTS, load_target
from tests.mutation import mutated_copy

DRAFTERS = ["drafter-copy", "drafter-noisy", "drafter-random"]
PROPOSAL_TOP_K = 4
MAX_TOKENS = 5
DRAFT_TOKENS = 4
# Per setting and seed mode. Measured: a correct system's KS distances are 0.2-0.6 of the
# threshold; the control's pooled distance is 2.7-8 times it at SAMPLES, the weakest mutant's
# about 2.5. The control takes half as many (its threshold 1.4 times higher): enough to reject it.
SAMPLES = 2000
CONTROL_SAMPLES = 1000
BATCH = 500  # requests in flight at once (the router queues up to 1024)
# Prompts of different lengths and styles; sample i uses PROMPTS_USED[i % 4].
PROMPTS_USED = [PROMPTS[1], PROMPTS[0], PROMPTS[3], PROMPTS[5]]

# (temperature, top_p, top_k, min_p), by name.
SETTINGS = {
    "t0.7-top_p0.9": (0.7, 0.9, 0, 0.0),
    "t1.0": (1.0, 1.0, 0, 0.0),
    "t1.0-top_k8": (1.0, 1.0, 8, 0.0),
    "t1.0-min_p0.1-top_p0.95": (1.0, 0.95, 0, 0.1),
    "t1.0-bias-penalties-limits": (1.0, 1.0, 0, 0.0),
    "t1.0-guided": (1.0, 1.0, 0, 0.0),
}
# What a setting asks of the logits before temperature (GenerateRequest fields): a logit bias, allowed tokens, then
# penalties on the tokens each position's context holds and bad words (the last token of each where the output ends
# with the rest), which differ from row to row of a draft tree; or a guide.
GUIDE_CHARS = "[a-z ]"
GUIDE_REGEX = GUIDE_CHARS + "{60,}"
ADJUSTMENTS = {
    "t1.0-bias-penalties-limits": dict(
        logit_bias={5: 2.0, 17: -1.0},
        presence_penalty=-2.0,
        frequency_penalty=-2.0,
        repetition_penalty=0.5,
        allowed_token_ids=[t for t in range(384) if t % 3],  # the random family's vocabulary is 384 tokens
        bad_words=["the", "in", "of"],  # one and two tokens, first and after a space (`adjust`)
    ),
    # Structured output: lowercase letters and spaces, at least 60 characters (more than MAX_TOKENS tokens spell), so
    # that every position allows exactly the tokens spelt with those characters alone (`adjust`).
    "t1.0-guided": dict(guide=common_pb2.Guide(kind="regex", spec=GUIDE_REGEX)),
}
CASES = [(setting, seeded) for seeded in (False, True) for setting in SETTINGS]
# A target split over two ranks (tensor parallelism): one setting, without a seed and with one.
SPLIT_CASES = [False, True]

FALSE_FAILURE = 1e-6
# KS checks on the real cluster: each position and the pooled positions, per case.
CHECKS = (len(CASES) + len(SPLIT_CASES)) * (MAX_TOKENS + 1)
# Requests without a seed take rejection sampling (verify_trees), seeded ones the greedy walk on the
# seeded race's winners (verify_trees_greedy): each path has its own accept-every-draft mutant.
CONTROL_MUTANTS = {False: "accept-every-draft", True: "accept-every-fixed-draft"}
# The hard check calls a token impossible only if it is outside the top-k / top-p set even with
# this much slack, so that float rounding at the boundary (specfleet's forward pass is not
# transformers') cannot fail a correct system.
BOUNDARY_SLACK = 1e-4


def tolerance(n: int) -> float:
    """KS threshold for n values: exceeded under the null with probability <= FALSE_FAILURE / CHECKS."""
    return math.sqrt(math.log(2 * CHECKS / FALSE_FAILURE) / (2 * n))


def lossless_config(family) -> dict:
    """Two drafter services: the first hosts the copy, the perturbed copy and the model-free n-gram drafter
    (lockstep), the second the random model (a chain of its own, merged into the tree by the router)."""
    config = split_drafters(cluster_config(family, drafter_service={"proposal_top_k": PROPOSAL_TOP_K}), family, DRAFTERS[:2], DRAFTERS[2:])
    with_ngram(config, family)
    config["router"].update(
        default_drafter=DRAFTERS[0],
        fusion_width=len(DRAFTERS) + 1,
        fusion_below=1.01,  # every request fuses all four
        adaptive_speculation=False,  # k is what the request asks
    )
    return config


@pytest.fixture(scope="module")
def real_cluster(random_family, tmp_path_factory):
    cluster = Cluster(lossless_config(random_family), tmp_path_factory.mktemp("lossless"), "lossless").start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def split_cluster(random_family, tmp_path_factory):
    """The same cluster with its target split over two ranks (verifier.tensor_parallel_size 2, gloo)."""
    config = lossless_config(random_family)
    config["verifier"]["tensor_parallel_size"] = 2
    cluster = Cluster(config, tmp_path_factory.mktemp("split"), "split").start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def control_cluster(random_family, tmp_path_factory):
    """The same cluster from a tree whose verifier accepts every draft on the path a case takes;
    started on first use, so that a run already failing on the real cluster does not pay for it."""
    started: dict[bool, Cluster] = {}

    def get(seeded: bool) -> Cluster:
        if seeded not in started:
            workdir = tmp_path_factory.mktemp("control")
            tree = mutated_copy(workdir / "tree", CONTROL_MUTANTS[seeded])
            started[seeded] = Cluster(lossless_config(random_family), workdir, "control", cwd=tree).start()
        return started[seeded]

    yield get
    for cluster in started.values():
        cluster.stop()


@dataclass
class Samples:
    prompts: list[int]  # index into PROMPTS_USED, per sample
    tokens: list[list[int]]
    draft_tokens: int
    accepted_tokens: int
    rounds: int
    single_round: int  # requests whose whole output came from one round: 4 drafts accepted in a row
    two_rounds: int  # requests done in two rounds: 3 drafts accepted, 2 or 3 of them in a row
    seconds: float
    across: int = 0  # requests drafted for by both drafter services: trees merged across services
    model_free: int = 0  # requests the n-gram drafter proposed for


def sample(cluster: Cluster, setting: str, seeded: bool, samples: int = SAMPLES) -> Samples:
    temperature, top_p, top_k, min_p = SETTINGS[setting]
    requests = []
    for i in range(samples):
        request = generation_pb2.GenerateRequest(
            prompt=PROMPTS_USED[i % len(PROMPTS_USED)],
            max_tokens=MAX_TOKENS,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            stop_at_eos=False,
            speculation=generation_pb2.SpeculationOptions(max_draft_tokens=DRAFT_TOKENS),
            **ADJUSTMENTS.get(setting, {}),
        )
        if seeded:
            request.seed = i
        requests.append(request)
    out = Samples([], [], 0, 0, 0, 0, 0, 0.0)
    started = time.monotonic()
    with cluster.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for start in range(0, samples, BATCH):
            futures = [stub.Generate.future(r, timeout=600) for r in requests[start : start + BATCH]]
            for i, future in enumerate(futures, start):
                reply = future.result()
                assert len(reply.token_ids) == MAX_TOKENS, reply
                out.prompts.append(i % len(PROMPTS_USED))
                out.tokens.append(list(reply.token_ids))
                out.draft_tokens += reply.speculation.draft_tokens
                out.accepted_tokens += reply.speculation.accepted_tokens
                out.rounds += reply.speculation.rounds
                out.single_round += reply.speculation.rounds == 1
                out.two_rounds += reply.speculation.rounds == 2
                drafted_by = {d.drafter for d in reply.speculation.drafters if d.draft_tokens > 0}
                out.across += bool(drafted_by & set(DRAFTERS[:2])) and bool(drafted_by & set(DRAFTERS[2:]))
                out.model_free += NGRAM in drafted_by
    out.seconds = time.monotonic() - started
    return out


def shape(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, min_p: float, slack: float = 0.0) -> torch.Tensor:
    """The target's sampling distribution from logits [..., V]: temperature, then min-p (tokens at least min_p times
    the most likely one's probability), then top-k, then the smallest most-likely prefix whose mass reaches top_p.
    slack > 0 widens every cut (for the hard check)."""
    scaled = logits.double() / temperature
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    if min_p > 0:  # p_i >= min_p * p_max, as logits: the softmax's normaliser cancels
        keep &= ordered >= ordered[..., :1] + math.log(min_p) - slack
    if top_k > 0:
        if slack > 0:
            keep &= ordered >= ordered[..., top_k - 1 : top_k] - slack
        else:
            keep[..., top_k:] = False
    probs = ordered.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    if top_p < 1:
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= mass_before < top_p + slack
        keep[..., 0] = True
        probs = ordered.masked_fill(~keep, float("-inf")).softmax(dim=-1)
    return torch.zeros_like(probs).scatter_(-1, order, probs)


def adjust(logits: torch.Tensor, prompt_ids: list[int], x: torch.Tensor, asked: dict, tokenizer) -> torch.Tensor:
    """logits [m, J, V] after each sample's prompt and x_<j, as `asked` (ADJUSTMENTS) changes them, written out here:
    the bias added; then for each token the prompt or x_<j holds, a positive logit divided by the repetition penalty
    and a negative one multiplied by it; then frequency times the token's count in x_<j and presence once for each
    token x_<j holds subtracted; tokens outside allowed_token_ids, and each bad word's last token where x_<j ends with
    its other tokens (the word as the tokenizer writes it first and after a space), given none. A guide (GUIDE_REGEX)
    leaves the tokens whose text is lowercase letters and spaces."""
    if not asked:
        return logits
    logits = logits.double().clone()
    if "guide" in asked:
        spelt = [re.fullmatch(GUIDE_CHARS + "+", tokenizer.decode([t])) is not None for t in range(logits.shape[-1])]
        return logits.masked_fill(~torch.tensor(spelt), float("-inf"))
    for token, value in asked["logit_bias"].items():
        logits[..., token] += value
    vocab = logits.shape[-1]
    outside = torch.ones(vocab, dtype=torch.bool).index_fill_(0, torch.tensor(asked["allowed_token_ids"]), False)
    logits[..., outside] = float("-inf")
    words = [tokenizer.encode(text, add_special_tokens=False) for word in asked["bad_words"] for text in (word, " " + word)]
    for j in range(logits.shape[1]):
        counts = torch.zeros(len(x), vocab, dtype=torch.float64).scatter_add_(1, x[:, :j], torch.ones(len(x), j, dtype=torch.float64))
        seen = counts > 0
        seen[:, prompt_ids] = True
        row, penalty = logits[:, j], asked["repetition_penalty"]
        row = torch.where(seen, torch.where(row > 0, row / penalty, row * penalty), row)
        logits[:, j] = row - asked["frequency_penalty"] * counts - asked["presence_penalty"] * (counts > 0)
        for s, before in enumerate(x[:, :j].tolist()):
            for word in words:
                if len(word) - 1 <= j and before[j - len(word) + 1 :] == word[:-1]:
                    logits[s, j, word[-1]] = float("-inf")
    return logits


@dataclass
class Verdict:
    u: torch.Tensor  # [samples, MAX_TOKENS] PIT values
    impossible: list[tuple[int, int, int]]  # (sample, position, token) with p_j = 0

    def failures(self) -> list[str]:
        """Every check that rejects "distributed as the target", in words; empty if none does."""
        found = [f"sample {s} position {j}: token {t} has probability 0 under the target" for s, j, t in self.impossible[:5]]
        columns = [(f"position {j}", self.u[:, j]) for j in range(self.u.shape[1])] + [("pooled", self.u.flatten())]
        for name, u in columns:
            d, eps = ks_distance(u), tolerance(len(u))
            if d > eps:
                found.append(f"{name}: KS distance {d:.4f} > {eps:.4f} (mean u {u.mean():.3f})")
        return found

    def summary(self) -> str:
        columns = [self.u[:, j] for j in range(self.u.shape[1])] + [self.u.flatten()]
        ratios = " ".join(f"{ks_distance(u) / tolerance(len(u)):.2f}" for u in columns)
        return f"{ratios}; {len(self.impossible)} tokens of probability 0"


def ks_distance(u: torch.Tensor) -> float:
    """sup_t |F_n(t) - t|: the KS distance of the values u from U(0, 1)."""
    u = u.double().sort().values
    n = len(u)
    i = torch.arange(1, n + 1, dtype=torch.float64)
    return max(float((i / n - u).max()), float((u - (i - 1) / n).max()))


def exact_pit(family, samples: Samples, setting: str, seed: int) -> Verdict:
    """u_j for every sample and position, from one `transformers` forward pass per prompt."""
    temperature, top_p, top_k, min_p = SETTINGS[setting]
    model, tokenizer = load_target(str(family["target"]))
    noise = torch.Generator().manual_seed(seed)
    tokens = torch.tensor(samples.tokens)  # [S, J]
    u = torch.zeros(tokens.shape, dtype=torch.float64)
    impossible = []
    for index, prompt in enumerate(PROMPTS_USED):
        rows = torch.tensor([s for s, p in enumerate(samples.prompts) if p == index])
        if len(rows) == 0:
            continue
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        x = tokens[rows]  # [m, J]
        context = torch.cat([torch.tensor(prompt_ids).expand(len(rows), -1), x], dim=1)
        with torch.inference_mode():
            logits = model(context).logits[:, len(prompt_ids) - 1 : -1]  # [m, J, V]: p(. | prompt, x_<j)
        logits = adjust(logits, prompt_ids, x, ADJUSTMENTS.get(setting, {}), tokenizer)
        p = shape(logits, temperature, top_p, top_k, min_p)
        p_x = p.gather(-1, x.unsqueeze(-1))  # [m, J, 1]
        ids = torch.arange(p.shape[-1])
        # Ranked by descending probability, ties by token id.
        before = (p > p_x) | ((p == p_x) & (ids < x.unsqueeze(-1)))
        mass_before = (p * before).sum(dim=-1)
        u[rows] = mass_before + torch.rand(x.shape, generator=noise, dtype=torch.float64) * p_x.squeeze(-1)
        possible = shape(logits, temperature, top_p, top_k, min_p, slack=BOUNDARY_SLACK).gather(-1, x.unsqueeze(-1)).squeeze(-1) > 0
        for r, j in (~possible).nonzero().tolist():
            impossible.append((int(rows[r]), j, int(x[r, j])))
    return Verdict(u, impossible)


@pytest.mark.parametrize("setting,seeded", CASES, ids=[f"{'seeded' if s else 'unseeded'}-{name}" for name, s in CASES])
def test_sampled_output_is_distributed_as_target(real_cluster, control_cluster, random_family, setting, seeded):
    real = sample(real_cluster, setting, seeded)
    verdict = exact_pit(random_family, real, setting, seed=1)
    rejected = 1 - real.accepted_tokens / max(1, real.draft_tokens)
    print(
        f"\n{setting} seeded={seeded}: {SAMPLES} samples in {real.seconds:.1f}s; {real.draft_tokens} drafted, "
        f"{rejected:.0%} not accepted, {real.rounds} rounds, {real.single_round} in one round, {real.two_rounds} in two; "
        f"KS / threshold per position, pooled: {verdict.summary()}"
    )
    failures = verdict.failures()
    assert not failures, "\n".join(failures)
    # The setup exercises what it should: rejections and residual draws, and accepted paths deeper than 1.
    assert rejected > 0.5 and real.rounds > 2 * SAMPLES, (real.draft_tokens, real.accepted_tokens, real.rounds)
    assert real.single_round + real.two_rounds > 0.01 * SAMPLES, (real.single_round, real.two_rounds)
    assert real.across > 0.5 * SAMPLES, real.across
    assert real.model_free > 0.01 * SAMPLES, real.model_free  # it proposes where a suffix repeats: about 5% here

    control = sample(control_cluster(seeded), setting, seeded, CONTROL_SAMPLES)
    control_verdict = exact_pit(random_family, control, setting, seed=2)
    print(f"control ({CONTROL_MUTANTS[seeded]}): KS / threshold per position, pooled: {control_verdict.summary()}")
    assert control_verdict.failures(), f"the statistic accepts a verifier that accepts every draft: {control_verdict.summary()}"


@pytest.mark.parametrize("seeded", SPLIT_CASES, ids=["unseeded", "seeded"])
def test_a_split_targets_sampled_output_is_distributed_as_target(split_cluster, random_family, seeded):
    """Tensor parallelism (specfleet/engine/parallel.py) keeps sampling exact: the same statistic on a target
    split over two ranks, one setting each way (the negative control above shows the statistic's power)."""
    setting = "t0.7-top_p0.9"
    real = sample(split_cluster, setting, seeded, CONTROL_SAMPLES)
    verdict = exact_pit(random_family, real, setting, seed=3)
    print(f"\n{setting} seeded={seeded}, split over two ranks: KS / threshold per position, pooled: {verdict.summary()}")
    failures = verdict.failures()
    assert not failures, "\n".join(failures)
    assert real.draft_tokens > real.accepted_tokens > 0, (real.draft_tokens, real.accepted_tokens)
