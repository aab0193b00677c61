"""The model-free drafter: proposals from n-gram statistics of the request's own tokens.

Its proposals are `specfleet.engine.ngram`'s (shared with the verifier's lookup in plain passes):
the context's longest suffix that occurred before (prompt, output so far, its own drafts of this
call) proposes from what followed it, each token with the exact distribution it was drawn from.
When no suffix of at least `ngram_min` tokens occurred before, it proposes nothing: the session
stops drafting for this call (a shorter chain, as `stop_below_confidence` gives).

It needs no checkpoint: `path` names a directory with the target's tokenizer (the target's
own directory works), so that GetInfo reports the fingerprint and vocabulary the router
checks against the target's.
"""

from __future__ import annotations

import json
import pathlib
import zlib
from dataclasses import dataclass

from specfleet.engine.ngram import choose, next_token_counts
from specfleet.sampling import STREAM_DRAFT
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
