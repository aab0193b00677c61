"""One chat choice's reply read from its output, whole or as it streams: the thought of a reasoning model
(router/reasoning.py) as `reasoning`, then the answer as content, or as tool calls where the tool choice asks for
them (router/openai_tools.py): a named or required choice's guided output once complete, or with "auto" the calls the
model writes in its family's format (router/tool_parsers.py), each once it closes."""

from __future__ import annotations

from router.openai_tools import NO_PARSER, ToolError, call_json, chosen, tool_calls
from router.reasoning import ReasoningReader
from router.tool_parsers import reader


class ChatReply:
    """tools, tool_choice, parallel: the request's; parser: router.tool_call_parser's ("" none); thought: the reader
    of the reasoning model's thought, or None where the server reads none."""

    def __init__(self, tools: list | None, tool_choice, parallel: bool, parser: str, thought: ReasoningReader | None = None):
        self.tools, self.tool_choice, self.parallel = tools, tool_choice, parallel
        self.mode = chosen(tools, tool_choice)[0]
        if self.mode == "auto" and not parser:
            raise ToolError("tool_choice", NO_PARSER)
        self.calls = reader(parser) if self.mode == "auto" else None
        self.thought = thought
        self.held = ""  # a named or required choice's answer, sent as calls once it is complete
        self.sent = 0  # calls streamed so far (each delta's call index)

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The whole reply's message and finish reason."""
        delta, finish = self.delta(text, finish, whole=True)
        return {"content": None, **delta}, finish

    def delta(self, text: str, finish: str | None, whole: bool = False) -> tuple[dict, str | None] | None:
        """The stream's next delta and finish reason for the output's next text, or None to send nothing yet;
        `whole`: the text is all of it, however it ends (the unary reply)."""
        done = whole or finish is not None
        thought, text = self._split(text, done)
        delta = {"reasoning": thought} if thought else {}
        if self.mode == "none":
            if text or (whole and not thought):
                delta["content"] = text
            return (delta, finish) if delta or done else None
        if self.mode == "auto":
            content, calls = self.calls.feed(text)
            if done:
                rest, more = self.calls.finish()
                content, calls = content + rest, calls + more
            calls = calls if self.parallel else calls[: max(0, 1 - self.sent)]
            if content or (whole and not calls):
                delta["content"] = content
            if calls:
                delta["tool_calls"] = [{**({} if whole else {"index": self.sent + i}), **call_json(*c)} for i, c in enumerate(calls)]
                self.sent += len(calls)
            finish = "tool_calls" if done and self.sent else finish
            return (delta, finish) if delta or done else None
        self.held += text
        if not done:
            return (delta, finish) if delta else None
        calls = tool_calls(self.tools, self.tool_choice, self.held) if finish == "stop" else None
        if not calls:
            return {**delta, "content": self.held}, finish
        if not whole:
            for i, call in enumerate(calls):
                call["index"] = i
        return {**delta, "tool_calls": calls}, "tool_calls"

    def _split(self, text: str, done: bool) -> tuple[str, str]:
        """(thought, answer) of the output's next text."""
        if self.thought is None:
            return "", text
        thought, answer = self.thought.feed(text)
        if done:
            more, rest = self.thought.finish()
            thought, answer = thought + more, answer + rest
        return thought, answer
