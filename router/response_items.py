"""A Responses API answer (router/openai_responses.py): its output items, built from a chat reply's deltas
(router/chat_reply.py): the thought as a `reasoning` item, the answer as a `message` item with one `output_text`
part, each tool call as a `function_call` item; with the server-sent events that build them as they stream, in
OpenAI's names. The unary answer is built by the same steps from the whole reply, so that a stream's final items and
the unary answer's are the same. And the response object around them (`ResponseWriter`), stored once finished."""

from __future__ import annotations

import time
import uuid

from router.openai_schema import FINISH_REASONS, speculation_json
from router.response_store import Responses


# Each kind of item that holds text: its id's prefix, its part's type, the event its text streams in.
TEXT_ITEMS = {
    "message": ("msg", "output_text", "response.output_text"),
    "reasoning": ("rs", "reasoning_text", "response.reasoning_text"),
}


def _part(kind: str, text: str) -> dict:
    part = {"type": TEXT_ITEMS[kind][1], "text": text}
    return {**part, "annotations": [], "logprobs": []} if kind == "message" else part


def _item(kind: str, item_id: str, text: str | None, status: str) -> dict:
    """A text item; `text` None: as just opened (its part not yet added)."""
    parts = [] if text is None else [_part(kind, text)]
    if kind == "message":
        return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": parts}
    return {"id": item_id, "type": "reasoning", "summary": [], "content": parts, "status": status}


class OutputItems:
    """One response's output items, fed a chat reply's deltas ({"reasoning", "content", "tool_calls"}, in that order)
    and finished once; each step returns the events (without sequence numbers) that tell a stream what it did."""

    def __init__(self):
        self.items: list[dict] = []  # finished items
        self.open: tuple[str, str, str] | None = None  # the text item being written: (kind, id, its text so far)

    def feed(self, delta: dict) -> list[dict]:
        events = []
        if delta.get("reasoning"):
            events += self._write("reasoning", delta["reasoning"])
        if delta.get("content") is not None:
            events += self._write("message", delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._close("completed") + self._call(call["id"], call["function"]["name"], call["function"]["arguments"])
        return events

    def finish(self, status: str) -> list[dict]:
        """The last events: the open item closed with `status` ("incomplete" where the length limit cut it). An answer
        with no item at all is an empty message, as the chat reply's is empty content."""
        events = self._write("message", "") if self.open is None and not self.items else []
        return events + self._close(status)

    @property
    def reasoned(self) -> bool:
        return any(item["type"] == "reasoning" for item in self.items)

    def _write(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open[0] != kind:
            events = self._close("completed")
            self.open = (kind, f"{TEXT_ITEMS[kind][0]}_{uuid.uuid4().hex}", "")
            where = {"output_index": len(self.items)}
            events.append({"type": "response.output_item.added", **where, "item": _item(kind, self.open[1], None, "in_progress")})
            part = _part(kind, "")
            events.append({"type": "response.content_part.added", **where, "item_id": self.open[1], "content_index": 0, "part": part})
        kind, item_id, written = self.open
        if text:
            self.open = (kind, item_id, written + text)
            events.append({"type": f"{TEXT_ITEMS[kind][2]}.delta", **self._at(), "delta": text, **self._logprobs(kind)})
        return events

    def _close(self, status: str) -> list[dict]:
        if self.open is None:
            return []
        kind, item_id, text = self.open
        item = _item(kind, item_id, text, status)
        events = [
            {"type": f"{TEXT_ITEMS[kind][2]}.done", **self._at(), "text": text, **self._logprobs(kind)},
            {"type": "response.content_part.done", **self._at(), "part": item["content"][0]},
            {"type": "response.output_item.done", "output_index": len(self.items), "item": item},
        ]
        self.items.append(item)
        self.open = None
        return events

    def _call(self, call_id: str, name: str, arguments: str) -> list[dict]:
        """A tool call's item: the chat reply gives each call whole, so its arguments come in one delta."""
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}
        where = {"output_index": len(self.items), "item_id": item["id"]}
        self.items.append({**item, "status": "completed"})
        return [
            {"type": "response.output_item.added", "output_index": where["output_index"], "item": {**item, "arguments": "", "status": "in_progress"}},
            {"type": "response.function_call_arguments.delta", **where, "delta": arguments},
            {"type": "response.function_call_arguments.done", **where, "name": name, "arguments": arguments},
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": self.items[-1]},
        ]

    def _at(self) -> dict:
        return {"item_id": self.open[1], "output_index": len(self.items), "content_index": 0}

    @staticmethod
    def _logprobs(kind: str) -> dict:
        # output_text events carry log-probabilities in OpenAI's shape; specfleet sends none on this API (`include`).
        return {"logprobs": []} if kind == "message" else {}


def reasoning_tokens(tokenizer, token_ids: list[int], close: str | None) -> int:
    """The output's tokens up to the end of its thought, its closing tag `close` included (all of them where it never
    closes); 0 where there is no thought (`close` None). The smallest prefix whose text holds the tag, found by
    halving: a few decodes."""
    if close is None:
        return 0

    def closed(n: int) -> bool:
        return close in tokenizer.decode(token_ids[:n], skip_special_tokens=False)

    if not closed(len(token_ids)):
        return len(token_ids)
    low, high = 1, len(token_ids)
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if closed(middle) else (middle + 1, high)
    return low


def usage_of(usage, reasoning: int) -> dict:
    """The Responses API's usage of a request's `usage` (router.api.Usage) with `reasoning` tokens of its output."""
    prompt_tokens, output_tokens = usage.prompt_tokens, usage.completion_tokens
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt_tokens + output_tokens,
    }


class ResponseWriter:
    """One request's response object, as it starts and once finished (then stored, unless the request says
    `store: false`, answering `context`: the earlier conversation's items and its own input's); `body` is the
    request (router/openai_responses.py's ResponsesRequest), `chat` the chat request it became."""

    def __init__(self, server, body, chat, context: list[dict]):
        self.server, self.body, self.chat, self.context = server, body, chat, context
        self.id, self.created = f"resp_{uuid.uuid4().hex}", int(time.time())
        self.responses: Responses = server.responses
        self.store = body.store is not False and self.responses.enabled

    def json(self, status: str, output: list[dict], usage: dict | None = None, **extra) -> dict:
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.server.model_name,
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None,
            "instructions": body.instructions,
            "metadata": body.metadata,
            "user": body.user,
            "output": output,
            "temperature": self.chat.temperature,
            "top_p": self.chat.top_p,
            "max_output_tokens": body.max_output_tokens,
            "tools": body.tools or [],
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto" if body.tools else "none",
            "parallel_tool_calls": body.parallel_tool_calls,
            "text": body.text or {"format": {"type": "text"}},
            "truncation": body.truncation or "disabled",
            "reasoning": body.reasoning,
            "previous_response_id": body.previous_response_id,
            "store": self.store,
            "background": bool(body.background),
            "usage": usage,
            **extra,
        }

    async def finished(self, generation, items: OutputItems, status: str | None = None, **extra) -> dict:
        """The whole response, once `generation` has finished (or stopped: `status`) and `items` hold its output (stored
        before it is answered, so that the client's next request finds it); with specfleet's `speculation` statistics
        beside it, as chat's carry them."""
        result = generation.completion()
        close = self.server.thinks.close if items.reasoned else None
        reasoning = reasoning_tokens(self.server.front_door.tokenizer, result.token_ids, close)
        usage = usage_of(result.usage, reasoning)
        status = status or status_of(result.finish_reason)
        response = self.json(status, items.items, usage, speculation=speculation_json(result.speculation), **extra)
        if self.store and not await self.responses.keep(response, self.context):
            response["store"] = False  # alone larger than the store's budget
        return response


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if FINISH_REASONS.get(finish_reason) == "length" else "completed"


def output_of(reply, generation, status: str | None = None) -> OutputItems:
    """A generation's output so far (all of it once finished) as items, read as chat's reply; the last item closed
    with `status` (else as the generation finished)."""
    result = generation.completion()
    items = OutputItems()
    message, _ = reply.message(result.text, FINISH_REASONS.get(result.finish_reason))
    items.feed(message)
    items.finish(status or status_of(result.finish_reason))
    return items
