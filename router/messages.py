"""What a Draft or Verify call carries and what comes back, as plain records: the router's side of the contract.

The router builds and reads these; its transports (router/transport.py, router/ray_transport.py)
turn them into proto/specfleet/v1 messages and the replies back into them, so protobuf stays at
that edge; a service in the router's process takes them as they are (specfleet/colocated.py).
Records and fields are named as the contract's messages are (drafter.proto,
verifier.proto, common.proto), with one difference: a session's status is `known` (the server
still held it), not an enum.

One thing stays in the transport's form: a proposal, the distribution a draft token was drawn
from. It comes from a drafter's reply and goes to the verifier untouched; the router only asks
how many tokens it has (`len(proposal.token_ids)`). Decoding it into lists and encoding it again
would cost every round about ten times what passing it on does (2.8 ms against 0.27 ms for 256
proposals of 16 tokens here).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specfleet.sampling import SamplingParams


@dataclass
class SessionSync:
    """Keep prefix_length tokens of the session, append new_token_ids (the session mirror's diff)."""

    session_id: str
    prefix_length: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    cache_salt: str = ""  # the request's (vLLM's): read where prefix_length = 0, by the session's first block's hash

    @classmethod
    def of(cls, session_id: str, diff: tuple[int, list[int]], cache_salt: str) -> SessionSync:
        """A mirror's diff (SessionMirror.diff) as a sync; the salt travels only where the server starts the session
        afresh (prefix 0), the one place it reads it."""
        prefix, new = diff
        return cls(session_id, prefix, new, cache_salt if prefix == 0 else "")


@dataclass
class DraftSession:
    sync: SessionSync
    model: str
    num_draft_tokens: int
    sampling: SamplingParams
    stop_below_confidence: float = 0.0
    score_context: bool = False  # also score the context it prefills (its mean log-probability)
    lockstep_group: str = ""  # sessions of one group draft in lockstep; "" for a chain


@dataclass
class DraftedSession:
    known: bool  # False: the drafter had lost the session and drafted nothing
    prefilling: bool = False  # still prefilling its context in chunks: it proposed nothing, and is not scored
    token_ids: list[int] = field(default_factory=list)
    proposals: list = field(default_factory=list)  # in the transport's form (above), one per token
    confidences: list[float] = field(default_factory=list)
    context_log_prob: float = 0.0
    context_tokens: int = 0


@dataclass
class DraftResponse:
    sessions: list[DraftedSession]  # in the order of the call's sessions
    compute_ms: float
    queue_ms: float = 0.0  # the call's wait in the drafter's batch queue before its pass


@dataclass
class TokenTree:
    """Node order: every parent before its children; parent -1 is the context's last token."""

    token_ids: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    proposals: list = field(default_factory=list)  # as a drafter's reply carried them


@dataclass
class VerifySession:
    sync: SessionSync
    tree: TokenTree
    sampling: SamplingParams
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False  # the context's log-probabilities, answered once (verifier.proto)
    prompt_top_logprobs: int = 0
    plain_steps: int = 1  # with an empty tree: tokens to decode plainly in this call, one pass each at most
    lookup_tokens: int = 0  # tokens each plain pass may draft by n-gram lookup at the verifier (0: none)
    max_tokens: int = 0  # tokens the call may emit beyond the tree's accepted ones (0: its passes bound them)


@dataclass
class PromptLogprobs:
    """A context's log-probabilities, one entry per token past its first (verifier.proto's PromptLogprobs)."""

    logprobs: list[float]
    ranks: list[int]
    top_token_ids: list[int]  # top a token, flat
    top_logprobs: list[float]


@dataclass
class VerifiedSession:
    known: bool  # False: the verifier had lost the session; nothing was verified
    prefilling: bool = False  # True: its new tokens are being prefilled in chunks; nothing was verified
    accepted_nodes: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # the accepted tokens and the target's next one
    logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)  # top_logprobs a token, flat
    top_logprobs: list[float] = field(default_factory=list)
    lookup_proposed: int = 0  # tokens the verifier's lookup drafted in the call's plain passes
    lookup_accepted: int = 0  # of which the target accepted
    prompt_logprobs: PromptLogprobs | None = None  # when the session asked for them, once
    cached_tokens: int = 0  # of its prompt, the tokens the verifier's prefix cache held


@dataclass
class VerifyResponse:
    sessions: list[VerifiedSession]  # in the order of the call's sessions
    compute_ms: float
    batch_size: int  # sessions whose work compute_ms less shared_ms is: the call's batch; a call that joined a pass, its own
    queue_ms: float = 0.0  # the call's wait for the verifier's model thread before its first pass
    passes: int = 1  # forward passes the batch ran (more than one where sessions decoded plain steps)
    shared_ms: float = 0.0  # of compute_ms, what went to other calls' sessions in passes shared with them
