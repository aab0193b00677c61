"""router/chat_reply.py: a chat choice's reply read from its output, whole and as it streams: a reasoning model's
thought, the answer as content, tool calls where the tool choice asks for them."""

from __future__ import annotations

import json

import pytest

from router.chat_reply import ChatReply
from router.openai_tools import ToolError
from router.reasoning import TAGS, ReasoningReader, guide_after_thought, thinks
from specfleet.guides import Guide

ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}
PING = {"type": "function", "function": {"name": "ping"}}
THINK, MISTRAL = TAGS["think"], TAGS["mistral"]


def test_auto_without_a_parser_is_refused_saying_what_to_set():
    for choice in (None, "auto"):
        with pytest.raises(ToolError, match="set router.tool_call_parser") as err:
            ChatReply([ADD], choice, parallel=True, parser="")
        assert (err.value.status, err.value.param) == (400, "tool_choice")
    assert ChatReply([ADD], "none", parallel=True, parser="").mode == "none"


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
    single = ChatReply([ADD], "auto", False, "hermes")
    assert single.delta(CALL, None)[0]["tool_calls"][0]["index"] == 0 and single.delta(CALL, "stop") == ({}, "tool_calls")


def streamed(reply: ChatReply, pieces: list[str], finish: str = "stop") -> list:
    out = [reply.delta(piece, None) for piece in pieces]
    return [*out, reply.delta("", finish)]


def test_a_thought_is_the_reply_s_reasoning_whole_and_streamed_before_its_answer_and_calls():
    text = "<think>Add them.</think>Sure." + CALL
    message, finish = ChatReply([ADD], "auto", True, "hermes", ReasoningReader("<user>hi\n<assistant>", THINK)).message(text, "stop")
    assert (message["reasoning"], message["content"], finish) == ("Add them.", "Sure.", "tool_calls")
    deltas = streamed(ChatReply([ADD], "auto", True, "hermes", ReasoningReader("<assistant>", THINK)), list(text))
    assert "".join(d[0].get("reasoning", "") for d in deltas if d) == "Add them."
    assert "".join(d[0].get("content", "") for d in deltas if d) == "Sure."
    assert not any("<" in d[0].get("reasoning", "") + d[0].get("content", "") for d in deltas if d)
    # A template that opens the thought in the prompt: the output starts inside it.
    opened = ChatReply(None, None, True, "", ReasoningReader("<assistant><think>\n", THINK))
    assert opened.message("Hmm.</think>\n\n42", "stop") == ({"content": "\n\n42", "reasoning": "Hmm."}, "stop")
    # Cut by max_tokens inside the thought: all reasoning, no content.
    assert ChatReply(None, None, True, "", ReasoningReader("<assistant>", THINK)).message("<think>Hmm", "length") == (
        {"content": None, "reasoning": "Hmm"},
        "length",
    )
    # Output that does not open a thought is all content, streamed as it comes once it cannot be the tag.
    plain = streamed(ChatReply(None, None, True, "", ReasoningReader("<assistant>", THINK)), ["<", "b>bold"])
    assert plain[0] is None and plain[1] == ({"content": "<b>bold"}, None)


def test_a_chat_guide_leaves_the_thought_as_the_prompt_leaves_it():
    """The prompt opens the thought: the guide starts after its end; the prompt closes it: the guide reads the output
    from its first token; neither: an output may open one where `<think>` is one token (a reasoning model's own)."""
    guide = Guide("regex", "a+")
    one = {"<think>": [7], "</think>": [8, 9]}.__getitem__
    several = {"<think>": [1, 2], "</think>": [8, 9]}.__getitem__
    assert guide_after_thought(guide, "<assistant><think>\n", one, THINK) == Guide("regex", "a+", thought_end=(8, 9))
    assert guide_after_thought(guide, "<assistant><think>\n\n</think>\n\n", one, THINK) == guide
    assert guide_after_thought(guide, "<assistant>", one, THINK) == Guide("regex", "a+", thought_end=(8, 9), thought_open=7)
    assert guide_after_thought(guide, "<assistant>", several, THINK) == guide
    assert guide_after_thought(None, "<think>", one, THINK) is None


def test_magistral_s_thought_tags_are_read():
    """router.reasoning_parser: auto reads the tags the template writes (Magistral's [THINK] and [/THINK])."""
    assert thinks("auto", "{{ '[THINK]' }}...") == MISTRAL and thinks("auto", "<think>") == THINK
    assert thinks("auto", "plain") is None and thinks("none", "<think>") is None and thinks("mistral", None) == MISTRAL
    text = "[THINK]Add them.[/THINK]Sure."
    assert ChatReply(None, None, True, "", ReasoningReader("[INST]hi[/INST]", MISTRAL)).message(text, "stop") == (
        {"content": "Sure.", "reasoning": "Add them."},
        "stop",
    )
    deltas = streamed(ChatReply(None, None, True, "", ReasoningReader("[INST]hi[/INST]", MISTRAL)), list(text))
    assert "".join(d[0].get("reasoning", "") for d in deltas if d) == "Add them."
    assert "".join(d[0].get("content", "") for d in deltas if d) == "Sure."
    one = {"[THINK]": [7], "[/THINK]": [8]}.__getitem__
    assert guide_after_thought(Guide("regex", "a+"), "[/INST]", one, MISTRAL) == Guide("regex", "a+", thought_end=(8,), thought_open=7)
