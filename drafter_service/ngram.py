"""The model-free drafter: proposals from n-gram statistics of the request's own tokens.

At each draft position it looks up the context's longest suffix, of `ngram_max` tokens down
to `ngram_min`, that occurred earlier in the same context (prompt, output so far, its own
drafts of this call), and proposes from the tokens that followed its `ngram_matches` most
recent earlier occurrences. Code, structured data and text that repeats its prompt continue
like this often, and a lookup costs a scan of the context, no forward pass.

Each proposal carries the exact distribution its token was drawn from, as a model drafter's
does (drafter.py): q(v) = count(v) / total over those occurrences' next tokens. Greedy
requests get a point mass on q's most frequent token (ties to the lowest id); sampled ones a
draw from q with the generator keyed by (seed, position, stream); drafter-invariant ones the
exponential race of q against the verifier's noise. So verification stays exact: it needs the q a
token was drawn from, not a q near the target's, so the request's temperature, top-k and top-p
shape only the target's side. When no
suffix of at least `ngram_min` tokens occurred before, it proposes nothing: the session
stops drafting for this call (a shorter chain, as `stop_below_confidence` gives).

It needs no checkpoint: `path` names a directory with the target's tokenizer (the target's
own directory works), so that GetInfo reports the fingerprint and vocabulary the router
checks against the target's.
"""

from __future__ import annotations

import collections
import json
import pathlib
import zlib
from dataclasses import dataclass

import torch

from specfleet.engine.sampling import generator_for, race, race_keys, race_noise, sample_sparse
from specfleet.sampling import STREAM_DRAFT, SamplingParams
from specfleet.tokenizer import load_tokenizer, tokenizer_fingerprint


@dataclass
class NgramSource:
    """What an n-gram drafter reports of itself (a `LoadedModel`'s fields that GetInfo and the service read)."""

    name: str
    path: str
    fingerprint: str
    vocab_size: int
    eos_token_id: int
    # No model of positions: it reads any context (GetInfo's field is an int32).
    max_context: int = 2**31 - 1

    def info(self):
        from specfleet.v1 import common_pb2

        return common_pb2.ModelInfo(
            name=self.name,
            path=self.path,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            eos_token_id=self.eos_token_id,
            tokenizer_fingerprint=self.fingerprint,
            parameters=0,
            device="cpu",
            dtype="none",
            attention="none",
        )


def load_source(name: str, path: str) -> NgramSource:
    """The tokenizer of `path`; the vocabulary size is config.json's where it has one (the target's may exceed its tokenizer's)."""
    directory = pathlib.Path(path)
    tokenizer = load_tokenizer(directory)
    vocab_size = len(tokenizer.get_vocab())
    if (directory / "config.json").exists():
        vocab_size = max(vocab_size, int(json.loads((directory / "config.json").read_text()).get("vocab_size", 0)))
    eos = tokenizer.eos_token_id
    return NgramSource(name, str(directory), tokenizer_fingerprint(tokenizer), vocab_size, int(eos) if eos is not None else -1)


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


class NgramModel:
    """A drafter service's n-gram drafter: a `DraftModel`'s interface (its sessions hold token ids, never a cache)."""

    def __init__(self, source: NgramSource, store, ngram_max: int, ngram_min: int, matches: int):
        self.loaded = source
        self.store = store
        self.ngram_max, self.ngram_min, self.matches = ngram_max, ngram_min, matches
        self.stream = STREAM_DRAFT + zlib.crc32(source.name.encode())
        self.stack = None
        self.member = 0

    @property
    def passes_with(self) -> object:
        return self

    def propose(self, drafting: list, step: int) -> None:
        """Each session's next token, proposal and confidence (`drafter.Drafting`s); a session without a match gets none.

        Confidence: count(token) / (total + 1), the rule of succession's estimate that the
        context continues as before: one earlier occurrence gives 1/2, never certainty."""
        for d in drafting:
            ids, counts = next_token_counts(d.session.token_ids, self.ngram_max, self.ngram_min, self.matches)
            if not ids:
                continue
            token, proposal = choose(ids, counts, d.item.sampling, d.committed + step, self.stream)
            d.result.token_ids.append(token)
            d.result.proposals.append(proposal)
            d.result.confidences.append(counts[ids.index(token)] / (sum(counts) + 1))
