"""A verify call's sessions checked before any pass (verifier_service/server.py `VerifierCore.validated`): ids in the
model's vocabulary, trees whose parents precede their children, contexts within the model's positions, sampling the
contract allows. A ValueError names the session and the field."""

from __future__ import annotations

import math

from verifier_service.verifier import VerifyItem

# Alternatives per token at most (OpenAI's chat API allows 20).
MAX_TOP_LOGPROBS = 20
# Plain steps a session may ask for in one call at most.
MAX_PLAIN_STEPS = 64


def validate_item(item: VerifyItem, vocab_size: int, max_context: int) -> None:
    """Raise ValueError with a message naming the field for a malformed session."""
    n = len(item.tree_tokens)
    if len(item.tree_parents) != n or len(item.proposals) != n:
        raise ValueError(f"session {item.session_id}: tree.token_ids, tree.parents and tree.proposals must have equal lengths")
    for i, parent in enumerate(item.tree_parents):
        if not -1 <= parent < i:
            raise ValueError(f"session {item.session_id}: tree.parents[{i}] = {parent}; a parent must precede its child")
    for name, ids in [("new_token_ids", item.new_token_ids), ("tree.token_ids", item.tree_tokens)]:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"session {item.session_id}: {name} has ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    for i, (ids, probs) in enumerate(item.proposals):
        if not ids or len(ids) != len(probs) or any(not 0 <= t < vocab_size for t in ids) or not all(p >= 0 and math.isfinite(p) for p in probs):
            raise ValueError(f"session {item.session_id}: tree.proposals[{i}] must be a non-empty distribution over vocabulary ids")
    if item.prefix_length < 0:
        raise ValueError(f"session {item.session_id}: sync.prefix_length must be >= 0")
    if not 1 <= item.plain_steps <= MAX_PLAIN_STEPS:
        raise ValueError(f"session {item.session_id}: plain_steps must be between 1 and {MAX_PLAIN_STEPS}, got {item.plain_steps}")
    if not 0 <= item.lookup_tokens < MAX_PLAIN_STEPS:
        raise ValueError(f"session {item.session_id}: lookup_tokens must be between 0 and {MAX_PLAIN_STEPS - 1}, got {item.lookup_tokens}")
    if item.max_tokens < 0:
        raise ValueError(f"session {item.session_id}: max_tokens must be >= 0, got {item.max_tokens}")
    if item.prefix_length + len(item.new_token_ids) + n + item.plain_steps > max_context:
        what = "tree" if item.plain_steps == 1 else f"{item.plain_steps} passes" + (" and tree" if n else "")
        raise ValueError(f"session {item.session_id}: context plus {what} exceeds the model's {max_context} positions")
    if item.prefix_length == 0 and not item.new_token_ids:
        raise ValueError(f"session {item.session_id}: a new session needs at least one token")
    for name, top in [("top_logprobs", item.top_logprobs), ("prompt_top_logprobs", item.prompt_logprobs or 0)]:
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise ValueError(f"session {item.session_id}: {name} must be between 0 and {MAX_TOP_LOGPROBS}, got {top}")
    problem = item.sampling.problem(vocab_size)
    if problem:
        raise ValueError(f"session {item.session_id}: {problem}")
