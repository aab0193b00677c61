"""What a request asks of sampling, and the random streams drafters and verifier share.

`SamplingParams` travels from the front door to the services; the tensor work that
shapes logits and draws from them (`specfleet/engine/sampling.py`) runs where the models
run. This module imports no torch, so the router, which only carries the parameters,
starts without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specfleet.guides import Guide

# Streams keep the drafter's and the verifier's draws independent of each other.
STREAM_VERIFY = 0
STREAM_DRAFT = 1
# The exponential race shared by drafters and verifier in drafter-invariant sessions.
STREAM_RACE = 2

# Temperatures below this sample greedily (see SamplingParams.greedy).
GREEDY_BELOW = 1e-5
# A logit bias is within [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range: -100 bans a token, 100 all but forces it).
MAX_LOGIT_BIAS = 100.0
# Presence and frequency penalties are within [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range), a repetition penalty in
# (0, MAX_REPETITION_PENALTY].
MAX_PENALTY = 2.0
MAX_REPETITION_PENALTY = 10.0


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    # The seed alone fixes the output: every token is the winner of the exponential race
    # keyed by (seed, position), whatever was drafted (verification.py, obligation 6).
    drafter_invariant: bool = False
    # (token id, bias) pairs in id order, added to the logits before temperature, top-k and top-p at every
    # position, on both sides: the target's p and a drafter's q are those of the biased logits.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Penalties on the tokens a row's context holds, after the bias, on both sides alike (vLLM's order and meaning):
    # the repetition penalty divides a positive logit by its value and multiplies a negative one, for each token of
    # the prompt or output; frequency subtracts its value times the token's count in the output, presence its value
    # once for each token the output holds.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Where the request's output starts in its sessions' tokens (its prompt's length): where presence and frequency
    # start counting, and min_tokens.
    output_start: int = 0
    # Rows filling a position before output_start + min_tokens give the `held_back` tokens (end of sequence and the
    # request's stop tokens) probability 0, on both sides: the output cannot end before min_tokens tokens.
    min_tokens: int = 0
    held_back: tuple[int, ...] = ()
    # Structured output (specfleet/guides.py): every row allows only the tokens the guide's grammar allows after the
    # output (from output_start) and the row's path, on both sides, after the penalties and min_tokens.
    guide: Guide | None = None
    # vLLM's min_p: after temperature and before top-k and top-p, a token below min_p times the most likely token's
    # probability gets probability 0, on both sides. 0: off.
    min_p: float = 0.0
    # vLLM's allowed_token_ids: every other token gets probability 0 at every row, on both sides. (): all allowed.
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words as token sequences: at a row whose output so far (from output_start) and path end with all but
    # a sequence's last token, that last token gets probability 0, on both sides (a one-token sequence at every row);
    # except at a row where that would leave no token at all.
    bad_words: tuple[tuple[int, ...], ...] = ()

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32 and softmax gives NaN; the
        # distribution is a point mass on the argmax for any practical purpose (as vLLM does).
        return self.temperature < GREEDY_BELOW

    def problem(self, vocab_size: int) -> str | None:
        """What makes these parameters unusable, naming the field, or None. NaN fails every check."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            return f"sampling.temperature must be a finite number >= 0, got {self.temperature}"
        if not 0 < self.top_p <= 1:
            return f"sampling.top_p must be in (0, 1], got {self.top_p}"
        if self.top_k < 0:
            return f"sampling.top_k must be >= 0, got {self.top_k}"
        if not 0 <= self.min_p <= 1:
            return f"sampling.min_p must be in [0, 1], got {self.min_p}"
        for token, bias in self.logit_bias:
            if not 0 <= token < vocab_size:
                return f"sampling.logit_bias has an id outside the vocabulary [0, {vocab_size}): {token}"
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                return f"sampling.logit_bias[{token}] must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, got {bias}"
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                return f"sampling.{name} must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g}, got {getattr(self, name)}"
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            return f"sampling.repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}"
        if self.output_start < 0:
            return f"sampling.output_start must be >= 0, got {self.output_start}"
        if self.min_tokens < 0:
            return f"sampling.min_tokens must be >= 0, got {self.min_tokens}"
        if any(not 0 <= token < vocab_size for token in self.held_back):
            return f"sampling.held_back has ids outside the vocabulary [0, {vocab_size})"
        if any(not 0 <= token < vocab_size for token in self.allowed_token_ids):
            return f"sampling.allowed_token_ids has ids outside the vocabulary [0, {vocab_size})"
        if any(not word or any(not 0 <= token < vocab_size for token in word) for word in self.bad_words):
            return f"sampling.bad_words has an empty sequence or ids outside the vocabulary [0, {vocab_size})"
        if self.guide is not None:
            problem = self.guide.problem()
            if problem:
                return f"sampling.guide: {problem}"
            if any(not 0 <= token < vocab_size for token in self.guide.thought_tokens):
                return f"sampling.guide: a thought's tokens outside the vocabulary [0, {vocab_size})"
        return None

    @property
    def penalized(self) -> bool:
        """Some penalty changes the logits: each row's depends on the tokens before it."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def reads_context(self) -> bool:
        """Each row's distribution depends on the tokens before it (penalties, a guide, bad words) or on its position
        (min_tokens)."""
        return self.penalized or (self.min_tokens > 0 and bool(self.held_back)) or self.guide is not None or bool(self.bad_words)

    @property
    def raced(self) -> bool:
        """Sampled by the shared exponential race rather than by rejection sampling."""
        return self.drafter_invariant and not self.greedy

    @classmethod
    def from_proto(cls, msg) -> "SamplingParams":
        """From the contract's specfleet.v1.SamplingParams (validated by the caller)."""
        return cls(
            msg.temperature,
            msg.top_p,
            msg.top_k,
            msg.seed,
            msg.drafter_invariant,
            tuple(sorted(msg.logit_bias.items())),
            msg.presence_penalty,
            msg.frequency_penalty,
            msg.repetition_penalty or 1.0,  # unset on the wire: none
            msg.output_start,
            msg.min_tokens,
            tuple(msg.held_back),
            Guide.from_proto(msg.guide) if msg.HasField("guide") else None,
            msg.min_p,
            tuple(msg.allowed_token_ids),
            tuple(tuple(word.token_ids) for word in msg.bad_words),
        )
