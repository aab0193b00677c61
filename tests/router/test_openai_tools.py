"""router/openai_tools.py: which tool choice a request makes, the guide each asks for, and the tool calls read back
from the guided output (or the text left as content where it is not a complete call)."""

from __future__ import annotations

import json

import pytest

from router.openai_tools import ToolError, chosen, tool_calls, tool_guide

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
PING = {"type": "function", "function": {"name": "ping"}}


def test_each_tool_choice_picks_its_mode():
    assert chosen(None, None) == ("none", None)
    assert chosen([ADD], "none") == ("none", None)
    assert chosen([ADD, PING], "required") == ("required", None)
    assert chosen([ADD, PING], {"type": "function", "function": {"name": "ping"}}) == ("named", "ping")
    assert chosen([ADD], None) == chosen([ADD], "auto") == ("auto", None)
    assert tool_guide([ADD], "auto", parallel=True) is None  # the model decides: nothing guided


def test_the_guides_are_the_named_function_s_parameters_and_an_array_of_calls_of_the_tools():
    named = tool_guide([ADD], {"type": "function", "function": {"name": "add"}}, parallel=True)
    assert (named.kind, json.loads(named.spec), named.compact) == ("json", ADD["function"]["parameters"], True)
    required = json.loads(tool_guide([ADD, PING], "required", parallel=False).spec)
    assert required["type"] == "array" and required["minItems"] == 1 and required["maxItems"] == 1
    names = [call["properties"]["name"]["enum"] for call in required["items"]["anyOf"]]
    assert names == [["add"], ["ping"]]
    assert "maxItems" not in json.loads(tool_guide([ADD, PING], "required", parallel=True).spec)
    assert tool_guide([ADD], "none", parallel=True) is None


def test_tool_calls_are_read_from_complete_output_and_anything_else_stays_text():
    named = {"type": "function", "function": {"name": "add"}}
    (call,) = tool_calls([ADD], named, '{"a": 1}')
    assert call["function"] == {"name": "add", "arguments": '{"a": 1}'} and call["type"] == "function"
    calls = tool_calls([ADD, PING], "required", '[{"name": "ping", "parameters": {}}, {"name": "add", "parameters": {"a": 2}}]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("ping", {}), ("add", {"a": 2})]
    assert len({c["id"] for c in calls}) == 2
    assert tool_calls([ADD], named, '{"a": ') is None  # cut before it closed
    assert tool_calls([ADD], "required", "[1, 2]") is None
    assert tool_calls([ADD], "none", '{"a": 1}') is None


@pytest.mark.parametrize(
    "tools, message",
    [
        ([{"type": "retrieval"}], r"tools\[0\]: must be"),
        ([{"type": "function", "function": {"name": ""}}], r"tools\[0\].function.name"),
        ([ADD, ADD], "named twice"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters: must be a JSON schema"),
    ],
)
def test_malformed_tools_are_refused_naming_the_tool(tools, message):
    with pytest.raises(ToolError, match=message):
        tool_guide(tools, "required", parallel=True)
