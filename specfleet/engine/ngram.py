"""N-gram proposals from a context's own tokens: the model-free drafter's (drafter_service/ngram.py) and the
verifier's lookup in plain passes (verifier_service/verifier.py `Verifier._looked_up`).

At each position the context's longest suffix, of `ngram_max` tokens down to `ngram_min`, that occurred earlier
in the same context proposes from the tokens that followed its `matches` most recent earlier occurrences. Code,
structured data and text that repeats its prompt continue like this often, and a lookup costs a scan of the
context, no forward pass.

Each proposal carries the exact distribution its token was drawn from: q(v) = count(v) / total over those
occurrences' next tokens. Greedy requests get a point mass on q's most frequent token (ties to the lowest id);
sampled ones a draw from q with the generator keyed by (seed, position, stream); drafter-invariant ones the
exponential race of q against the verifier's noise. So verification stays exact: it needs the q a token was drawn
from, not a q near the target's (verifier_service/verification.py, obligations 1, 3 and 6).
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import torch

from specfleet.engine.sampling import generator_for, race, race_keys, race_noise, sample_sparse
from specfleet.sampling import SamplingParams


def next_token_counts(tokens: list[int], ngram_max: int, ngram_min: int, matches: int) -> tuple[list[int], list[int]]:
    """(ids in increasing order, counts) of the tokens that followed the `matches` most recent earlier
    occurrences of the longest suffix of `tokens` (ngram_max down to ngram_min tokens); ([], []) if none occurred.

    In plain list operations: `list.index` finds the earlier occurrences of the last token (a scan in C), and only
    those are compared further. Tensor operations over the context (windows, comparisons, nonzero) cost tens of
    microseconds of dispatch a lookup whatever the context's length, and a drafting call looks up once a position
    and session (docs/benchmarks/ngram.md)."""
    length = len(tokens)
    longest = min(ngram_max, length - 1)
    if longest < ngram_min:
        return [], []
    last = tokens[-1]
    ends, j = [], -1  # where the last token occurred before: the ends of the candidate windows, in order
    try:
        while True:
            j = tokens.index(last, j + 1, length - 1)
            ends.append(j)
    except ValueError:
        pass
    for n in range(longest, ngram_min - 1, -1):
        suffix = tokens[length - n :]
        found = [e for e in ends if e >= n - 1 and tokens[e - n + 1 : e + 1] == suffix]
        if found:
            counts = collections.Counter(tokens[e + 1] for e in found[-matches:])
            ids = sorted(counts)
            return ids, [counts[i] for i in ids]
    return [], []


def choose(ids: list[int], counts: list[int], sampling: SamplingParams, position: int, stream: int) -> tuple[int, tuple[list[int], list[float]]]:
    """The drafted token and the distribution it was drawn from: a point mass for greedy requests, else q = counts / total."""
    if sampling.greedy:
        # The first of the most frequent: ids are increasing, so ties go to the lowest id.
        token = ids[max(range(len(ids)), key=lambda i: (counts[i], -i))]
        return token, ([token], [1.0])
    ids_t = torch.tensor([ids], dtype=torch.long)
    q = torch.tensor([counts], dtype=torch.float32)
    q = q / q.sum()
    if sampling.raced:
        keys = race_keys([sampling.seed], [position])
        token = ids[int(race(q, race_noise(keys, ids_t))[0])]
    else:
        token = int(sample_sparse(ids_t, q, [generator_for(sampling.seed, position, stream)])[0])
    return token, (ids, q[0].tolist())


def lookup_chain(
    tokens: list[int],
    most: int,
    sampling: SamplingParams,
    stream: int,
    ngram_max: int,
    ngram_min: int,
    matches: int,
    worth: Callable[[float, bool], bool] = lambda confidence, first: True,
    first: tuple[list[int], list[int]] | None = None,
) -> tuple[list[int], list[tuple[list[int], list[float]]], list[float]]:
    """A chain of up to `most` tokens continuing `tokens`, each looked up in the context extended by the chain so
    far and drawn by `choose` for the position it would fill: (tokens, the distribution each was drawn from, each
    position's confidence: its most frequent continuation's count / (total + 1), the rule of succession's estimate
    that the context continues as it did, which a greedy draw's token has). It ends where no suffix of at least
    `ngram_min` tokens occurred before, or where `worth(confidence, whether it is the chain's first position)` turns
    a position down. That is asked before the draw, of what the chain so far fixes: were it asked of the drawn
    token, the chain would keep some tokens of q more often than q draws them, and its proposals would not carry the
    distribution their tokens came from (verification.py, obligation 1). Any prefix of a chain is one this function
    draws with a smaller `most`. `first`: `next_token_counts` of `tokens` where the caller has it already."""
    context = list(tokens)
    chain, proposals, confidences = [], [], []
    for _ in range(most):
        ids, counts = first if first is not None and not chain else next_token_counts(context, ngram_max, ngram_min, matches)
        if not ids:
            break
        confidence = max(counts) / (sum(counts) + 1)
        if not worth(confidence, not chain):
            break
        token, proposal = choose(ids, counts, sampling, len(context), stream)
        chain.append(token)
        proposals.append(proposal)
        confidences.append(confidence)
        context.append(token)
    return chain, proposals, confidences
