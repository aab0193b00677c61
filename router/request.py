"""A generation request inside the router: its validated parameters, its progress, its output text."""

from __future__ import annotations

import asyncio
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field

from specfleet.sampling import SamplingParams
from specfleet.v1 import generation_pb2

MAX_STOP_STRINGS = 16
MAX_LABEL_CHARS = 128
MAX_TOP_LOGPROBS = 20


class InvalidRequest(ValueError):
    """A request the router refuses; the message names the field."""


@dataclass
class Limits:
    default_max_tokens: int
    max_tokens_limit: int
    num_draft_tokens: int
    max_draft_tokens: int
    vocab_size: int
    max_context: int
    # Longer prompts (in characters) cannot fit the context: refused before tokenizing (`prompt_chars_bound`).
    max_prompt_chars: int = 1 << 62


def prompt_chars_bound(tokenizer, max_context: int) -> int:
    """Characters beyond which a prompt holds more than max_context tokens, whatever it says.

    A token covers at most as many bytes as its vocabulary string's UTF-8 form (byte-level
    and byte-fallback spellings only overstate it) and a character is at least a byte.
    Normalisation can shrink text before tokenizing (NFKC folds a 3-byte full-width letter
    into one byte), hence the margin of 4: a false refusal needs a prompt that is mostly
    text the tokenizer drops."""
    longest = max(len(token.encode()) for token in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) if token)
    return 4 * max_context * max(1, longest)


@dataclass
class RequestSpec:
    request_id: str  # the client's label, echoed back; never used to address anything
    session_id: str  # made here, unguessable: the request's sessions at the verifier and drafters
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: list[str]
    stop_at_eos: bool
    max_draft_tokens: int  # per round at most; 0 disables speculation
    domain: str  # the client's domain hint, or ""
    logprobs: bool = False  # return each output token's log-probability (the target's raw distribution)
    top_logprobs: int = 0  # and this many alternatives each


def parse_request(req: generation_pb2.GenerateRequest, tokenizer, limits: Limits) -> RequestSpec:
    for name, value, longest in (("request_id", req.request_id, MAX_LABEL_CHARS), ("domain", req.domain, MAX_LABEL_CHARS)):
        # Labels end up in logs and metrics: no control characters (a newline would forge a log line).
        if len(value) > longest or not value.isprintable():
            raise InvalidRequest(f"{name}: at most {longest} printable characters, got {len(value)} characters")
    if req.prompt and req.prompt_token_ids:
        raise InvalidRequest("prompt: set either prompt or prompt_token_ids, not both")
    if req.prompt_token_ids:
        prompt_ids = list(req.prompt_token_ids)
        bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt_token_ids: ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}")
    else:
        if not req.prompt:
            raise InvalidRequest("prompt: must not be empty (or set prompt_token_ids)")
        if len(req.prompt) > limits.max_prompt_chars:
            raise InvalidRequest(
                f"prompt: {len(req.prompt)} characters cannot fit the model's context of {limits.max_context} tokens; shorten it"
            )
        prompt_ids = tokenizer.encode(req.prompt, add_special_tokens=False)
        if not prompt_ids:
            raise InvalidRequest("prompt: encodes to no tokens")
    if len(prompt_ids) >= limits.max_context:
        raise InvalidRequest(
            f"prompt: {len(prompt_ids)} tokens leaves no room in the model's context of {limits.max_context} tokens; shorten it"
        )

    max_tokens = req.max_tokens if req.HasField("max_tokens") else limits.default_max_tokens
    if not 1 <= max_tokens <= limits.max_tokens_limit:
        raise InvalidRequest(f"max_tokens: must be between 1 and {limits.max_tokens_limit}, got {max_tokens}")
    room = limits.max_context - len(prompt_ids)
    if max_tokens > room:
        if req.HasField("max_tokens"):
            # Generation would stop at the context's end with less than was asked: say so now.
            raise InvalidRequest(
                f"max_tokens: {max_tokens} new tokens after a prompt of {len(prompt_ids)} exceed the model's context of "
                f"{limits.max_context} tokens; ask for at most {room}"
            )
        max_tokens = room  # the server's default, not the client's request: fit it to the context
    if not math.isfinite(req.temperature) or req.temperature < 0:
        raise InvalidRequest(f"temperature: must be >= 0 (0 is greedy), got {req.temperature}")
    top_p = req.top_p if req.HasField("top_p") else 1.0
    if not (0 < top_p <= 1):
        raise InvalidRequest(f"top_p: must be in (0, 1], got {top_p}")
    if req.top_k < 0:
        raise InvalidRequest(f"top_k: must be >= 0 (0 disables it), got {req.top_k}")
    if len(req.stop) > MAX_STOP_STRINGS or any(not s for s in req.stop):
        raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} non-empty strings")
    spec_opts = req.speculation
    if not 0 <= spec_opts.max_draft_tokens <= limits.max_draft_tokens:
        raise InvalidRequest(f"speculation.max_draft_tokens: must be between 0 and {limits.max_draft_tokens}, got {spec_opts.max_draft_tokens}")
    if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"top_logprobs: must be between 0 and {MAX_TOP_LOGPROBS}, got {req.top_logprobs}")
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs: needs logprobs set")
    max_draft_tokens = 0 if spec_opts.disabled else (spec_opts.max_draft_tokens or limits.num_draft_tokens)

    # A client's seed must fix the output whatever is drafted, batched or learned: such a request
    # samples by the seeded exponential race (verification.py, obligation 6). Without one,
    # rejection sampling accepts more drafts.
    seeded = req.HasField("seed")
    seed = req.seed if seeded else secrets.randbits(63)
    return RequestSpec(
        request_id=req.request_id or uuid.uuid4().hex,
        session_id=secrets.token_hex(16),
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=req.temperature, top_p=top_p, top_k=req.top_k, seed=seed, drafter_invariant=seeded),
        stop=list(req.stop),
        stop_at_eos=req.stop_at_eos if req.HasField("stop_at_eos") else True,
        max_draft_tokens=max_draft_tokens,
        domain=req.domain,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
    )


class SessionMirror:
    """What one server holds of a session, so that only the difference travels."""

    def __init__(self) -> None:
        self.held: list[int] = []

    def diff(self, tokens: list[int]) -> tuple[int, list[int]]:
        """(prefix_length, new_token_ids) that turn what the server holds into `tokens`."""
        common = 0
        limit = min(len(self.held), len(tokens))
        while common < limit and self.held[common] == tokens[common]:
            common += 1
        if common == 0:
            return 0, list(tokens)
        return common, tokens[common:]

    def reset(self) -> None:
        self.held = []


@dataclass
class DrafterCounts:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class Chunk:
    """One streamed update; `final` carries the finish reason and is the last."""

    text: str
    token_ids: list[int]
    final: bool = False
    logprobs: list = field(default_factory=list)  # generation_pb2.TokenLogprobs per token id, when asked


@dataclass
class RequestState:
    spec: RequestSpec
    tokenizer: object
    eos_token_id: int
    max_context: int
    deadline: float | None  # time.monotonic() by which the client wants an answer
    tokens: list[int] = field(default_factory=list)  # prompt followed by output
    verifier_mirror: SessionMirror = field(default_factory=SessionMirror)
    # Every verifier replica that was sent this request's sessions (released on all of them at the end:
    # a replica that only stalled still holds them).
    verifier_replicas: set[str] = field(default_factory=set)
    # Since when it has had no verifier replica (its call failed, or none was live), with no call succeeding since (router/verifiers.py).
    verifier_lost_at: float | None = None
    drafter_mirrors: dict[str, SessionMirror] = field(default_factory=dict)
    finish_reason: str = ""
    error: tuple | None = None  # (grpc.StatusCode, message) when it failed
    cancelled: bool = False
    published_final: bool = False
    routing: object = None  # router.routing.RequestRouting
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    per_drafter: dict[str, DrafterCounts] = field(default_factory=dict)
    timing_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("draft_wall", "draft_compute", "verify_wall", "verify_compute"), 0.0))
    logprobs: list = field(default_factory=list)  # generation_pb2.TokenLogprobs per output token, when asked
    text: str = ""  # output text so far (stop strings removed)
    sent_text: int = 0  # characters of text already streamed
    sent_tokens: int = 0
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    admitted_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = list(self.spec.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.spec.prompt_ids) :]

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason) or self.error is not None or self.cancelled

    def remaining(self) -> int:
        """Tokens this request may still produce: max_tokens, and the model's context, bound it."""
        return min(self.spec.max_tokens - len(self.output_ids), self.max_context - len(self.tokens))

    def commit(self, new_tokens: list[int], logprobs: list | None = None) -> None:
        """Append verified tokens (with their TokenLogprobs, when asked), stopping at max_tokens, end of sequence or a stop string."""
        new_tokens = new_tokens[: self.remaining()]
        self.logprobs.extend((logprobs or [])[: len(new_tokens)])
        if self.spec.stop_at_eos and self.eos_token_id in new_tokens:
            new_tokens = new_tokens[: new_tokens.index(self.eos_token_id) + 1]
            self.finish_reason = "eos"
        start = len(self.tokens)
        self.tokens.extend(new_tokens)
        if not self.finish_reason and self.remaining() <= 0:
            self.finish_reason = "length"
        self.text = self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
        if self.spec.stop:
            self._apply_stop(start)
        del self.logprobs[len(self.output_ids) :]  # what the end of sequence or a stop string cut

    def _apply_stop(self, start: int) -> None:
        search_from = max(0, self.sent_text - max(len(s) for s in self.spec.stop))
        hits = [i for i in (self.text.find(s, search_from) for s in self.spec.stop) if i >= 0]
        if not hits:
            return
        cut = min(hits)
        self.text = self.text[:cut]
        # Keep the tokens up to the one that completed the stop string.
        prompt_len = len(self.spec.prompt_ids)
        for end in range(max(start, prompt_len) + 1, len(self.tokens) + 1):
            decoded = self.tokenizer.decode(self.tokens[prompt_len:end], skip_special_tokens=True)
            if any(s in decoded for s in self.spec.stop):
                del self.tokens[end:]
                break
        self.finish_reason = "stop"

    def take_chunk(self) -> Chunk | None:
        """The text and tokens not yet streamed; None when there is nothing new to say."""
        text = self.text
        if not self.finished:
            # Hold back an incomplete UTF-8 character and anything that may begin a stop string.
            hold = len(text)
            while hold > self.sent_text and text[hold - 1] == "\ufffd":
                hold -= 1
            for s in self.spec.stop:
                for n in range(min(len(s) - 1, hold - self.sent_text), 0, -1):
                    if text[hold - n : hold] == s[:n]:
                        hold -= n
                        break
            text = text[:hold]
        new_text = text[self.sent_text :]
        new_ids = self.output_ids[self.sent_tokens :]
        if not new_text and not new_ids and not self.finished:
            return None
        logprobs = self.logprobs[self.sent_tokens : self.sent_tokens + len(new_ids)]
        self.sent_text += len(new_text)
        self.sent_tokens += len(new_ids)
        return Chunk(text=new_text, token_ids=new_ids, final=self.finished, logprobs=logprobs)

    def stats(self) -> generation_pb2.SpeculationStats:
        drafters = [
            generation_pb2.DrafterStats(drafter=name, rounds=c.rounds, draft_tokens=c.draft_tokens, accepted_tokens=c.accepted_tokens)
            for name, c in sorted(self.per_drafter.items())
        ]
        return generation_pb2.SpeculationStats(
            rounds=self.rounds,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            drafters=drafters,
            domain=self.routing.domain if self.routing else "",
            draft_wall_ms=self.timing_ms["draft_wall"],
            draft_compute_ms=self.timing_ms["draft_compute"],
            verify_wall_ms=self.timing_ms["verify_wall"],
            verify_compute_ms=self.timing_ms["verify_compute"],
        )

    def usage(self) -> generation_pb2.Usage:
        return generation_pb2.Usage(prompt_tokens=len(self.spec.prompt_ids), completion_tokens=len(self.output_ids))
