"""What a request asks of sampling, and the random streams drafters and verifier share.

`SamplingParams` travels from the front door to the services; the tensor work that
shapes logits and draws from them (`specfleet/engine/sampling.py`) runs where the models
run. This module imports no torch, so the router, which only carries the parameters,
starts without it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Streams keep the drafter's and the verifier's draws independent of each other.
STREAM_VERIFY = 0
STREAM_DRAFT = 1
# The exponential race shared by drafters and verifier in drafter-invariant sessions.
STREAM_RACE = 2

# Temperatures below this sample greedily (see SamplingParams.greedy).
GREEDY_BELOW = 1e-5
# A logit bias is within [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range: -100 bans a token, 100 all but forces it).
MAX_LOGIT_BIAS = 100.0


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
        for token, bias in self.logit_bias:
            if not 0 <= token < vocab_size:
                return f"sampling.logit_bias has an id outside the vocabulary [0, {vocab_size}): {token}"
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                return f"sampling.logit_bias[{token}] must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, got {bias}"
        return None

    @property
    def raced(self) -> bool:
        """Sampled by the shared exponential race rather than by rejection sampling."""
        return self.drafter_invariant and not self.greedy

    @classmethod
    def from_proto(cls, msg) -> "SamplingParams":
        """From the contract's specfleet.v1.SamplingParams (validated by the caller)."""
        return cls(msg.temperature, msg.top_p, msg.top_k, msg.seed, msg.drafter_invariant, tuple(sorted(msg.logit_bias.items())))
