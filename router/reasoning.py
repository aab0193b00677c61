"""A reasoning model's thinking told apart from its answer, as vLLM's reasoning parsers tell them: the text between
a thought's tags (`<think>` and `</think>`; Mistral's Magistral: `[THINK]` and `[/THINK]`) is a chat reply's
`reasoning`, the rest its content (where tool calls are then read).

One reader covers both ways templates start a thought: DeepSeek R1's write the opening tag at the end of the
generation prompt, so the output opens inside the thought; Qwen 3's and Magistral's leave it to the model, whose
output then opens with the tag. Output that does neither is all content. A thought that max_tokens cuts before its
closing tag is all reasoning.
"""

from __future__ import annotations

import dataclasses

from router.request import partial_tail
from specfleet.config.router import REASONING_PARSERS
from specfleet.guides import Guide


@dataclasses.dataclass(frozen=True)
class Tags:
    """A family's thought tags, as text."""

    open: str
    close: str


# By router.reasoning_parser's name; "auto" takes the first whose opening tag the chat template writes.
TAGS = {"think": Tags("<think>", "</think>"), "mistral": Tags("[THINK]", "[/THINK]")}


def thinks(setting: str, chat_template: str | None) -> Tags | None:
    """The thought tags `router.reasoning_parser` reads, or None where it reads no thoughts: "auto" reads the tags
    the chat template writes."""
    assert setting in REASONING_PARSERS, setting
    if setting in TAGS:
        return TAGS[setting]
    if setting == "auto":
        return next((tags for tags in TAGS.values() if tags.open in (chat_template or "")), None)
    return None


def special_tags(tokenizer, tags: Tags | None) -> bool:
    """Whether the target's tokenizer drops the tags' text where it skips special tokens (Magistral's are special
    tokens): then a chat's output keeps special tokens' text, or the reader would never see them (vLLM's parsers
    read them so too)."""

    def dropped(tag: str) -> bool:
        return tag not in tokenizer.decode(tokenizer.encode(tag, add_special_tokens=False), skip_special_tokens=True)

    return tags is not None and (dropped(tags.open) or dropped(tags.close))


def guide_after_thought(guide: Guide | None, prompt: str, encode, tags: Tags) -> Guide | None:
    """A chat request's guide as vLLM applies it to a reasoning model: to the answer after the thought, which it leaves
    alone. `prompt` is the rendered chat, `encode` the target's tokenizer's (text to ids). Where the prompt opens the
    thought the output starts inside it; where the prompt closes it (a template's "no thinking") the guide reads the
    output from its first token; elsewhere an output that opens with the opening tag thinks first, where that is one
    token (a reasoning model's own), and is guided from its first token otherwise."""
    if guide is None or prompt.rstrip().endswith(tags.close):
        return guide
    end = tuple(encode(tags.close))
    if prompt.rstrip().endswith(tags.open):
        return dataclasses.replace(guide, thought_end=end)
    opens = encode(tags.open)
    return dataclasses.replace(guide, thought_end=end, thought_open=opens[0]) if len(opens) == 1 else guide


class ReasoningReader:
    """One choice's output, as it streams, split into (reasoning, content); `prompt` is the rendered chat."""

    def __init__(self, prompt: str, tags: Tags):
        self.tags = tags
        # "open": nothing but blanks yet, so the output may still open with the tag; "inside": in the thought.
        self.state = "inside" if prompt.rstrip().endswith(tags.open) else "open"
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        return self._read(text, final=False)

    def finish(self) -> tuple[str, str]:
        return self._read("", final=True)

    def _read(self, text: str, final: bool) -> tuple[str, str]:
        if self.state == "content":
            return "", text
        self.buffer += text
        opening, closing = self.tags.open, self.tags.close
        if self.state == "open":
            head = self.buffer.lstrip()
            if head.startswith(opening):
                self.state, self.buffer = "inside", head[len(opening) :]
            elif final or not opening.startswith(head):
                self.state, content, self.buffer = "content", self.buffer, ""
                return "", content
            else:
                return "", ""  # blanks, or the start of the tag: undecided
        end = self.buffer.find(closing)
        if end >= 0:
            reasoning, content = self.buffer[:end], self.buffer[end + len(closing) :]
            self.state, self.buffer = "content", ""
            return reasoning, content
        keep = 0 if final else partial_tail(self.buffer, closing)
        reasoning, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
        return reasoning, ""
