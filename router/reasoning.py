"""A reasoning model's thinking told apart from its answer, as vLLM's reasoning parsers tell them: the text between
`<think>` and `</think>` is a chat reply's `reasoning`, the rest its content (where tool calls are then read).

One reader covers both ways templates start a thought: DeepSeek R1's write `<think>` at the end of the generation
prompt, so the output opens inside the thought; Qwen 3's leave it to the model, whose output then opens with the tag.
Output that does neither is all content. A thought that max_tokens cuts before `</think>` is all reasoning.
"""

from __future__ import annotations

import dataclasses

from router.request import partial_tail
from specfleet.config.router import REASONING_PARSERS
from specfleet.guides import Guide

OPEN, CLOSE = "<think>", "</think>"


def thinks(setting: str, chat_template: str | None) -> bool:
    """Whether `router.reasoning_parser` reads thoughts: "auto" where the chat template writes the tag."""
    assert setting in REASONING_PARSERS, setting
    return setting == "think" or (setting == "auto" and OPEN in (chat_template or ""))


def guide_after_thought(guide: Guide | None, prompt: str, encode) -> Guide | None:
    """A chat request's guide as vLLM applies it to a reasoning model: to the answer after the thought, which it leaves
    alone. `prompt` is the rendered chat, `encode` the target's tokenizer's (text to ids). Where the prompt opens the
    thought the output starts inside it; where the prompt closes it (a template's "no thinking") the guide reads the
    output from its first token; elsewhere an output that opens with `<think>` thinks first, where that is one token
    (a reasoning model's own), and is guided from its first token otherwise."""
    if guide is None or prompt.rstrip().endswith(CLOSE):
        return guide
    end = tuple(encode(CLOSE))
    if prompt.rstrip().endswith(OPEN):
        return dataclasses.replace(guide, thought_end=end)
    opens = encode(OPEN)
    return dataclasses.replace(guide, thought_end=end, thought_open=opens[0]) if len(opens) == 1 else guide


class ReasoningReader:
    """One choice's output, as it streams, split into (reasoning, content); `prompt` is the rendered chat."""

    def __init__(self, prompt: str):
        # "open": nothing but blanks yet, so the output may still open with the tag; "inside": in the thought.
        self.state = "inside" if prompt.rstrip().endswith(OPEN) else "open"
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        return self._read(text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._read("", final=True)

    def _read(self, text: str, final: bool) -> tuple[str, str]:
        if self.state == "content":
            return "", text
        self.buffer += text
        if self.state == "open":
            head = self.buffer.lstrip()
            if head.startswith(OPEN):
                self.state, self.buffer = "inside", head[len(OPEN) :]
            elif final or not OPEN.startswith(head):
                self.state, content, self.buffer = "content", self.buffer, ""
                return "", content
            else:
                return "", ""  # blanks, or the start of the tag: undecided
        end = self.buffer.find(CLOSE)
        if end >= 0:
            reasoning, content = self.buffer[:end], self.buffer[end + len(CLOSE) :]
            self.state, self.buffer = "content", ""
            return reasoning, content
        keep = 0 if final else partial_tail(self.buffer, CLOSE)
        reasoning, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        return reasoning, ""
