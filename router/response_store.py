"""The Responses API's stored responses (router/openai_responses.py): what `previous_response_id` continues and
`GET /v1/responses/{id}` returns, kept in the router's memory within `router.response_store_mb`.

A stored response keeps its whole conversation (`context`: every earlier response's input and output items in
order, then its own input), so that a continuation reads one entry, whatever was forgotten since. An entry is
counted at the size of its JSON, its context whole, though later entries share their items with it: the count can
only overstate the memory held. The least recently stored or read goes first when the budget is full."""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

from router.openai_errors import ApiError


@dataclass
class Stored:
    response: dict  # the response object, as it was answered
    context: list[dict]  # the input items of the conversation it answered, earlier responses' output included

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

    def put(self, response: dict, context: list[dict]) -> bool:
        """Keep `response` (answering `context`), forgetting the least recently used to make room; False where it
        alone is over the budget (then nothing is forgotten for it)."""
        size = len(json.dumps(response)) + len(json.dumps(context))
        if size > self.budget_bytes:
            return False
        while self.used_bytes + size > self.budget_bytes:
            _, (_, forgotten) = self._entries.popitem(last=False)
            self.used_bytes -= forgotten
        self._entries[response["id"]] = (Stored(response, context), size)
        self.used_bytes += size
        return True

    def get(self, response_id: str, param: str | None = None) -> Stored:
        """The stored response, now the most recently used; a 404 naming why it may be missing where it is not kept."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise self._missing(response_id, param)
        self._entries.move_to_end(response_id)
        return entry[0]

    def delete(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            raise self._missing(response_id, None)
        self.used_bytes -= entry[1]

    def _missing(self, response_id: str, param: str | None) -> ApiError:
        if self.budget_bytes == 0:
            why = "this server stores no responses (router.response_store_mb is 0): send the conversation in input"
        else:
            why = (
                "it was not stored (store: false), was deleted, was forgotten to keep router.response_store_mb, "
                "or another router served it; send the conversation in input"
            )
        code = "previous_response_not_found" if param == "previous_response_id" else "not_found"
        return ApiError(404, f"{param or 'response_id'}: no stored response {response_id!r}: {why}", param=param, code=code)
