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


PYTHONIC = '[get_weather(city="Paris"), get_time()]'


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_pythonic_calls_are_a_list_of_calls_by_keyword_read_once_the_output_is_complete(size):
    """An output that opens with "[" is calls once it parses as a list of calls with literal keyword arguments (strings,
    numbers, lists, dicts, True/False/None, as JSON); any other output, or one that is not such a list, is content."""
    assert parser_for("auto", "put it in the format of [func_name1(params_name1=params_value1, ...)]") == "pythonic"
    assert read_all("pythonic", PYTHONIC) == ("", CALLS)
    assert streamed("pythonic", "  " + PYTHONIC, size) == ([], CALLS)
    nested = '[f(a=1, b=[True, None], c={"k": 2.5}, d="x\\ty")]'
    assert read_all("pythonic", nested) == ("", [("f", json.dumps({"a": 1, "b": [True, None], "c": {"k": 2.5}, "d": "x\ty"}))])
    not_calls = ["Paris is sunny.", "[1, 2]", "[f(x)]", "[f(a=g())]", "[f(a={1, 2})]", "[]", '[get_weather(city="Par', "[a.b(c=1)]"]
    for text in not_calls:
        assert read_all("pythonic", text) == (text, []), text
        content, calls = streamed("pythonic", text, 1)
        assert "".join(content) == text and calls == []
    # Content is released as soon as its first non-blank character says it is no call.
    assert streamed("pythonic", "Sunny [f(a=1)]", 1)[0][0] == "S"


V3 = 'Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'
V11 = 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize("text", [V3, V11], ids=["v3", "v11"])
def test_mistral_calls_follow_the_tool_calls_mark_as_a_json_list_or_name_and_args(text, size):
    """Text before [TOOL_CALLS] is content, released as it comes (never a piece of the mark); the calls after it are
    read once the output is complete, a JSON list (v3 tokenizers) or name[ARGS]{...} each (v11); what is not calls
    after the mark is content."""
    assert parser_for("auto", "{{ '[TOOL_CALLS]' + tool_calls | tojson }}") == "mistral"
    assert read_all("mistral", text) == ("Checking. ", CALLS)
    content, calls = streamed("mistral", text, size)
    assert "".join(content) == "Checking. " and calls == CALLS and not any("[" in piece for piece in content)
    for broken in ("a [TOOL_CALLS] [{x", "a [TOOL_CALLS]get_weather", 'a [TOOL_CALLS][{"name": "f"}, {"arguments": {}}]', "a [TOOL_CALLS]f[ARGS][1]"):
        assert read_all("mistral", broken) == (broken, []), broken
    assert read_all("mistral", "no calls, a lone [TOOL") == ("no calls, a lone [TOOL", [])
