"""A generation request checked field by field before the front door admits it (router/frontdoor.py): `validate` turns
a `GenerationParams` into the `RequestSpec` the scheduler runs, or raises a GenerationError (INVALID_ARGUMENT) whose
message names the first bad field, whichever API the request came through."""

from __future__ import annotations

import math
import secrets
import struct
import uuid

from router.api import GenerationParams, invalid
from router.request import Limits, RequestSpec
from specfleet.guides import Guide, GuideCompiler, GuideError
from specfleet.sampling import MAX_LOGIT_BIAS, MAX_PENALTY, MAX_REPETITION_PENALTY, SamplingParams

MAX_STOP_STRINGS = 16
MAX_LABEL_CHARS = 128
MAX_TOP_LOGPROBS = 20
# The verifier and drafters take top_k as an int32 and a seed as a uint64.
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**64 - 1
# Tokens one request may bias: each is added to every row's logits at the verifier and each drafter.
MAX_BIASED_TOKENS = 1024
MAX_STOP_TOKEN_IDS = 64
# allowed_token_ids and bad_words travel in every round's messages to the verifier and each drafter.
MAX_ALLOWED_TOKEN_IDS = 4096
MAX_BAD_WORDS = 64
MAX_BAD_WORD_TOKENS = 32
# A bad word's characters, checked before it is tokenized (a token is rarely longer than 16 characters).
MAX_BAD_WORD_CHARS = 16 * MAX_BAD_WORD_TOKENS
# A cache salt names a tenant (an id, a hash): it rides in each new session's first message to every server.
MAX_CACHE_SALT_CHARS = 256


def _float32(x: float) -> float:
    """x as the float32 the verifier and drafters are sent (an overflow is infinite): what the router checks is what they get."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def validate(params: GenerationParams, tokenizer, limits: Limits, guides: GuideCompiler | None = None) -> RequestSpec:
    """The request `params` asks for, checked against `limits`; a GenerationError (INVALID_ARGUMENT) names the first bad field.
    A guide is compiled by `guides` (the target's tokenizer's), so one that does not compile is refused here; without
    `guides` (the verifier cannot compile guides) every guided request is."""
    for name, value, longest in (("request_id", params.request_id, MAX_LABEL_CHARS), ("domain", params.domain, MAX_LABEL_CHARS)):
        # Labels end up in logs and metrics: no control characters (a newline would forge a log line).
        if len(value) > longest or not value.isprintable():
            raise invalid(name, f"at most {longest} printable characters, got {len(value)} characters")
    prompt_ids = _prompt_ids(params, tokenizer, limits)
    max_tokens = _max_tokens(params, len(prompt_ids), limits)
    bad_words = _bad_words(params.bad_words, tokenizer, limits)
    sampling = _sampling(params, limits, len(prompt_ids), max_tokens, _guide(params.guide, guides, limits.vocab_size), bad_words)
    if sampling.guide is not None and params.min_tokens:
        # Where the guide completes before min_tokens, it allows end of sequence alone, which min_tokens holds back.
        raise invalid("min_tokens", "cannot be combined with structured output: the guide decides where the output ends")
    if sampling.allowed_token_ids and sampling.guide is not None:
        # The guide's tokens and the allowed ones could have none in common at some row.
        raise invalid("allowed_token_ids", "cannot be combined with structured output: the guide decides which tokens are allowed")
    if sampling.allowed_token_ids and sampling.held_back and set(sampling.allowed_token_ids) <= set(sampling.held_back):
        raise invalid("min_tokens", "every allowed token ends the output, which min_tokens holds back: no token could be generated")
    if len(params.stop) > MAX_STOP_STRINGS or any(not s for s in params.stop):
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} non-empty strings")
    spec_opts = params.speculation
    if not 0 <= spec_opts.max_draft_tokens <= limits.requests.max_draft_tokens:
        raise invalid("speculation.max_draft_tokens", f"must be between 0 and {limits.requests.max_draft_tokens}, got {spec_opts.max_draft_tokens}")
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid("top_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {params.top_logprobs}")
    if params.top_logprobs and not params.logprobs:
        raise invalid("top_logprobs", "needs logprobs set")
    if params.prompt_logprobs is not None and not 0 <= params.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid("prompt_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {params.prompt_logprobs}")
    return RequestSpec(
        request_id=params.request_id or uuid.uuid4().hex,
        session_id=secrets.token_hex(16),
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=list(params.stop),
        stop_at_eos=params.stop_at_eos,
        max_draft_tokens=0 if spec_opts.disabled else (spec_opts.max_draft_tokens or limits.requests.num_draft_tokens),
        domain=params.domain,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        stop_token_ids=list(params.stop_token_ids),
        min_tokens=params.min_tokens,
        prompt_logprobs=params.prompt_logprobs,
        include_stop_str_in_output=params.include_stop_str_in_output,
        skip_special_tokens=params.skip_special_tokens,
        priority=_priority(params.priority, limits),
        cache_salt=_cache_salt(params.cache_salt),
    )


def _prompt_ids(params: GenerationParams, tokenizer, limits: Limits) -> list[int]:
    keep = params.truncate_prompt_tokens
    if keep is not None and keep < 1 and keep != -1:
        raise invalid("truncate_prompt_tokens", f"must be >= 1 (the prompt's last tokens kept) or -1 (as many as fit), got {keep}")
    if keep == -1:
        keep = max(1, limits.max_context - (params.max_tokens or limits.requests.default_max_tokens))
    if params.prompt and params.prompt_token_ids:
        raise invalid("prompt", "set either prompt or prompt_token_ids, not both")
    if params.prompt_token_ids:
        prompt_ids = list(params.prompt_token_ids)
        bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise invalid("prompt_token_ids", f"ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}")
    else:
        if not params.prompt:
            raise invalid("prompt", "must not be empty (or set prompt_token_ids)")
        if len(params.prompt) > limits.max_prompt_chars and keep is None:
            raise invalid("prompt", f"{len(params.prompt)} characters cannot fit the model's context of {limits.max_context} tokens; shorten it")
        prompt_ids = tokenizer.encode(params.prompt, add_special_tokens=params.add_special_tokens)
        if not prompt_ids:
            raise invalid("prompt", "encodes to no tokens")
    if keep is not None:
        prompt_ids = prompt_ids[-keep:]
    if len(prompt_ids) >= limits.max_context:
        raise invalid("prompt", f"{len(prompt_ids)} tokens leaves no room in the model's context of {limits.max_context} tokens; shorten it")
    return prompt_ids


def _max_tokens(params: GenerationParams, prompt_tokens: int, limits: Limits) -> int:
    max_tokens = params.max_tokens if params.max_tokens is not None else limits.requests.default_max_tokens
    if not 1 <= max_tokens <= limits.requests.max_tokens_limit:
        raise invalid("max_tokens", f"must be between 1 and {limits.requests.max_tokens_limit}, got {max_tokens}")
    room = limits.max_context - prompt_tokens
    if max_tokens > room:
        if params.max_tokens is not None:
            # Generation would stop at the context's end with less than was asked: say so now.
            raise invalid(
                "max_tokens",
                f"{max_tokens} new tokens after a prompt of {prompt_tokens} exceed the model's context of "
                f"{limits.max_context} tokens; ask for at most {room}",
            )
        max_tokens = room  # the server's default, not the client's request: fit it to the context
    return max_tokens


def _guide(guide: Guide | None, guides: GuideCompiler | None, vocab_size: int) -> Guide | None:
    if guide is None:
        return None
    try:
        problem = guide.problem()
        if problem:
            raise GuideError(problem)
        if any(not 0 <= token < vocab_size for token in guide.thought_tokens):
            raise GuideError(f"a thought's tokens must be ids in the vocabulary [0, {vocab_size})")
        if guides is None:
            raise GuideError("structured output needs the xgrammar package where the verifier runs, which it lacks: pip install xgrammar there")
        guides.compile(guide)
    except GuideError as err:
        raise invalid("guide", str(err)) from None
    return guide


def _sampling(
    params: GenerationParams, limits: Limits, prompt_tokens: int, max_tokens: int, guide: Guide | None, bad_words: tuple[tuple[int, ...], ...]
) -> SamplingParams:
    temperature, top_p = _float32(params.temperature), _float32(params.top_p)
    if not math.isfinite(temperature) or temperature < 0:
        raise invalid("temperature", f"must be >= 0 (0 is greedy), got {temperature}")
    if not (0 < top_p <= 1):
        raise invalid("top_p", f"must be in (0, 1], got {top_p}")
    if params.top_k < 0:
        raise invalid("top_k", f"must be >= 0 (0 disables it), got {params.top_k}")
    if params.top_k > MAX_TOP_K:
        raise invalid("top_k", f"must be at most {MAX_TOP_K}, got {params.top_k}")
    min_p = _float32(params.min_p)
    if not 0 <= min_p <= 1:
        raise invalid("min_p", f"must be in [0, 1] (0 disables it), got {min_p}")
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise invalid("seed", f"must be between 0 and 2**64 - 1, got {params.seed}")
    # A client's seed must fix the output whatever is drafted, batched or learned: such a request
    # samples by the seeded exponential race (verification.py, obligation 6). Without one,
    # rejection sampling accepts more drafts.
    seeded = params.seed is not None
    seed = params.seed if seeded else secrets.randbits(63)
    held_back = _held_back(params, limits, max_tokens)
    bias = _logit_bias(params.logit_bias, limits.vocab_size)
    presence, frequency, repetition = (_float32(params.presence_penalty), _float32(params.frequency_penalty), _float32(params.repetition_penalty))
    for name, value in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if not -MAX_PENALTY <= value <= MAX_PENALTY:
            raise invalid(name, f"must be between -{MAX_PENALTY:g} and {MAX_PENALTY:g} (0: none), got {value}")
    if not 0 < repetition <= MAX_REPETITION_PENALTY:
        raise invalid("repetition_penalty", f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1: none), got {repetition}")
    return SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=params.top_k,
        min_p=min_p,
        seed=seed,
        drafter_invariant=seeded,
        logit_bias=bias,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        # Where presence, frequency, min_tokens, a guide and bad words start reading the output; left at 0 where
        # nothing reads it.
        output_start=prompt_tokens if (presence or frequency or repetition != 1 or held_back or guide or bad_words) else 0,
        min_tokens=params.min_tokens if held_back else 0,
        held_back=held_back,
        guide=guide,
        allowed_token_ids=_allowed_token_ids(params.allowed_token_ids, limits.vocab_size),
        bad_words=bad_words,
    )


def _held_back(params: GenerationParams, limits: Limits, max_tokens: int) -> tuple[int, ...]:
    """The tokens `min_tokens` holds back (end of sequence where the output stops there, and the stop tokens), or ()
    where it holds back nothing; stop_token_ids and min_tokens checked."""
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise invalid("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} tokens, got {len(params.stop_token_ids)}")
    bad = [t for t in params.stop_token_ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise invalid("stop_token_ids", f"ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}")
    if not 0 <= params.min_tokens <= max_tokens:
        raise invalid("min_tokens", f"must be between 0 and max_tokens ({max_tokens}), got {params.min_tokens}")
    ends = set(params.stop_token_ids) | ({limits.eos_token_id} if params.stop_at_eos and limits.eos_token_id >= 0 else set())
    return tuple(sorted(ends)) if params.min_tokens > 0 else ()


def _logit_bias(bias: dict[int, float], vocab_size: int) -> tuple[tuple[int, float], ...]:
    """A request's logit bias as SamplingParams holds it (id order, float32 values, zeros left out: they change nothing)."""
    if len(bias) > MAX_BIASED_TOKENS:
        raise invalid("logit_bias", f"at most {MAX_BIASED_TOKENS} tokens, got {len(bias)}")
    out = []
    for token, value in sorted(bias.items()):
        if not 0 <= token < vocab_size:
            raise invalid("logit_bias", f"token id {token} is outside the vocabulary [0, {vocab_size})")
        value = _float32(value)
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise invalid("logit_bias", f"the bias of token {token} must be between -{MAX_LOGIT_BIAS:g} and {MAX_LOGIT_BIAS:g}, got {value}")
        if value:
            out.append((token, value))
    return tuple(out)


def _bad_words(words: list[str], tokenizer, limits: Limits) -> tuple[tuple[int, ...], ...]:
    """Each bad word's token sequences: the word as the target's tokenizer writes it as the output's first text and
    after a space. vLLM bans the second only where it has as many tokens as the first, which misses " fox" (one token)
    after "fox" (two) in byte-level BPE vocabularies; a spelling banned needlessly bans only text holding the word."""
    if len(words) > MAX_BAD_WORDS:
        raise invalid("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(words)}")
    sequences: list[tuple[int, ...]] = []
    for i, word in enumerate(words):
        word = word.lstrip()
        if not word:
            raise invalid("bad_words", f"word {i} is empty or only whitespace")
        if len(word) > MAX_BAD_WORD_CHARS:
            raise invalid("bad_words", f"word {i} is {len(word)} characters; at most {MAX_BAD_WORD_CHARS}")
        plain = tuple(tokenizer.encode(word, add_special_tokens=False))
        if not plain:
            raise invalid("bad_words", f"word {i} encodes to no tokens")
        spaced = tuple(tokenizer.encode(" " + word, add_special_tokens=False))
        for sequence in (plain, spaced):
            if len(sequence) > MAX_BAD_WORD_TOKENS:
                raise invalid("bad_words", f"word {i} is {len(sequence)} tokens; at most {MAX_BAD_WORD_TOKENS}")
            if any(not 0 <= t < limits.vocab_size for t in sequence):
                raise invalid("bad_words", f"word {i} encodes to ids outside the model's vocabulary [0, {limits.vocab_size})")
            if sequence not in sequences:
                sequences.append(sequence)
    return tuple(sequences)


def _allowed_token_ids(ids: list[int], vocab_size: int) -> tuple[int, ...]:
    allowed = sorted(set(ids))
    if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
        raise invalid("allowed_token_ids", f"at most {MAX_ALLOWED_TOKEN_IDS} tokens, got {len(allowed)}")
    bad = [t for t in allowed if not 0 <= t < vocab_size]
    if bad:
        raise invalid("allowed_token_ids", f"ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return tuple(allowed)


def _priority(priority: int, limits: Limits) -> int:
    if priority and not limits.requests.priority_scheduling:
        raise invalid("priority", "this server admits requests in turns, not by priority; its operator may set router.priority_scheduling")
    if not -(2**31) <= priority < 2**31:
        raise invalid("priority", f"must fit in 32 bits, got {priority}")
    return priority


def _cache_salt(salt: str | None) -> str:
    if salt is None:
        return ""
    if not salt:
        raise invalid("cache_salt", "must be a non-empty string where set (unset: the prompt shares the cache with every unsalted request)")
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise invalid("cache_salt", f"is {len(salt)} characters; at most {MAX_CACHE_SALT_CHARS}")
    return salt
