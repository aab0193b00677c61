"""The Responses API's stored responses (router/openai_responses.py): what `previous_response_id` continues and
`GET /v1/responses/{id}` returns, kept in the router's memory within `router.response_store_mb` (`ResponseStore`)
and, with `router.redis_url`, in Redis too, so that a conversation goes on through whichever router replica its
next request reaches (`Responses`).

A stored response keeps its whole conversation (`context`: every earlier response's input and output items in
order, then its own input), so that a continuation reads one entry, whatever was forgotten since. An entry is
counted at the size of its JSON, its context whole, though later entries share their items with it: the count can
only overstate the memory held. The least recently stored or read goes first when the budget is full."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from router.expertise import redacted
from router.openai_errors import ApiError

log = logging.getLogger(__name__)


@dataclass
class Stored:
    response: dict  # the response object, as it was answered
    context: list[dict]  # the input items of the conversation it answered, earlier responses' output included
    shared: bool = True  # in Redis too, where there is one (not where it was kept while Redis was away)

    def conversation(self) -> list[dict]:
        """What a response that continues this one reads before its own input: this one's context and output."""
        return self.context + self.response["output"]


class ResponseStore:
    """Responses by id, least recently used forgotten first once their JSON passes `budget_bytes` (0: nothing kept)."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[str, tuple[Stored, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, context: list[dict], size: int | None = None) -> Stored | None:
        """Keep `response` (answering `context`; `size`: their JSON's length, where the caller has it) in place of any
        kept under its id (a background response's start), forgetting the least recently used to make room; None
        where it alone is over the budget."""
        self.discard(response["id"])
        size = size if size is not None else len(json.dumps(response)) + len(json.dumps(context))
        if size > self.budget_bytes:
            return None
        while self.used_bytes + size > self.budget_bytes:
            _, (_, forgotten) = self._entries.popitem(last=False)
            self.used_bytes -= forgotten
        kept = Stored(response, context)
        self._entries[response["id"]] = (kept, size)
        self.used_bytes += size
        return kept

    def find(self, response_id: str) -> Stored | None:
        """The stored response, now the most recently used; None where it is not kept."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        self._entries.move_to_end(response_id)
        return entry[0]

    def get(self, response_id: str, param: str | None = None) -> Stored:
        """`find`'s, or a 404 naming why it may be missing."""
        stored = self.find(response_id)
        if stored is None:
            raise missing(response_id, param, self.budget_bytes == 0)
        return stored

    def discard(self, response_id: str) -> bool:
        """Forget it; whether it was kept."""
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.used_bytes -= entry[1]
        return entry is not None


# An input item's id prefix, by its type (OpenAI's).
ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def identified(item: dict) -> dict:
    """An input item as `input_items` lists it: with an id of its own, and a message's text as an input_text part."""
    kind = item.get("type", "message")
    item = {"type": kind, **item}
    if kind == "message" and isinstance(item.get("content"), str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        item["content"] = [{"type": part, "text": item["content"]}]
    if not item.get("id"):
        item["id"] = f"{ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}"
    return item


def input_items(stored: Stored, limit: int = 20, order: str = "desc", after: str | None = None, before: str | None = None) -> dict:
    """GET /v1/responses/{id}/input_items: the items of the conversation a response answered (earlier turns' input
    and output included), a page of `limit` (1 to 100) in `order`, after or before an item's id."""
    if not 1 <= limit <= 100:
        raise ApiError(400, f"limit: from 1 to 100, got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order: asc or desc, got {order!r}", param="order")
    items = stored.context if order == "asc" else stored.context[::-1]
    ids = [item.get("id") for item in items]
    for name, cursor in (("after", after), ("before", before)):
        if cursor is not None and cursor not in ids:
            raise ApiError(400, f"{name}: no item {cursor!r} among this response's input items", param=name)
    start = ids.index(after) + 1 if after is not None else 0
    end = ids.index(before) if before is not None else len(items)
    page = items[start:end][:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": start + len(page) < end,
    }


def missing(response_id: str, param: str | None, store_off: bool) -> ApiError:
    """A 404 for a response not kept, saying why that may be and what to do."""
    if store_off:
        why = "this server stores no responses (router.response_store_mb is 0): send the conversation in input"
    else:
        why = (
            "it was not stored (store: false), was deleted, was forgotten (router.response_store_mb, router.response_ttl_s), "
            "or another router without router.redis_url served it; send the conversation in input"
        )
    code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
    return ApiError(404, f"{param or 'response_id'}: no stored response {response_id!r}: {why}", param=param, code=code)


class Responses:
    """The HTTP API's stored responses: this router's own in memory, and with `redis_url` every router's in Redis
    (for `ttl_s`; Redis's own maxmemory policy bounds them), which is then the one that answers: a response deleted
    through one router is gone for all. While Redis is away a router still reads the responses it answered itself
    (from memory), and a response it cannot read from Redis is a 503 that says so; those it answered meanwhile stay
    its own (Redis never saw them) until it forgets them."""

    def __init__(self, memory: ResponseStore, redis_url: str = "", ttl_s: float = 30 * 24 * 3600):
        self.memory, self.ttl_s = memory, ttl_s
        self.enabled = memory.budget_bytes > 0
        self._redis = None
        self._where = redacted(redis_url)
        if redis_url and self.enabled:
            import redis

            self._redis = redis.Redis.from_url(redis_url, socket_timeout=1.0, socket_connect_timeout=1.0)
        self._away = False  # Redis failed the last call: logged once until it answers again

    async def keep(self, response: dict, context: list[dict]) -> bool:
        """Store `response` (answering `context`) here, and in Redis; False where it is too large to keep. Its JSON is
        written off the event loop, which runs every request's rounds: a long conversation's takes milliseconds."""
        value = await asyncio.to_thread(json.dumps, {"response": response, "context": context})
        kept = self.memory.put(response, context, len(value))
        if kept is None:
            return False
        if self._redis is not None:
            if not await self._shared(self._redis.set, _key(response["id"]), value, ex=max(1, round(self.ttl_s))):
                kept.shared = False  # Redis's "no such response" does not hold for it
        return True

    async def get(self, response_id: str, param: str | None = None) -> Stored:
        if self._redis is None:
            return self.memory.get(response_id, param)
        try:
            value = await self._shared(self._redis.get, _key(response_id), raising=True)
        except ConnectionError:
            kept = self.memory.find(response_id)  # its own, answered here
            if kept is not None:
                return kept
            raise self._unavailable(param, "send the conversation in input") from None
        if value is None:
            kept = self.memory.find(response_id)
            if kept is not None and not kept.shared:
                return kept
            self.memory.discard(response_id)  # deleted or expired: through another router, perhaps
            raise missing(response_id, param, False)
        stored = await asyncio.to_thread(json.loads, value)
        return Stored(stored["response"], stored["context"])

    async def delete(self, response_id: str) -> None:
        here = self.memory.discard(response_id)
        shared = 0
        if self._redis is not None:
            try:
                shared = await self._shared(self._redis.delete, _key(response_id), raising=True)
            except ConnectionError:
                raise self._unavailable(None, "delete it again once Redis is back") from None
        if not (here or shared):
            raise missing(response_id, None, not self.enabled)

    def _unavailable(self, param: str | None, then: str) -> ApiError:
        why = f"Redis at {self._where} (router.redis_url), which holds the stored responses, is unavailable: retry, or {then}"
        return ApiError(503, f"{param or 'response_id'}: {why}", param=param, code="unavailable")

    async def _shared(self, call, *args, raising: bool = False, **kwargs):
        """One Redis call off the event loop; a failure is logged once while it lasts, and raised as ConnectionError
        where `raising` (else None)."""
        try:
            result = await asyncio.to_thread(call, *args, **kwargs)
        except Exception as err:
            if not self._away:
                self._away = True
                log.warning("redis at %s unavailable (%s); stored responses are read from this router's memory meanwhile", self._where, err)
            if raising:
                raise ConnectionError(str(err)) from None
            return None
        if self._away:
            self._away = False
            log.info("redis at %s is back: stored responses are shared again", self._where)
        return result


def _key(response_id: str) -> str:
    return f"specfleet:response:{response_id}"


def responses_of(settings) -> Responses:
    """The stored responses the router's settings (RouterConfig) ask for: in memory, and shared through Redis with router.redis_url."""
    return Responses(ResponseStore(settings.response_store_mb * 2**20), settings.routing.redis_url, settings.response_ttl_s)
