"""router/tool_parsers.py: tool calls read from a model's text in its family's format, whole or as it streams, and
anything that is not a complete call left as the model's text."""

from __future__ import annotations

import json

import pytest

from router.tool_parsers import parser_for, reader

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
HERMES = f'Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>{{"name": "get_time", "arguments": {{}}}}</tool_call>\n'
CALLS = [("get_weather", json.dumps({"city": "Paris"})), ("get_time", "{}")]


def read_all(parser: str, text: str) -> tuple[str, list]:
    """(content, calls) of a whole output, fed at once."""
    r = reader(parser)
    content, calls = r.feed(text)
    rest, more = r.finish()
    return content + rest, calls + more


def streamed(parser: str, text: str, size: int) -> tuple[list[str], list]:
    """Each piece of content as released, and the calls, feeding `text` `size` characters at a time."""
    r, content, calls = reader(parser), [], []
    for at in range(0, len(text), size):
        piece, more = r.feed(text[at : at + size])
        content, calls = content + [piece], calls + more
    piece, more = r.finish()
    return [c for c in content + [piece] if c], calls + more


def test_the_parser_is_the_one_named_or_the_one_the_chat_template_writes():
    assert parser_for("auto", "... Call one as <tool_call>{...}</tool_call>") == "hermes"
    assert parser_for("auto", "{{- '<|python_tag|>' }}") == "llama3_json"
    assert parser_for("auto", "{% for m in messages %}{{ m['content'] }}{% endfor %}") == parser_for("auto", None) == ""
    assert parser_for("none", "<tool_call>") == "" and parser_for("llama3_json", "<tool_call>") == "llama3_json"


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_hermes_calls_are_read_whole_or_streamed_and_no_piece_of_a_tag_is_content(size):
    assert read_all("hermes", HERMES) == ("Let me check.\n", CALLS)
    content, calls = streamed("hermes", HERMES, size)
    assert "".join(content) == "Let me check.\n" and calls == CALLS
    assert not any("<" in piece for piece in content), content


def test_hermes_text_that_is_not_a_call_stays_the_model_s_text():
    for text in ("a <tool_call>{not json}</tool_call> b", "no call, a lone < and <tool", 'cut <tool_call>{"name": "f", "argu'):
        assert read_all("hermes", text) == (text, []), text
        content, calls = streamed("hermes", text, 1)
        assert "".join(content) == text and calls == []
    # A call that max_tokens cuts after its JSON closed, before its closing tag, is a call.
    assert read_all("hermes", f"<tool_call>{WEATHER}") == ("", CALLS[:1])
    # Text after the calls is content, the newlines between them not.
    assert read_all("hermes", HERMES + "Done.")[0] == "Let me check.\n\nDone." and read_all("hermes", HERMES + "\n \n")[0] == "Let me check.\n"


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_llama3_json_calls_are_output_that_opens_with_an_object_and_anything_else_is_content(size):
    text = ' {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    assert read_all("llama3_json", text) == ("", CALLS)
    assert streamed("llama3_json", text, size) == ([], CALLS)
    for other in ("The weather is {fine}.", '{"name": "get_weather", "parameters": {"ci', '{"weather": "fine"}'):
        assert read_all("llama3_json", other) == (other, []), other
        content, calls = streamed("llama3_json", other, size)
        assert "".join(content) == other and calls == []
