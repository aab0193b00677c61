"""OpenAI's Responses API, `POST /v1/responses`, with `GET` and `DELETE /v1/responses/{id}` of stored responses.

A request is a chat request in other words: `instructions` is a system message first, `input` the conversation (a
string, a user's message; or message items, function calls and their outputs), `text.format` the response_format,
function `tools` and `tool_choice` the chat's, `max_output_tokens` its max_completion_tokens, `truncation: "auto"`
its truncate_prompt_tokens -1, and vLLM's extra fields that chat serves (seed, top_k, stop, ignore_eos, ...) are
passed as they are. It is checked, rendered by the chat template and submitted as chat's are
(`OpenAIServer.submit_chat`, router/openai_api.py); its reply is read as chat's (router/chat_reply.py: thought,
answer, tool calls) and becomes output items (router/response_items.py), whole or as server-sent events.

A finished response is kept (router/response_store.py) unless the request says `store: false`: a request with its
id as `previous_response_id` continues its conversation (its input and output items first, its instructions not
carried over, as OpenAI does). With `background: true` the answer is the response as it starts, generated on
(router/response_background.py) for GET to read and `POST /v1/responses/{id}/cancel` to stop. Every field not
served is refused by name.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from typing import Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from router.api import Finished, GenerationError
from router.frontdoor import interleave
from router.openai_errors import ApiError, unsupported
from router.openai_schema import FINISH_REASONS, ChatRequest, refuse_lone_surrogates
from router.openai_stream import GONE, run_unary
from router.response_items import OutputItems, ResponseWriter, output_of, status_of
from router.response_store import identified


class ResponsesRequest(BaseModel):
    """Unknown fields are kept: vLLM's extras that chat serves pass to it, any other is refused by name."""

    model_config = ConfigDict(extra="allow")
    model: str
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: dict | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    truncation: Literal["auto", "disabled"] | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    # Served only at their neutral value (_refuse_unserved).
    include: list[str] | None = None
    reasoning: dict | None = None


# Chat's fields that this API names otherwise or has no place for: why each is refused here.
ELSEWHERE = {
    "messages": "send the conversation as input",
    "max_tokens": "use max_output_tokens",
    "max_completion_tokens": "use max_output_tokens",
    "response_format": "use text.format",
    "n": "a response has one output",
    "stream_options": "a stream's last event, response.completed, carries the usage",
    "logprobs": "log-probabilities are not served on /v1/responses",
    "top_logprobs": "log-probabilities are not served on /v1/responses",
    "prompt_logprobs": "log-probabilities are not served on /v1/responses",
    "return_token_ids": "token ids are not served on /v1/responses",
    "return_tokens_as_token_ids": "log-probabilities are not served on /v1/responses",
    "add_generation_prompt": "an assistant message whose status is incomplete (last in input) is continued",
    "continue_final_message": "an assistant message whose status is incomplete (last in input) is continued",
}
# Chat's fields that this request has none of its own for: passed on as they are (vLLM's and specfleet's extras),
# but for those in ELSEWHERE, refused first.
PASSED = set(ChatRequest.model_fields) - set(ResponsesRequest.model_fields)

# A refusal from chat's checks, in this API's words: the field's name here.
RENAMED = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens", "messages": "input", "prompt": "input"}
RENAMED["response_format"] = "text.format"

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")


@contextlib.contextmanager
def renamed():
    """Chat's refusals named in this API's words: max_output_tokens, not max_tokens."""
    try:
        yield
    except ApiError as err:
        name = RENAMED.get(err.param)
        if name is not None:
            if err.message.startswith(err.param):
                err.message = name + err.message[len(err.param) :]
            err.param = name
        raise


def _refuse_unserved(body: ResponsesRequest) -> None:
    if body.background and body.stream:
        raise unsupported("background", "a background response is not streamed: read it with GET /v1/responses/{id}, or stream without it")
    if body.background and body.store is False:
        raise ApiError(400, "background: a background response is read back with GET, so it needs store (true, the default)", param="background")
    if body.include:
        raise unsupported("include", f"{body.include[0]!r} is not served")
    asked = [key for key, value in (body.reasoning or {}).items() if value is not None]
    if asked:
        why = "a reasoning model thinks as its chat template asks; chat_template_kwargs (such as enable_thinking) reach the template"
        raise unsupported(f"reasoning.{asked[0]}", why)


def _text(i: int, content, where: str, kinds: tuple[str, ...] = TEXT_PARTS) -> str:
    """A message's content: a string, or text parts (of `kinds`) joined."""
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in kinds and isinstance(part.get("text"), str)):
                raise ApiError(400, f"input[{i}].{where}[{j}]: only text parts ({', '.join(kinds)}) are supported", param="input")
            texts.append(part["text"])
        return "".join(texts)
    if not isinstance(content, str):
        raise ApiError(400, f"input[{i}].{where}: must be a string or a list of text parts", param="input")
    return content


def _fields(i: int, item: dict, required: dict[str, type], optional: tuple[str, ...] = ("id", "status")) -> None:
    # A key set to null is absent: a client that sends back a response's items as its SDK dumps them sends every field.
    extra = sorted({key for key, value in item.items() if value is not None} - {"type", *required, *optional})
    if extra:
        raise ApiError(400, f"input[{i}].{extra[0]}: not supported by specfleet", param="input")
    for key, kind in required.items():
        if not isinstance(item.get(key), kind):
            raise ApiError(400, f"input[{i}].{key}: a {kind.__name__} is required", param="input")


def _thought(i: int, item: dict) -> str:
    """A reasoning item's thought: its content's text, or its summary's where it has no content."""
    _fields(i, item, {}, ("id", "status", "summary", "content", "encrypted_content"))
    if item.get("encrypted_content") is not None:
        raise ApiError(400, f"input[{i}].encrypted_content: specfleet encrypts no thoughts; send the reasoning item's content", param="input")
    if item.get("content"):
        return _text(i, item["content"], "content", ("reasoning_text",))
    return _text(i, item.get("summary") or [], "summary", ("summary_text",))


def items_of(body: ResponsesRequest) -> list[dict]:
    """The request's `input` as items: a string is a user's message."""
    return [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input


def messages_of(body: ResponsesRequest, earlier: list[dict] = ()) -> list[dict]:
    """The chat messages of `instructions`, the `earlier` conversation's items and `input`'s; a tool call joins the
    assistant's message before it, and a reasoning item's thought (an earlier response's output) becomes the next
    assistant message's `reasoning`, which a template may render (one that no assistant's turn follows is left out).
    `input[i]` in a refusal counts from input's first item: the earlier items were checked when they were input."""
    messages = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    thought = None
    for i, item in enumerate([*earlier, *items_of(body)], start=-len(earlier)):
        kind = item.get("type", "message")
        if kind == "message":
            _fields(i, item, {"role": str}, ("content", "id", "status"))
            if item["role"] not in ROLES:
                raise ApiError(400, f"input[{i}].role: must be one of {', '.join(ROLES)}, got {item['role']!r}", param="input")
            messages.append({"role": item["role"], "content": _text(i, item.get("content"), "content")})
        elif kind == "reasoning":
            thought = (thought or "") + _thought(i, item)
            continue
        elif kind == "function_call":
            _fields(i, item, {"call_id": str, "name": str, "arguments": str})
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            _fields(i, item, {"call_id": str, "output": str})
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            raise ApiError(400, f"input[{i}].type: {kind!r} items are not supported by specfleet", param="input", code="unsupported_field")
        if thought is not None and messages[-1]["role"] == "assistant":
            messages[-1].setdefault("reasoning", thought)
        thought = None
    return messages


def _continued(body: ResponsesRequest) -> bool:
    """Whether the last input item is an assistant's message left unfinished, for the model to go on with (vLLM's)."""
    last = body.input[-1] if isinstance(body.input, list) and body.input else {}
    return last.get("type", "message") == "message" and last.get("role") == "assistant" and last.get("status") in ("in_progress", "incomplete")


def tools_of(tools: list[dict]) -> list[dict]:
    """Function tools in chat's shape: {"type": "function", "function": {"name", "description", "parameters"}}."""
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            why = f"{tool.get('type')!r} tools are not served by specfleet, only function tools"
            raise ApiError(400, f"tools[{i}].type: {why}", param="tools", code="unsupported_field")
        extra = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
        if extra:
            raise ApiError(400, f"tools[{i}].{extra[0]}: not supported by specfleet", param="tools")
        out.append({"type": "function", "function": {key: value for key, value in tool.items() if key != "type"}})
    return out


def tool_choice_of(choice: str | dict) -> str | dict:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        return {"type": "function", "function": {"name": choice["name"]}}
    why = 'one of "none", "auto", "required" or {"type": "function", "name": ...} (specfleet serves function tools only)'
    raise ApiError(400, f"tool_choice: {why}", param="tool_choice")


def format_of(text: dict | None) -> dict | None:
    """text.format as chat's response_format (router/openai_guides.py), or None for plain text."""
    text = text or {}
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise ApiError(400, f"text.{extra[0]}: not supported by specfleet", param="text")
    if text.get("verbosity") is not None:
        raise unsupported("text.verbosity", "the model writes as its prompt asks")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else fmt
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind != "json_schema":
        raise ApiError(400, f"text.format.type: one of text, json_object, json_schema, got {kind!r}", param="text.format")
    if not isinstance(fmt.get("schema"), dict):
        raise ApiError(400, "text.format.schema: a JSON schema (an object) is required", param="text.format")
    return {"type": "json_schema", "json_schema": {key: value for key, value in fmt.items() if key != "type"}}


def chat_request(body: ResponsesRequest, earlier: list[dict] = ()) -> ChatRequest:
    """The chat request this one is, continuing the `earlier` conversation; a 400 names the first field it cannot serve."""
    refuse_lone_surrogates(body)
    _refuse_unserved(body)
    chat = {"model": body.model, "messages": messages_of(body, earlier), "stream": body.stream, "parallel_tool_calls": body.parallel_tool_calls}
    for name in sorted(body.model_extra or {}):
        if name in ELSEWHERE:
            raise unsupported(name, f"not a field of /v1/responses: {ELSEWHERE[name]}")
        if name not in PASSED:
            raise unsupported(name)
        chat[name] = body.model_extra[name]
    optional = {"temperature": body.temperature, "top_p": body.top_p, "user": body.user, "max_completion_tokens": body.max_output_tokens}
    chat.update({key: value for key, value in optional.items() if value is not None})
    if body.tools:
        chat["tools"] = tools_of(body.tools)
    if body.tool_choice is not None:
        chat["tool_choice"] = tool_choice_of(body.tool_choice)
    if (fmt := format_of(body.text)) is not None:
        chat["response_format"] = fmt
    if body.truncation == "auto":
        if "truncate_prompt_tokens" in chat:
            raise ApiError(400, "truncate_prompt_tokens: set it or truncation, not both", param="truncate_prompt_tokens")
        chat["truncate_prompt_tokens"] = -1  # as many of the prompt's last tokens as fit beside the output
    if _continued(body):
        chat.update(add_generation_prompt=False, continue_final_message=True)
    try:
        return ChatRequest.model_validate(chat)
    except ValidationError as err:
        first = err.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if not isinstance(p, int)]
        raise ApiError(400, f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid')}", param=loc[0] if loc else None) from None


async def create_response(server, body: ResponsesRequest, request: Request):
    """POST /v1/responses over `server` (router/openai_api.py's OpenAIServer)."""
    with server.refusals():
        if body.background and not server.responses.enabled:
            why = "this server stores no responses (router.response_store_mb is 0), so a background one could not be read back"
            raise ApiError(400, f"background: {why}", param="background")
        previous = None if body.previous_response_id is None else await server.responses.get(body.previous_response_id, "previous_response_id")
        if previous is not None and previous.response["status"] == "in_progress":  # a background one, still generating
            why = f"{body.previous_response_id!r} is still in progress: continue it once GET /v1/responses/{{id}} says it has ended"
            raise ApiError(400, f"previous_response_id: {why}", param="previous_response_id")
        earlier = [] if previous is None else previous.conversation()
        chat = chat_request(body, earlier)
    replies, generations = await server.submit_chat(chat, request, renamed)
    writer = ResponseWriter(server, body, chat, [*earlier, *map(identified, items_of(body))])
    if body.stream:
        return StreamingResponse(_events(writer, replies[0], generations), media_type="text/event-stream")
    if body.background:
        return await server.background.start(writer, replies[0], generations[0])
    await run_unary(generations, request)
    return await writer.finished(generations[0], output_of(replies[0], generations[0]))


async def _events(writer: ResponseWriter, reply, generations: list):
    """The stream: response.created and response.in_progress, the items' events as the output comes, then
    response.completed with the whole response (its status "incomplete" where the length limit cut it, as vLLM
    sends it); a failure is an `error` event. Every event has a sequence number, counting from 0."""
    numbers = itertools.count()

    def sse(event: dict) -> str:
        event = {"type": event["type"], "sequence_number": next(numbers), **event}
        return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    items = OutputItems()
    try:
        started = writer.json("in_progress", [])
        yield sse({"type": "response.created", "response": started})
        yield sse({"type": "response.in_progress", "response": started})
        async with contextlib.aclosing(interleave(generations, GONE)) as updates:
            async for _, update in updates:
                final = isinstance(update, Finished)
                out = reply.delta(update.text, FINISH_REASONS.get(update.finish_reason) if final else None)
                for event in items.feed(out[0]) if out is not None else []:
                    yield sse(event)
        for event in items.finish(status_of(generations[0].completion().finish_reason)):
            yield sse(event)
        yield sse({"type": "response.completed", "response": await writer.finished(generations[0], items)})
    except GenerationError as err:
        # The status line is already sent: the failure travels as OpenAI's error event.
        failure = ApiError.of(err)
        yield sse({"type": "error", "code": failure.code, "message": failure.message, "param": failure.param})
    finally:
        # A client gone before the output began never started `interleave`, whose own cleanup cancels the rest.
        for generation in generations:
            generation.cancel(GONE)
