"""router/openai_tools.py: which tool choice a request makes, the guide each asks for, and the tool calls read back
from the guided output (or the text left as content where it is not a complete call)."""

from __future__ import annotations

import json

import pytest

from router.openai_tools import ChatReply, ToolError, chosen, tool_calls, tool_guide

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
PING = {"type": "function", "function": {"name": "ping"}}


def test_each_tool_choice_picks_its_mode_and_auto_without_a_parser_is_refused_saying_what_to_set():
    assert chosen(None, None) == ("none", None)
    assert chosen([ADD], "none") == ("none", None)
    assert chosen([ADD, PING], "required") == ("required", None)
    assert chosen([ADD, PING], {"type": "function", "function": {"name": "ping"}}) == ("named", "ping")
    assert chosen([ADD], None) == chosen([ADD], "auto") == ("auto", None)
    assert tool_guide([ADD], "auto", parallel=True) is None  # the model decides: nothing guided
    for choice in (None, "auto"):
        with pytest.raises(ToolError, match="set router.tool_call_parser") as err:
            ChatReply([ADD], choice, parallel=True, parser="")
        assert (err.value.status, err.value.param) == (400, "tool_choice")


CALL = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'


def test_auto_replies_carry_the_calls_read_from_the_text_whole_and_streamed():
    message, finish = ChatReply([ADD, PING], "auto", True, "hermes").message("Sure." + CALL + CALL, "stop")
    assert finish == "tool_calls" and message["content"] == "Sure."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [("add", {"a": 1})] * 2
    assert ChatReply([ADD], "auto", True, "hermes").message("No call.", "length") == ({"content": "No call."}, "length")
    # Streamed: content as it comes, each call once complete with its index, the finish reason tool_calls.
    reply, deltas = ChatReply([ADD, PING], "auto", True, "hermes"), []
    for piece in ["Sure.", CALL[:7], CALL[7:], CALL[:20], CALL[20:]]:
        deltas.append(reply.delta(piece, None))
    deltas.append(reply.delta("", "stop"))
    assert deltas[0] == ({"content": "Sure."}, None) and deltas[1] is None
    indices = [call["index"] for delta in deltas if delta for call in delta[0].get("tool_calls", [])]
    assert indices == [0, 1] and deltas[-1] == ({}, "tool_calls")
    # parallel_tool_calls false: the first call only, whole or streamed.
    single = ChatReply([ADD], "auto", False, "hermes")
    assert len(single.message(CALL + CALL, "stop")[0]["tool_calls"]) == 1
    assert single.delta(CALL, None)[0]["tool_calls"][0]["index"] == 0 and single.delta(CALL, "stop") == ({}, "tool_calls")


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
