"""Tool calls read from the model's own text where a chat request's tool_choice is "auto", as vLLM's tool-call
parsers read them: no guide, the model decides whether to call, and each family writes calls its own way.

- hermes (Qwen 2.5 and 3, Hermes, and the many templates that copy them): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; text before the first call is the reply's content.
- llama3_json (Llama 3.1 and later): output that opens with a JSON object is calls, `{"name": ..., "parameters": {...}}`
  separated by `;`; any other output is content.
- pythonic (Llama 3.2 and 4, and models trained on that form): output that opens with `[` is a Python list of calls,
  `[get_weather(city="Paris"), get_time()]`, their arguments literals; any other output is content.
- mistral (Mistral 7B v0.3, Nemo, Small, Large): text before `[TOOL_CALLS]` is content, after it the calls, a JSON list
  of `{"name", "arguments"}` (v3 tokenizers) or `name[ARGS]{...}` each after its own `[TOOL_CALLS]` (v11 and later).

Hermes' and Mistral's tags are special tokens in some vocabularies, whose text the output leaves out by default: a
request these parsers read keeps special tokens' text (`KEEP_SPECIAL_TOKENS`), as vLLM's parsers ask.

A reader follows one choice's output as it streams (`feed`, then `finish`): content is released as soon as it cannot
be the start of a call, a call once it is complete. Text that looks like a call and is not (JSON that does not parse,
no name) stays content, so nothing the model wrote is lost.
"""

from __future__ import annotations

import ast
import json

from router.request import partial_tail
from specfleet.config.router import TOOL_CALL_PARSERS

# What a chat template says that names its family's format, in the order they are tried.
# The pythonic one is the example of the form its templates give the model ("[func_name1(params_name1=...").
TEMPLATE_MARKS = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"), ("[TOOL_CALLS]", "mistral"), ("[func_name1(", "pythonic"))
KEEP_SPECIAL_TOKENS = ("hermes", "mistral")


def parser_for(setting: str, chat_template: str | None) -> str:
    """The parser `router.tool_call_parser` names ("" where none): "auto" picks it by what the chat template writes."""
    assert setting in TOOL_CALL_PARSERS, setting
    if setting != "auto":
        return "" if setting == "none" else setting
    return next((name for mark, name in TEMPLATE_MARKS if mark in (chat_template or "")), "")


def reader(parser: str):
    """A new reader of one choice's output in `parser`'s format."""
    return {"hermes": HermesReader, "llama3_json": Llama3JsonReader, "pythonic": PythonicReader, "mistral": MistralReader}[parser]()


def _json(text: str):
    """text's JSON value, or None where it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(call, keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call's JSON value, its arguments under the first of `keys` it has, or None where
    it is not a call."""
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]):
        return None
    arguments = next((call[k] for k in keys if k in call), {})
    return (call["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None


class HermesReader:
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.buffer = ""  # text not yet released: a call being written, or what may begin one
        self.inside = False  # the buffer is a call's body (its OPEN already read)
        self.called = False  # a call has been read: text between and after calls is content only if not blank
        self.blank = ""  # blank text after a call, content only if more text follows it

    def feed(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        return self._read(text, final=False)

    def finish(self) -> tuple[str, list[tuple[str, str]]]:
        return self._read("", final=True)

    def _read(self, text: str, final: bool) -> tuple[str, list[tuple[str, str]]]:
        self.buffer += text
        content, calls = [], []
        while True:
            if self.inside:
                end = self.buffer.find(self.CLOSE)
                if end < 0 and not final:
                    break
                body = self.buffer if end < 0 else self.buffer[:end]
                call = _call(_json(body), ("arguments", "parameters"))
                if call is not None:
                    calls.append(call)
                    self.called, self.blank = True, ""
                else:  # not a call after all: the model's text, as it wrote it
                    self._content(self.OPEN + body + ("" if end < 0 else self.CLOSE), content)
                self.buffer = "" if end < 0 else self.buffer[end + len(self.CLOSE) :]
                self.inside = False
                continue
            start = self.buffer.find(self.OPEN)
            if start < 0:
                keep = 0 if final else partial_tail(self.buffer, self.OPEN)
                self._content(self.buffer[: len(self.buffer) - keep], content)
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            self._content(self.buffer[:start], content)
            self.buffer = self.buffer[start + len(self.OPEN) :]
            self.inside = True
        return "".join(content), calls

    def _content(self, text: str, out: list[str]) -> None:
        # Between and after calls the model writes newlines: not content (vLLM's reply has none either).
        if self.called:
            self.blank += text
            text, self.blank = (self.blank, "") if self.blank.strip() else ("", self.blank)
        if text:
            out.append(text)


class WholeOutputReader:
    """A format whose calls are the whole output, which opens with `OPENS`: any other output is content, released as
    soon as its first non-blank character says so; calls are read once the output is complete."""

    OPENS = ""

    def __init__(self):
        self.head = ""  # the output until its first non-blank character decides what it is
        self.calls: bool | None = None  # None: undecided; True: the output is calls, buffered whole

    def feed(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        if self.calls is False:
            return text, []
        self.head += text
        if self.calls is None and self.head.strip():
            self.calls = self.head.lstrip().startswith(self.OPENS)
            if not self.calls:
                content, self.head = self.head, ""
                return content, []
        return "", []

    def finish(self) -> tuple[str, list[tuple[str, str]]]:
        text, self.head = self.head, ""
        calls = self.parse(text) if self.calls else None
        return ("", calls) if calls else (text, [])  # not calls after all (cut by max_tokens, say): the content

    def parse(self, text: str) -> list[tuple[str, str]] | None:
        """The calls `text` holds, or None where it is not calls."""
        raise NotImplementedError


class Llama3JsonReader(WholeOutputReader):
    OPENS = "{"

    def parse(self, text: str) -> list[tuple[str, str]] | None:
        decoder, calls, at = json.JSONDecoder(), [], 0
        while True:
            while at < len(text) and (text[at].isspace() or text[at] == ";"):
                at += 1
            if at == len(text):
                return calls
            try:
                obj, at = decoder.raw_decode(text, at)
            except ValueError:
                return None
            call = _call(obj, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)


class PythonicReader(WholeOutputReader):
    OPENS = "["

    def parse(self, text: str) -> list[tuple[str, str]] | None:
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args and all(k.arg for k in node.keywords)):
                return None  # a call by name with keyword arguments alone, as the format writes them
            try:
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
                calls.append((node.func.id, json.dumps(arguments)))
            except (ValueError, TypeError, SyntaxError, RecursionError):
                return None  # an argument that is not a literal (a name, a call), or not JSON (a set, bytes)
        return calls


class MistralReader:
    MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def __init__(self):
        self.buffer = ""  # what may begin the mark, or everything from it on
        self.calls = False  # the mark was read: the rest is calls, read once the output is complete

    def feed(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        self.buffer += text
        if self.calls:
            return "", []
        start = self.buffer.find(self.MARK)
        if start >= 0:
            content, self.buffer, self.calls = self.buffer[:start], self.buffer[start:], True
            return content, []
        keep = partial_tail(self.buffer, self.MARK)
        content, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        return content, []

    def finish(self) -> tuple[str, list[tuple[str, str]]]:
        text, self.buffer = self.buffer, ""
        calls = self.parse(text) if self.calls else None
        return ("", calls) if calls else (text, [])

    def parse(self, text: str) -> list[tuple[str, str]] | None:
        calls = []
        for part in (p.strip() for p in text.split(self.MARK)[1:]):
            if part.startswith("["):  # v3: a JSON list of calls
                items = _json(part)
                found = [_call(item, ("arguments", "parameters")) for item in items] if isinstance(items, list) else [None]
                if None in found:
                    return None
                calls += found
            elif self.ARGS in part:  # v11: name[ARGS]{...}
                name, arguments = part.split(self.ARGS, 1)
                call = _call({"name": name.strip(), "arguments": _json(arguments)}, ("arguments",))
                if call is None:
                    return None
                calls.append(call)
            else:
                return None
        return calls or None
