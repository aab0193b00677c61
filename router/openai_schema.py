"""The OpenAI API's side of router/openai_api.py: request bodies to router.api.GenerationParams, results to its JSON.

A request body is checked here only for what the OpenAI API adds (its field
names, chat messages, the fields specfleet does not implement); the rest is
router.frontdoor's validation, the same as for gRPC. A field specfleet cannot
honour is refused with a 400 naming it, never ignored: a client that asks for
`frequency_penalty` and gets something else would be misled.
"""

from __future__ import annotations

import json
import math
import struct

from pydantic import BaseModel, ConfigDict, Field

from router.api import GenerationParams, SpeculationOptions, SpeculationStats, Usage
from router.openai_errors import ApiError, unsupported
from router.openai_guides import guide_of

# Choices per request at most: each is a request of its own to the scheduler.
MAX_N = 16

# The router's finish reasons in OpenAI's words: the end-of-sequence token is a natural stop.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries its choice's usage so far


class Speculation(BaseModel):
    """specfleet's own options (router.api.SpeculationOptions)."""

    model_config = ConfigDict(extra="forbid")
    max_draft_tokens: int = Field(0, ge=0)
    disabled: bool = False


class Sampling(BaseModel):
    """Fields shared by both endpoints. Unknown fields are kept so that they can be refused by name."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Fields OpenAI defines that specfleet implements only at their neutral value.
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict | None = None
    # vLLM's extra sampling fields, and specfleet's.
    repetition_penalty: float = 1.0  # vLLM's
    stop_token_ids: list[int] | None = None  # vLLM's
    min_tokens: int = 0  # vLLM's
    top_k: int = 0
    min_p: float = 0.0  # vLLM's
    include_stop_str_in_output: bool = False  # vLLM's
    skip_special_tokens: bool = True  # vLLM's
    allowed_token_ids: list[int] | None = None  # vLLM's
    bad_words: str | list[str] | None = None  # vLLM's
    truncate_prompt_tokens: int | None = None  # vLLM's
    priority: int = 0  # vLLM's
    cache_salt: str | None = None  # vLLM's: a non-empty string
    # vLLM's: a text prompt's special tokens (a BOS) added; unset: a completion's are, a chat's not (its template's are).
    add_special_tokens: bool | None = None
    ignore_eos: bool = False
    # Name logprobs' tokens "token_id:<id>" (vLLM's option): exact where a token's text is not.
    return_tokens_as_token_ids: bool = False
    # vLLM's: each choice's token ids beside its text, and the prompt's (router/openai_stream.py says where streamed).
    return_token_ids: bool = False
    # vLLM's: each prompt token's log-probability past the first, with this many alternatives (not with stream).
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    speculation: Speculation | None = None
    domain: str = ""
    request_id: str = ""
    # Structured output (router/openai_guides.py): OpenAI's response_format ({"type": "text"}, the default; "json_object";
    # "json_schema" with json_schema.schema) or vLLM's structured_outputs (one of json, regex, choice, grammar, json_object).
    response_format: dict | None = None
    structured_outputs: dict | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    # The chosen tokens' log-probabilities and this many alternatives each (OpenAI allows 0 to 5).
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatRequest(Sampling):
    messages: list[dict] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Function calling (router/openai_tools.py): a named function or "required" guide the output; with "auto" the
    # calls the model writes are read (router/tool_parsers.py).
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    # vLLM's: how the chat template renders the prompt (render_chat).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None


def _lone_surrogate(value, where: str) -> str | None:
    """Where the first lone UTF-16 surrogate in the strings (and keys) of `value` is, else None."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as err:
            return f"{where}, character {err.start}"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        inner = f"{where}[{key}]" if isinstance(key, int) else f"{where}.{ascii(key)[1:-1]}"
        found = _lone_surrogate(key, f"the name of {inner}") or _lone_surrogate(item, inner)
        if found:
            return found
    return None


def refuse_lone_surrogates(body: Sampling) -> None:
    """A 400 for a string that is not Unicode text. JSON lets one through ("\\ud800"), and the tokenizer or
    the UTF-8 of an answer quoting it would fail: a 500, and uvicorn closes the client's connection."""
    for name, value in body.model_dump(exclude_none=True).items():
        param = ascii(name)[1:-1]
        where = _lone_surrogate(name, f"the name of {param}") or _lone_surrogate(value, param)
        if where:
            raise ApiError(
                400,
                f"{where}: a lone UTF-16 surrogate, which is not text; a JSON \\uD800-\\uDFFF escape must be one half "
                "of a pair (as in \\ud83d\\ude00): send the text as UTF-8, or a prompt as token ids",
                param=param,
            )


def refuse_unsupported(body: Sampling) -> None:
    """A 400 naming the first field specfleet cannot honour (after one that is not text at all)."""
    refuse_lone_surrogates(body)
    unknown = sorted(body.model_extra or {})
    if unknown:
        raise unsupported(unknown[0])
    if not 1 <= body.n <= MAX_N:
        raise ApiError(400, f"n: must be between 1 and {MAX_N}, got {body.n}", param="n")
    logit_bias_of(body)  # keys that are not token ids: a 400 before anything is submitted
    if body.allowed_token_ids == []:
        raise ApiError(400, "allowed_token_ids: must not be empty; leave it out to allow every token", param="allowed_token_ids")
    if isinstance(body, CompletionRequest):
        if body.best_of not in (None, 1):
            raise unsupported("best_of", "only 1 is supported")
        if body.suffix:
            raise unsupported("suffix")
    if body.seed is not None and not 0 <= body.seed < 2**63:
        raise ApiError(400, f"seed: must be between 0 and 2**63 - 1, got {body.seed}", param="seed")
    guide_of(body)  # a malformed response_format or structured_outputs: a 400 before anything is submitted
    if body.prompt_logprobs is not None and body.stream:
        raise ApiError(400, "prompt_logprobs: not available with stream: true (as in vLLM)", param="prompt_logprobs")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options: only allowed with stream: true", param="stream_options")


def logit_bias_of(body: Sampling) -> dict[int, float]:
    """The request's logit_bias as token id: bias. OpenAI's keys are token ids written as strings; the ids and values
    are checked where every API's are (router/frontdoor.py)."""
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not (isinstance(key, str) and key.strip().lstrip("-").isdigit()):
            raise ApiError(400, f"logit_bias: keys must be token ids (integers written as strings), got {key!r}", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ApiError(400, f"logit_bias: the bias of token {key} must be a number, got {value!r}", param="logit_bias")
        bias[int(key)] = float(value)
    return bias


def completion_prompts(body: CompletionRequest) -> list[str | list[int]]:
    """The prompts of a completions request: one string or token id list each."""
    prompts = body.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    return prompts


def chat_max_tokens(body: ChatRequest) -> int | None:
    if body.max_tokens is not None and body.max_completion_tokens is not None:
        raise ApiError(400, "max_completion_tokens: set it or max_tokens, not both", param="max_completion_tokens")
    return body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens


def params_of(body: Sampling, max_tokens: int | None, prompt: str | list[int], index: int, choice: int) -> GenerationParams:
    """The router's request for choice `choice` (of n) of one prompt; `index` is its place among all choices."""
    params = GenerationParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        # Choice c of n samples with seed + c: each choice differs, and the seed alone still fixes all n.
        seed=None if body.seed is None else body.seed + choice,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        stop_at_eos=not body.ignore_eos,
        domain=body.domain,
        request_id=f"{body.request_id}-{index}" if body.request_id else "",
        logit_bias=logit_bias_of(body),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        stop_token_ids=list(body.stop_token_ids or []),
        min_tokens=body.min_tokens,
        prompt_logprobs=body.prompt_logprobs,
        guide=guide_of(body),
        allowed_token_ids=list(body.allowed_token_ids or []),
        bad_words=[body.bad_words] if isinstance(body.bad_words, str) else list(body.bad_words or []),
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        priority=body.priority,
        cache_salt=body.cache_salt,
        add_special_tokens=isinstance(body, CompletionRequest) if body.add_special_tokens is None else body.add_special_tokens,
    )
    if isinstance(prompt, str):
        params.prompt = prompt
    else:
        params.prompt_token_ids = list(prompt)
    if isinstance(body, CompletionRequest) and body.logprobs is not None:
        params.logprobs, params.top_logprobs = True, body.logprobs
        if body.echo:  # the echoed prompt's tokens have theirs too
            params.prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0)
    if isinstance(body, ChatRequest):
        params.logprobs, params.top_logprobs = body.logprobs, body.top_logprobs or 0
    if body.speculation is not None:
        params.speculation = SpeculationOptions(disabled=body.speculation.disabled, max_draft_tokens=body.speculation.max_draft_tokens)
    return params


# What chat_template_kwargs cannot set: the template's own arguments, each set by a field of its own or by specfleet.
TEMPLATE_ARGUMENTS = ("messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message")
TEMPLATE_ARGUMENTS += ("tokenize", "chat_template")


def _message(i: int, message: dict) -> dict:
    """One chat message as the template reads it: text content, an assistant's tool calls and earlier thought, a tool
    result's call id."""
    role, content = message.get("role"), message.get("content")
    if role not in ("system", "user", "assistant", "developer", "tool"):
        raise ApiError(400, f"messages[{i}].role: must be system, developer, user, assistant or tool, got {role!r}", param="messages")
    thought = _thought(i, message)
    if content is None and role == "assistant" and (message.get("tool_calls") or thought is not None):
        content = ""  # an assistant turn that called tools or only thought, and said nothing
    if isinstance(content, list):  # content parts: only text ones
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
        content = "".join(p.get("text", "") for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content: must be a string or a list of text parts", param="messages")
    extra = sorted(set(message) - {"role", "content", "name", "tool_calls", "tool_call_id", *THOUGHT_KEYS})
    if extra:
        raise ApiError(400, f"messages[{i}].{extra[0]}: not supported by specfleet", param="messages")
    plain = {**{k: message[k] for k in ("tool_calls", "tool_call_id") if k in message}, "role": role, "content": content}
    # Under both names, as vLLM passes it: Qwen 3's and DeepSeek's templates read reasoning_content.
    return plain | dict.fromkeys(THOUGHT_KEYS, thought) if thought is not None else plain


# An assistant message's earlier thought (a reply's `reasoning`, sent back in a later turn), as vLLM names it.
THOUGHT_KEYS = ("reasoning", "reasoning_content")


def _thought(i: int, message: dict) -> str | None:
    given = [key for key in THOUGHT_KEYS if message.get(key) is not None]
    if not given:
        return None
    if message.get("role") != "assistant" or not isinstance(message[given[0]], str):
        raise ApiError(400, f"messages[{i}].{given[0]}: an assistant message's earlier thought, a string", param="messages")
    if len(given) > 1 and message[given[0]] != message[given[1]]:
        raise ApiError(400, f"messages[{i}].reasoning_content: set it or reasoning (the same thought), not both", param="messages")
    return message[given[0]]


def render_chat(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
) -> str:
    """The prompt text of `messages` (text content; tool calls and their results) and `tools` by the tokenizer's chat
    template, as vLLM renders it: the assistant's turn opened (add_generation_prompt), or the last message left open
    for the model to go on with (continue_final_message), and `template_kwargs` (chat_template_kwargs, such as
    `enable_thinking`) passed to the template."""
    if add_generation_prompt and continue_final_message:
        raise ApiError(400, "continue_final_message: set it or add_generation_prompt (true by default), not both", param="continue_final_message")
    taken = sorted(set(template_kwargs or {}) & set(TEMPLATE_ARGUMENTS))
    if taken:
        raise ApiError(400, f"chat_template_kwargs.{taken[0]}: set by specfleet or a field of its own", param="chat_template_kwargs")
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(
            400,
            "messages: this model's tokenizer has no chat template, so chat messages cannot be turned into a prompt; "
            "use /v1/completions, or add a chat_template to the tokenizer_config.json of the target",
            param="messages",
            code="no_chat_template",
        )
    plain = [_message(i, message) for i, message in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(
            plain,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **({"tools": tools} if tools else {}),
            **(template_kwargs or {}),
        )
    except Exception as err:  # the template's own checks (e.g. roles must alternate) are the client's to fix
        raise ApiError(400, f"messages: the model's chat template refused them: {err}", param="messages") from None


def chat_prompt(tokenizer, body) -> str:
    """The prompt of a chat request (or /tokenize's with messages): its messages, tools and template options."""
    options = (body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs)
    return render_chat(tokenizer, body.messages, body.tools, *options)


# --- results as OpenAI's JSON ---------------------------------------------------------------------------------------


def usage_json(usages: list[Usage], n: int = 1) -> dict:
    """Choices' usage, `n` a prompt (prompt i's c-th at i * n + c): a prompt counted once, as OpenAI and vLLM count it."""
    prompt = sum(u.prompt_tokens for u in usages[::n])
    completion = sum(u.completion_tokens for u in usages)
    cached = {"cached_tokens": sum(u.cached_tokens for u in usages[::n])}
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion, "prompt_tokens_details": cached}


def _shortest_float32(x: float) -> float:
    """x at float32 precision, in the fewest digits that keep it (as protobuf's JSON form of a float field)."""
    try:
        single = struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)
    if not math.isfinite(single):
        return single
    for digits in range(6, 10):
        short = float(f"{single:.{digits}g}")
        if struct.unpack("f", struct.pack("f", short))[0] == single:
            return short
    return single


def speculation_json(stats: SpeculationStats) -> dict:
    """The statistics as the gRPC API's SpeculationStats in protobuf's JSON form: fields at their zero value left out."""
    drafters = [
        {
            k: v
            for k, v in (("drafter", d.drafter), ("rounds", d.rounds), ("draft_tokens", d.draft_tokens), ("accepted_tokens", d.accepted_tokens))
            if v
        }
        for d in stats.drafters
    ]
    fields = {
        "rounds": stats.rounds,
        "draft_tokens": stats.draft_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "drafters": drafters,
        "draft_wall_ms": _shortest_float32(stats.draft_wall_ms),
        "draft_compute_ms": _shortest_float32(stats.draft_compute_ms),
        "verify_wall_ms": _shortest_float32(stats.verify_wall_ms),
        "verify_compute_ms": _shortest_float32(stats.verify_compute_ms),
        "domain": stats.domain,
        "draft_queue_ms": _shortest_float32(stats.draft_queue_ms),
        "verify_queue_ms": _shortest_float32(stats.verify_queue_ms),
        "router_ms": _shortest_float32(stats.router_ms),
    }
    return {k: v for k, v in fields.items() if v}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
