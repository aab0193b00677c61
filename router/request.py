"""A generation request inside the router: its validated parameters, its progress, its output text.

router/frontdoor.py validates a client's request into a RequestSpec and follows its RequestState."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from specfleet.config import RequestLimitsConfig
from specfleet.sampling import SamplingParams


@dataclass
class Limits:
    # The router's request-limits section (default_max_tokens, max_tokens_limit, num_draft_tokens,
    # max_draft_tokens), taken whole; the rest is the target's.
    requests: RequestLimitsConfig
    vocab_size: int
    max_context: int
    # Longer prompts (in characters) cannot fit the context: refused before tokenizing (`prompt_chars_bound`).
    max_prompt_chars: int = 1 << 62
    # The target's end-of-sequence token: what `min_tokens` holds back besides a request's stop_token_ids.
    eos_token_id: int = -1


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
    stop_token_ids: list[int] = field(default_factory=list)  # output ends after the first of these (it is kept)
    min_tokens: int = 0  # stop strings are looked for once the output holds this many tokens (vLLM's min_tokens)
    prompt_logprobs: int | None = None  # the prompt's log-probabilities with this many alternatives (None: not asked)
    include_stop_str_in_output: bool = False  # the stop string that ended the output stays in its text
    skip_special_tokens: bool = True  # special tokens' text left out of the output's
    priority: int = 0  # admitted before requests of a higher one (router.priority_scheduling)
    cache_salt: str = ""  # its sessions share cached KV blocks only with those of the same salt


class SessionMirror:
    """What one server holds of a session, so that only the difference travels."""

    def __init__(self) -> None:
        self.held: list[int] = []
        # Of `held`, how many the server may still be prefilling (its last answer: prefilling, a long prompt in
        # chunks): the next call may prefill as many, and its deadline allows for them (`prefill_tokens`).
        self.unfilled = 0

    def prefill_tokens(self, new_token_ids: list[int]) -> int:
        """The most positions a call sending `new_token_ids` may have the server prefill: those and what it is still
        prefilling of what it holds."""
        return len(new_token_ids) + self.unfilled

    def diff(self, tokens: list[int]) -> tuple[int, list[int]]:
        """(prefix_length, new_token_ids) that turn what the server holds into `tokens`."""
        limit = min(len(self.held), len(tokens))
        # Usually the server holds a prefix of the tokens: one comparison in C, not a loop in Python over the context.
        common = limit if self.held[:limit] == tokens[:limit] else 0
        while common < limit and self.held[common] == tokens[common]:
            common += 1
        if common == 0:
            return 0, list(tokens)
        return common, tokens[common:]

    def reset(self) -> None:
        self.held = []
        self.unfilled = 0


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
    logprobs: list = field(default_factory=list)  # the verifier's log-probabilities per token id, when asked (router/verifying.py)
    prompt_logprobs: list | None = None  # in the first chunk after they came, when asked (router.api.TokenLogprobs)


def partial_tail(text: str, mark: str) -> int:
    """How many characters at the end of `text` could begin `mark`: held back from a stream until the next text
    decides (a stop string here; a tool call's or a thought's tag in router/tool_parsers.py, router/reasoning.py)."""
    return next((n for n in range(min(len(mark) - 1, len(text)), 0, -1) if mark.startswith(text[-n:])), 0)


# Tokens decoded before the new ones when detokenizing incrementally (RequestState._detokenize).
DETOKENIZE_CONTEXT = 4

TIMINGS = ("draft_wall", "draft_compute", "draft_queue", "verify_wall", "verify_compute", "verify_queue", "router")


@dataclass
class RequestState:
    spec: RequestSpec
    tokenizer: object
    eos_token_id: int
    max_context: int
    deadline: float | None  # time.monotonic() by which the client wants an answer
    # Who sent it: the transport's connection (one gRPC channel's calls share it, as do an HTTP call's prompts and
    # choices), else the call that submitted it. Admission takes turns between clients.
    client: str = ""
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
    # Until this many rounds, the plan takes the request to be hopeless, as it last found it (router/planning.py).
    hopeless_until: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    per_drafter: dict[str, DrafterCounts] = field(default_factory=dict)
    # Where its rounds' time went, summed over rounds (router/api.py, SpeculationStats, says what each is).
    timing_ms: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIMINGS, 0.0))
    logprobs: list = field(default_factory=list)  # the verifier's log-probabilities per output token, when asked
    prompt_logprobs: list | None = None  # the prompt's (router.api.TokenLogprobs), once the verifier answered them
    cached_tokens: int = 0  # of the prompt, the tokens the verifier's prefix cache held (its answers' most)
    sent_prompt_logprobs: bool = False
    text: str = ""  # output text so far (stop strings removed)
    sent_text: int = 0  # characters of text already streamed
    sent_tokens: int = 0
    decoded: str = ""  # text of tokens[:decoded_to], whose last character is complete
    decoded_to: int = 0  # index into tokens (0: set to the prompt's end on creation)
    updates: asyncio.Queue = field(default_factory=asyncio.Queue)
    admitted_at: float = field(default_factory=time.monotonic)
    scheduled_at: float | None = None  # when it left the queue for its first round

    def __post_init__(self) -> None:
        self.tokens = list(self.spec.prompt_ids)
        self.decoded_to = len(self.tokens)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.spec.prompt_ids) :]

    @property
    def finished(self) -> bool:
        return bool(self.finish_reason) or self.error is not None or self.cancelled

    def remaining(self) -> int:
        """Tokens this request may still produce: max_tokens, and the model's context, bound it."""
        return min(self.spec.max_tokens - len(self.output_ids), self.max_context - len(self.tokens))

    def lacking(self, drafter: str) -> int:
        """Tokens the drafter's session lacks beyond the last committed one, which a draft call feeds it before it
        drafts: the whole context where it never drafted for this request, every token committed since it last did."""
        mirror = self.drafter_mirrors.get(drafter)
        return max(0, len(mirror.diff(self.tokens)[1] if mirror is not None else self.tokens) - 1)

    def commit(self, new_tokens: list[int], logprobs: list | None = None) -> None:
        """Append verified tokens (with their TokenLogprobs, when asked), stopping at max_tokens, end of sequence or a stop
        string. The token that ends the output (end of sequence, a stop token) is kept in its ids and, as vLLM does, left
        out of its text unless include_stop_str_in_output asks for it."""
        new_tokens = new_tokens[: self.remaining()]
        self.logprobs.extend((logprobs or [])[: len(new_tokens)])
        if self.spec.stop_at_eos and self.eos_token_id in new_tokens:
            new_tokens = new_tokens[: new_tokens.index(self.eos_token_id) + 1]
            self.finish_reason = "eos"
        stops = [i for i, t in enumerate(new_tokens) if t in self.spec.stop_token_ids]
        if stops:
            new_tokens = new_tokens[: stops[0] + 1]
            self.finish_reason = "stop"
        ended_by_token = bool(self.finish_reason) and not self.spec.include_stop_str_in_output
        start = len(self.tokens)
        self.tokens.extend(new_tokens)
        if not self.finish_reason and self.remaining() <= 0:
            self.finish_reason = "length"
        self._detokenize(len(self.tokens) - ended_by_token)
        if self.spec.stop and len(self.output_ids) >= self.spec.min_tokens:
            self._apply_stop(start)
        del self.logprobs[len(self.output_ids) :]  # what the end of sequence or a stop string cut

    def _detokenize(self, end: int) -> None:
        """self.text: the output up to tokens[end] decoded, as decoding all of it would give, at a cost that does not
        grow with the output. The new tokens are decoded after a few tokens of context and the context's own text is
        cut off the front (a token's leading space, say, decodes by what precedes it); text stays pending until its
        last character is complete."""
        prompt_len = len(self.spec.prompt_ids)
        start = max(prompt_len, self.decoded_to - DETOKENIZE_CONTEXT)
        skip = self.spec.skip_special_tokens
        context = self.tokenizer.decode(self.tokens[start : self.decoded_to], skip_special_tokens=skip)
        window = self.tokenizer.decode(self.tokens[start:end], skip_special_tokens=skip)
        if window.startswith(context):
            self.text = self.decoded + window[len(context) :]
        else:  # a decoder that rewrites text before the new tokens: decode the whole output
            self.text = self.tokenizer.decode(self.tokens[prompt_len:end], skip_special_tokens=skip)
        if not self.text.endswith("\ufffd"):
            self.decoded, self.decoded_to = self.text, end

    def _apply_stop(self, start: int) -> None:
        search_from = max(0, self.sent_text - max(len(s) for s in self.spec.stop))
        # A stop string counts where it ends past the text of the output's first min_tokens tokens (vLLM's order).
        skip = self.spec.skip_special_tokens
        floor = len(self.tokenizer.decode(self.output_ids[: self.spec.min_tokens], skip_special_tokens=skip)) if self.spec.min_tokens else 0
        hits = [(i, i + len(s)) for s in self.spec.stop for i in [self.text.find(s, max(search_from, floor - len(s) + 1))] if i >= 0]
        if not hits:
            return
        start_at, end_at = min(hits)  # the stop string found first (the shorter where two start at one place)
        self.text = self.text[: end_at if self.spec.include_stop_str_in_output else start_at]
        # Keep the tokens up to the one that completed the stop string.
        prompt_len = len(self.spec.prompt_ids)
        for end in range(max(start, prompt_len + self.spec.min_tokens) + 1, len(self.tokens) + 1):
            decoded = self.tokenizer.decode(self.tokens[prompt_len:end], skip_special_tokens=skip)
            if any(decoded.find(s, max(0, floor - len(s) + 1)) >= 0 for s in self.spec.stop):
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
                hold -= partial_tail(text[self.sent_text : hold], s)
            text = text[:hold]
        new_text = text[self.sent_text :]
        new_ids = self.output_ids[self.sent_tokens :]
        if not new_text and not new_ids and not self.finished:
            return None
        logprobs = self.logprobs[self.sent_tokens : self.sent_tokens + len(new_ids)]
        self.sent_text += len(new_text)
        self.sent_tokens += len(new_ids)
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self.sent_prompt_logprobs:
            prompt_logprobs, self.sent_prompt_logprobs = self.prompt_logprobs, True
        return Chunk(text=new_text, token_ids=new_ids, final=self.finished, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
