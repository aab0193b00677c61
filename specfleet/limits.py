"""What one Verify or Draft call may carry: sessions and tokens.

The verifier and drafter services refuse a larger call before any forward pass
(RESOURCE_EXHAUSTED over gRPC: the call is well formed but over this server's
size limit, as a message over gRPC's own size limit is); the router splits its
calls so that none is larger (router/drafting.py, router/verifying.py). A call's tokens are its
sessions' contexts after the call (the tokens kept, the new ones, the tree or
drafts): what its forward pass computes over and what its KV caches hold, so
a call's KV is at most max_call_tokens times the model's KV bytes per token.
"""

from __future__ import annotations

from dataclasses import dataclass


class CallTooLarge(ValueError):
    """A call over a service's per-call limits: RESOURCE_EXHAUSTED over gRPC."""


# The tokens a call carries at most when the config leaves max_call_tokens at 0 (the router splits
# its calls there, or at one session of the full context where that is more): 1 GB of the demo
# target's KV.
DEFAULT_CALL_TOKENS = 32768


def call_tokens(configured: int, full_call: int) -> int:
    """The router's token limit for a service's calls: `configured`, or with 0 the larger of
    DEFAULT_CALL_TOKENS and `full_call` (what the longest request needs in one call)."""
    return configured or max(DEFAULT_CALL_TOKENS, full_call)


def drafter_limits(sessions: int, tokens: int, section: str) -> "CallLimits":
    """What a drafter service refuses: its configured limits; with max_call_tokens 0, calls over sessions alone
    (what a call needs depends on the router's fusion width, which the service does not know)."""
    return CallLimits(sessions, tokens or CallLimits.tokens, section)


@dataclass
class CallLimits:
    sessions: int = 1 << 30
    tokens: int = 1 << 62
    section: str = ""  # the config section that sets them, for messages: verifier, drafters[NAME]


def verify_tokens(session) -> int:
    """A VerifySession's context after the call: prefix kept, new tokens, tree nodes."""
    return max(0, session.sync.prefix_length) + len(session.sync.new_token_ids) + len(session.tree.token_ids)


def draft_tokens(session) -> int:
    """A DraftSession's context after the call: prefix kept, new tokens, drafts."""
    return max(0, session.sync.prefix_length) + len(session.sync.new_token_ids) + max(0, session.num_draft_tokens)


def check_sessions(count: int, limits: CallLimits) -> None:
    """Raise CallTooLarge when a call has more sessions than `limits` allow."""
    if count > limits.sessions:
        raise CallTooLarge(f"{count} sessions in one call; this server takes at most {limits.sessions} ({limits.section}.max_call_sessions)")


def check_tokens(total: int, limits: CallLimits) -> None:
    """Raise CallTooLarge when a call's sessions hold more context tokens than `limits` allow."""
    if total > limits.tokens:
        raise CallTooLarge(f"{total} context tokens in one call; this server takes at most {limits.tokens} ({limits.section}.max_call_tokens)")


def split(units: list[list], tokens_of, limits: CallLimits) -> list[list]:
    """Pack units (lists of sessions that must travel in one call) into as few calls within `limits` as
    order allows. A unit larger than the limits on its own gets a call of its own (and its refusal)."""
    calls: list[list] = []
    current: list = []
    sessions = tokens = 0
    for unit in units:
        n, t = len(unit), sum(tokens_of(entry) for entry in unit)
        if current and (sessions + n > limits.sessions or tokens + t > limits.tokens):
            calls.append(current)
            current, sessions, tokens = [], 0, 0
        current.extend(unit)
        sessions += n
        tokens += t
    if current:
        calls.append(current)
    return calls
