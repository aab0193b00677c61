"""OpenAI's function calling on chat, by structured output (specfleet/guides.py), as vLLM serves a named or required
tool_choice.

The tools go to the chat template (`tools`), as every template that knows them expects. A named function
(`tool_choice: {"type": "function", "function": {"name": ...}}`) guides the output by that function's `parameters`
schema: the whole output is its arguments. `tool_choice: "required"` guides it by a JSON array of at least one call
(at most one where `parallel_tool_calls` is false), each an object of a tool's `name` and its `parameters`. The
reply then carries `tool_calls` instead of content. `"none"` decodes text as without tools. `"auto"`, OpenAI's
default where tools are given, is not guided: the model decides, and its calls are read from its text in its
family's format (router/tool_parsers.py).
"""

from __future__ import annotations

import json
import uuid

from router.openai_errors import ApiError
from specfleet.guides import Guide

# Why "auto" is refused where no parser reads the target's tool calls (router.tool_call_parser).
NO_PARSER = (
    '"auto" (the default where tools are given) reads tool calls from the model\'s text, and no parser knows this '
    "target's format (its chat template names none): set router.tool_call_parser to hermes or llama3_json, or send "
    '"required", a named function ({"type": "function", "function": {"name": ...}}) or "none"'
)

# A function's parameters where it declares none: any object.
NO_PARAMETERS = {"type": "object", "properties": {}}


class ToolError(ApiError):
    """A tools or tool_choice field specfleet cannot serve: a 400 naming it."""

    def __init__(self, param: str, message: str):
        super().__init__(400, f"{param}: {message}", param=param)


def functions(tools: list | None) -> dict[str, dict]:
    """The request's functions by name, each its `function` object; a ToolError names a malformed one."""
    out = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(function, dict)):
            raise ToolError("tools", f'tools[{i}]: must be {{"type": "function", "function": {{...}}}}')
        name = function.get("name")
        if not (isinstance(name, str) and name):
            raise ToolError("tools", f"tools[{i}].function.name: a non-empty string is required")
        if name in out:
            raise ToolError("tools", f"tools[{i}].function.name: {name!r} is named twice")
        if not isinstance(function.get("parameters", NO_PARAMETERS), dict):
            raise ToolError("tools", f"tools[{i}].function.parameters: must be a JSON schema (an object)")
        out[name] = function
    return out


def chosen(tools: list | None, tool_choice) -> tuple[str, str | None]:
    """(mode, name): mode "none" (text), "auto" (text the model may write calls in), "named" (that function's
    arguments) or "required" (an array of calls)."""
    by_name = functions(tools)
    if tool_choice is None:
        tool_choice = "auto" if by_name else "none"
    if tool_choice == "none":
        return "none", None
    if not by_name:
        raise ToolError("tool_choice", f"{json.dumps(tool_choice)} needs tools")
    if tool_choice in ("required", "auto"):
        return tool_choice, None
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" else None
    if not isinstance(name, str):
        raise ToolError("tool_choice", 'one of "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    if name not in by_name:
        raise ToolError("tool_choice", f"function {name!r} is not among the tools ({', '.join(by_name)})")
    return "named", name


def tool_guide(tools: list | None, tool_choice, parallel: bool) -> Guide | None:
    """The guide the tool choice asks for, or None (text)."""
    mode, name = chosen(tools, tool_choice)
    by_name = functions(tools)
    # Arguments are read by programs: JSON without whitespace (none a small model could fill max_tokens with).
    if mode == "named":
        return Guide("json", json.dumps(by_name[name].get("parameters", NO_PARAMETERS)), compact=True)
    if mode == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [n]}, "parameters": f.get("parameters", NO_PARAMETERS)},
                "required": ["name", "parameters"],
            }
            for n, f in by_name.items()
        ]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not parallel:
            schema["maxItems"] = 1
        return Guide("json", json.dumps(schema), compact=True)
    return None


def tool_calls(tools: list | None, tool_choice, text: str) -> list[dict] | None:
    """The reply's tool_calls from its text, or None where the choice is text or the output does not parse (cut by
    max_tokens before its JSON closed: the text is then the reply's content)."""
    mode, name = chosen(tools, tool_choice)
    if mode not in ("named", "required"):
        return None
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    if mode == "required" and not (isinstance(parsed, list) and all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in parsed)):
        return None  # not the guide's array (a stop string cut it, say): the text is the reply's content
    # A named function's arguments are the output as generated; each call of an array its parameters re-serialised.
    calls = [(name, text)] if mode == "named" else [(call["name"], json.dumps(call.get("parameters", {}))) for call in parsed]
    return [call_json(n, arguments) for n, arguments in calls]


def call_json(name: str, arguments: str) -> dict:
    """One tool call as the chat API writes it; `arguments` is JSON text."""
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function", "function": {"name": name, "arguments": arguments}}
