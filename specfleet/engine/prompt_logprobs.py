"""A prompt's log-probabilities (vLLM's `prompt_logprobs`, OpenAI's `echo` with `logprobs`), recorded as it is prefilled.

Position i's entry is token i's log-probability under the target's raw distribution given tokens 0..i-1, its rank
in that distribution (1: the most likely) and the `top` most likely tokens there; position 0 has none. The prefill
that computes positions 0..n-2 of the cache computes the logits they need, so a session that asks keeps its
prefill's logits instead of a second pass, and none of its positions come from the prefix cache (their logits were
never computed; vLLM skips the cache for such requests too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specfleet.engine.shaping import token_logprobs


@dataclass
class PromptLogprobs:
    top: int  # alternatives a position (the verifier allows up to its MAX_TOP_LOGPROBS)
    logprobs: list[float] = field(default_factory=list)  # tokens 1.. of the context, as far as recorded
    ranks: list[int] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)  # `top` a position, flat
    top_logprobs: list[float] = field(default_factory=list)

    def record(self, start: int, logits: torch.Tensor, successors: list[int]) -> None:
        """Rows [n, V] of the prefill of positions start..start+n-1, which predict `successors` (tokens start+1..):
        their entries replace whatever was recorded from position start + 1 on (a cache rebuilt from the start
        records again)."""
        kept = start  # entries for tokens 1..start
        if len(self.logprobs) < kept:
            raise RuntimeError(f"prompt logprobs recorded up to token {len(self.logprobs)}, prefill from position {start}")
        del self.logprobs[kept:], self.ranks[kept:]
        del self.top_token_ids[kept * self.top :], self.top_logprobs[kept * self.top :]
        logits = logits.float()
        chosen, top_token_ids, top_logprobs = token_logprobs(logits, successors, self.top)
        self.logprobs.extend(chosen)
        self.top_token_ids.extend(top_token_ids)
        self.top_logprobs.extend(top_logprobs)
        # A token's rank among the logits is its rank in the distribution: log-softmax keeps their order.
        picked = logits.gather(1, torch.tensor(successors, device=logits.device).unsqueeze(1))
        self.ranks.extend(((logits > picked).sum(dim=1) + 1).tolist())

    def complete(self, context_length: int) -> bool:
        """Whether every token of a context of this length past its first has its entry."""
        return len(self.logprobs) == max(0, context_length - 1)
