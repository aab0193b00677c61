"""The router's API in plain Python, whatever the transport: what a client asks, what it gets back, how a request fails.

router/frontdoor.py serves it; the gRPC servicer (router/grpc_api.py) and the
OpenAI-compatible HTTP API (router/openai_api.py) translate their wire formats
to and from these types and nothing else. Nothing here knows of protobuf,
gRPC or HTTP.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from specfleet.guides import Guide


@dataclass
class SpeculationOptions:
    disabled: bool = False  # decode with the target alone
    max_draft_tokens: int = 0  # per round at most; 0: the server's default


@dataclass
class GenerationParams:
    """One generation request, before validation (router.validation.validate checks every field)."""

    prompt: str = ""  # text to complete; or
    prompt_token_ids: list[int] = field(default_factory=list)  # exactly one of the two is set
    max_tokens: int | None = None  # None: the server's default (router.default_max_tokens), cut to fit the context
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # vLLM's: tokens below min_p times the most likely one's probability are never sampled; 0: off
    seed: int | None = None  # set: the seed alone fixes the output
    stop: list[str] = field(default_factory=list)
    stop_at_eos: bool = True
    speculation: SpeculationOptions = field(default_factory=SpeculationOptions)
    domain: str = ""  # the client's domain hint for expertise routing, or ""
    request_id: str = ""  # the client's label; "": the router makes one
    logprobs: bool = False  # each output token's log-probability under the target's raw distribution
    top_logprobs: int = 0  # and this many most likely alternatives (needs logprobs)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id: added to its logit at every position
    presence_penalty: float = 0.0  # OpenAI's, on the output's tokens; 0: none
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM's, on the prompt's and output's tokens; 1: none
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: the output ends after the first of these
    min_tokens: int = 0  # vLLM's: end of sequence and stop_token_ids held back until the output has this many
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's log-probability past the first, this many alternatives
    guide: Guide | None = None  # structured output: the JSON schema, regex, choice or grammar the output follows
    include_stop_str_in_output: bool = False  # vLLM's: the stop string that ended the output stays in its text
    skip_special_tokens: bool = True  # vLLM's: special tokens' text left out of the output's
    allowed_token_ids: list[int] = field(default_factory=list)  # vLLM's: only these are generated; []: all are
    bad_words: list[str] = field(default_factory=list)  # vLLM's: words never generated (at the start or after a space)
    # vLLM's: only the prompt's last this many tokens are read; -1: as many as fit beside max_tokens (or the server's
    # default). None: all of it.
    truncate_prompt_tokens: int | None = None
    priority: int = 0  # vLLM's: where router.priority_scheduling is on, lower is admitted first
    cache_salt: str | None = None  # vLLM's: the prompt shares cached KV only with requests of the same salt; None: with all unsalted
    add_special_tokens: bool = True  # a text prompt encoded with the tokenizer's special tokens (a BOS), as vLLM's completions


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass
class TokenLogprobs:
    """One token's log-probability, and the most likely tokens at its position (most likely first)."""

    token_id: int
    logprob: float
    top: list[TokenLogprob] = field(default_factory=list)
    rank: int = 0  # its rank in the distribution (1: the most likely); prompt tokens only, 0 for output tokens


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt's, those the verifier's prefix cache held (computed by an earlier request)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class DrafterStats:
    drafter: str
    rounds: int = 0  # rounds it drafted in
    draft_tokens: int = 0  # tokens it proposed (fused proposals count for each drafter that made them)
    accepted_tokens: int = 0


@dataclass
class SpeculationStats:
    """How a request was generated: rounds, drafts and where the time went (wall at the router, compute at the servers)."""

    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafters: list[DrafterStats] = field(default_factory=list)
    domain: str = ""  # the domain the router assigned the request
    # Draft and verify calls summed over rounds: wall as the router saw them, compute in the servers' passes,
    # queue the waits for the servers' model threads (in their batch queues before those passes, and for the share of a
    # pass that served calls which joined); wall - compute - queue is transport.
    draft_wall_ms: float = 0.0
    draft_compute_ms: float = 0.0
    verify_wall_ms: float = 0.0
    verify_compute_ms: float = 0.0
    draft_queue_ms: float = 0.0
    verify_queue_ms: float = 0.0
    router_ms: float = 0.0  # the router's own time: each round's wall less its longest draft and verify calls


@dataclass
class Delta:
    """New output since the previous event: text (held back while it may begin a stop string), tokens, and their
    log-probabilities when asked. A round that produced no new text still reports its tokens."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None  # when asked: in the first event, one per prompt token past the first


@dataclass
class Finished(Delta):
    """The last event of a request that ran to its end, with the last new output."""

    finish_reason: str = ""  # "length", "stop" (a stop string) or "eos" (the end-of-sequence token)
    usage: Usage = field(default_factory=lambda: Usage(0, 0))
    speculation: SpeculationStats = field(default_factory=SpeculationStats)


@dataclass
class Completion:
    """A finished request's whole output, as the unary APIs return it."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    speculation: SpeculationStats
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token id, when asked
    prompt_logprobs: list[TokenLogprobs] | None = None  # when asked: one per prompt token past the first


class ErrorKind(enum.Enum):
    """Why a request was refused or failed. API keys and model names are each transport's own checks
    (specfleet/security.py for gRPC, router/openai_api.py for HTTP): they have no kind here."""

    INVALID_ARGUMENT = "invalid_argument"  # the client's request is wrong; GenerationError.field names what
    OVERLOADED = "overloaded"  # the queue is full (router.max_queued): retry later
    SHUTTING_DOWN = "shutting_down"  # the server finishes the requests in flight and takes no new ones
    UNAVAILABLE = "unavailable"  # no verifier to run it on
    DEADLINE_EXCEEDED = "deadline_exceeded"  # the client's deadline passed; the output so far was streamed
    INTERNAL = "internal"  # a bug in the router


class GenerationError(Exception):
    """A request refused or failed: its kind, a message for the client and, for bad input, the field at fault
    (the message starts with it)."""

    def __init__(self, kind: ErrorKind, message: str, field: str | None = None):
        super().__init__(message)
        self.kind, self.message, self.field = kind, message, field

    def __repr__(self) -> str:
        return f"GenerationError({self.kind.name}, {self.message!r})"


def invalid(field: str, problem: str) -> GenerationError:
    """Bad input in `field`: the message is "field: problem"."""
    return GenerationError(ErrorKind.INVALID_ARGUMENT, f"{field}: {problem}", field)
