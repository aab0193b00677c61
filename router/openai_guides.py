"""Structured output over the OpenAI API: the guide (specfleet/guides.py) that a request's response_format,
structured_outputs or tool choice (router/openai_tools.py) asks for. `body` is a completions or chat request
(router/openai_schema.py, which imports this module)."""

from __future__ import annotations

import json

from router.openai_errors import ApiError, unsupported
from router.openai_tools import tool_guide
from specfleet.guides import Guide

# vLLM's structured_outputs keys specfleet serves, each naming a guide kind (specfleet/guides.py).
STRUCTURED_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json"}
# vLLM's structured_outputs options besides the guide: kept apart from the kinds.
STRUCTURED_OPTIONS = ("disable_any_whitespace",)
ANY_OBJECT = json.dumps({"type": "object"})


def guide_of(body) -> Guide | None:
    """The guide a request's tool choice, response_format or structured_outputs asks for (one of them), or None; a 400
    names the field that is malformed. Whether the guide compiles is checked on admission (router/validation.py)."""
    tools = tool_guide_of(body)
    if tools is not None and (body.structured_outputs or body.response_format not in (None, {"type": "text"})):
        why = "a tool choice guides the output: send no response_format or structured_outputs with it"
        raise ApiError(400, f"tool_choice: {why}", param="tool_choice")
    if tools is not None:
        return tools
    structured = body.structured_outputs or {}
    compact = bool(structured.get("disable_any_whitespace"))
    asked = [key for key, value in structured.items() if value not in (None, False) and key not in STRUCTURED_OPTIONS]
    fmt = body.response_format if body.response_format != {"type": "text"} else None
    if asked and fmt is not None:
        raise ApiError(400, "structured_outputs: set it or response_format, not both", param="structured_outputs")
    if asked:
        others = [key for key in asked if key not in STRUCTURED_KINDS]
        if others:
            raise unsupported(f"structured_outputs.{others[0]}", f"specfleet serves one of {', '.join(STRUCTURED_KINDS)}")
        if len(asked) != 1:
            raise ApiError(400, f"structured_outputs: set exactly one of {', '.join(STRUCTURED_KINDS)}", param="structured_outputs")
        key, value = asked[0], structured[asked[0]]
        if key in ("json", "json_object"):
            return Guide("json", ANY_OBJECT if key == "json_object" else value if isinstance(value, str) else json.dumps(value), compact)
        if key == "choice":
            return Guide("choice", json.dumps(value))
        if not isinstance(value, str):
            raise ApiError(400, f"structured_outputs.{key}: must be a string", param=f"structured_outputs.{key}")
        return Guide(key, value)
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return Guide("json", ANY_OBJECT, compact)
    if kind != "json_schema":
        raise ApiError(400, f"response_format.type: one of text, json_object, json_schema, got {kind!r}", param="response_format")
    schema = fmt["json_schema"].get("schema") if isinstance(fmt.get("json_schema"), dict) else None
    if not isinstance(schema, dict):
        raise ApiError(400, "response_format.json_schema.schema: a JSON schema (an object) is required", param="response_format")
    return Guide("json", json.dumps(schema), compact)


def tool_guide_of(body) -> Guide | None:
    """The guide a chat request's tool choice asks for (router/openai_tools.py), or None; a 400 names the field."""
    if not hasattr(body, "tool_choice"):  # a completions request: no tools
        return None
    return tool_guide(body.tools, body.tool_choice, body.parallel_tool_calls)
