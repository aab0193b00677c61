"""Structured output: a guide (a JSON schema, a regular expression, a list of choices or a grammar) that a request's
output must follow, compiled into a token-level grammar by xgrammar (vLLM's and SGLang's default backend).

A guide travels in `SamplingParams.guide`. The router compiles it once to refuse a bad one by name before anything is
submitted; the verifier and each drafter compile it again (cached) and give every row of their passes the tokens the
grammar allows there (`specfleet/engine/guides.py`): the target's distribution is that of the guided logits, and a
drafter's q is guided alike so that its drafts still match. The output follows the guide until the grammar completes,
where it allows only end of sequence.

xgrammar and torch are imported on first use: the router starts without them, and a process without xgrammar refuses
guided requests with a message that says what to install.
"""

from __future__ import annotations

import importlib.util
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

# What a guide can be: "json" (spec: a JSON schema; {"type": "object"} for OpenAI's json_object), "regex" (spec: a
# pattern the whole output matches), "choice" (spec: a JSON list of strings, the output exactly one of them), "grammar"
# (spec: an EBNF grammar in xgrammar's dialect, GBNF-like, whose rule `root` the output derives).
KINDS = ("json", "regex", "choice", "grammar")
# Longest spec accepted (characters): a compile's time and memory grow with it.
MAX_SPEC_CHARS = 65536
# Compiled grammars kept per process, least recently used dropped first.
CACHED_GRAMMARS = 64


@dataclass(frozen=True)
class Guide:
    kind: str
    spec: str
    # JSON without any whitespace between its tokens, separators "," and ":" (vLLM's disable_any_whitespace): a small
    # model's JSON cannot wander into whitespace it never ends.
    compact: bool = False
    # A reasoning model's thought, which the guide leaves alone: the output follows the guide after it, as vLLM guides
    # a reasoning model's answer. `thought_end`: the token ids that end a thought (`</think>`'s); () where the output
    # has no thought. `thought_open`: None where the output starts inside the thought (the prompt opened it), else the
    # token that opens one: an output whose first token it is thinks first, any other is guided from its first token.
    thought_end: tuple[int, ...] = ()
    thought_open: int | None = None

    def problem(self) -> str | None:
        """What makes this guide malformed before compiling it, or None."""
        if self.thought_open is not None and not self.thought_end:
            return "thought_open needs thought_end: the tokens that end the thought it opens"
        if self.kind not in KINDS:
            return f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
        if len(self.spec) > MAX_SPEC_CHARS:
            return f"a {self.kind} spec must be at most {MAX_SPEC_CHARS} characters, got {len(self.spec)}"
        if self.kind == "choice":
            try:
                choices = json.loads(self.spec)
            except ValueError:
                choices = None
            if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
                return "a choice's spec must be a JSON list of non-empty strings"
        if self.kind == "json":
            try:
                schema = json.loads(self.spec)
            except ValueError as err:
                return f"a json spec must be a JSON schema, which this is not: {err}"
            if not isinstance(schema, dict | bool):
                return "a json spec must be a JSON schema (an object)"
        return None

    @property
    def thought_tokens(self) -> list[int]:
        """Every token id the thought's fields name (each must be in the vocabulary)."""
        return [*self.thought_end, *([] if self.thought_open is None else [self.thought_open])]

    @classmethod
    def from_proto(cls, msg) -> "Guide":
        """From the contract's specfleet.v1.Guide."""
        opens = msg.thought_open if msg.HasField("thought_open") else None
        return cls(msg.kind, msg.spec, msg.compact, tuple(msg.thought_end), opens)


def available() -> bool:
    """Whether this process can compile guides (xgrammar is installed), without importing it."""
    return importlib.util.find_spec("xgrammar") is not None


class GuideError(ValueError):
    """A guide that cannot be compiled, or a process that cannot compile guides; the message says which and why."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise GuideError("structured output needs the xgrammar package in every service's environment (pip install xgrammar)") from None
    return xgrammar


def tokenizer_info(tokenizer, vocab_size: int, eos_token_id: int):
    """xgrammar's view of `tokenizer` (specfleet/tokenizer.py's or transformers'): its vocabulary padded to the model's
    `vocab_size` (ids past the tokenizer's are never allowed), end of sequence as the grammar's stop token."""
    xgr = _xgrammar()
    stop = [eos_token_id] if eos_token_id is not None and eos_token_id >= 0 else None  # None: xgrammar finds them
    # transformers' fast tokenizers hold the `tokenizers` backend as backend_tokenizer, specfleet's as backend.
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "backend", None)
    if not hasattr(backend, "to_str"):
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
    encoded = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab().items():
        if token_id < vocab_size:
            encoded[token_id] = token
    # xgrammar's own reading of the backend's JSON (its from_huggingface does the same) for the vocabulary's encoding:
    # specfleet's tokenizer is not transformers', whose import from_huggingface needs costs the router seconds.
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(backend.to_str())
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=stop,
        add_prefix_space=metadata["add_prefix_space"],
    )


class GuideCompiler:
    """Guides compiled for one tokenizer, the most recent CACHED_GRAMMARS kept. Thread-safe: services compile from
    their worker threads."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int):
        self.tokenizer, self.vocab_size, self.eos_token_id = tokenizer, vocab_size, eos_token_id
        self._compiler = None
        self._compiled: OrderedDict[Guide, object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, guide: Guide):
        """xgrammar's CompiledGrammar of `guide`; a GuideError names what is wrong with it."""
        problem = guide.problem()
        if problem:
            raise GuideError(problem)
        with self._lock:
            guide = Guide(guide.kind, guide.spec, guide.compact)  # the grammar: what a thought does not change
            if guide in self._compiled:
                self._compiled.move_to_end(guide)
                return self._compiled[guide]
            if self._compiler is None:
                try:
                    info = tokenizer_info(self.tokenizer, self.vocab_size, self.eos_token_id)
                except GuideError:
                    raise
                except (RuntimeError, ValueError) as err:
                    raise GuideError(f"structured output cannot read this model's tokenizer: {_reason(err)}") from None
                self._compiler = _xgrammar().GrammarCompiler(info, max_threads=1)
            try:
                compiled = _compile(self._compiler, guide)
            except (RuntimeError, ValueError) as err:
                raise GuideError(f"the {guide.kind} does not compile: {_reason(err)}") from None
            self._compiled[guide] = compiled
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
            return compiled


def _reason(err: Exception) -> str:
    """xgrammar's message without the time and C++ source location it starts with."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", first)


def _compile(compiler, guide: Guide):
    if guide.kind == "json":
        separators = (",", ":") if guide.compact else None
        return compiler.compile_json_schema(guide.spec, any_whitespace=not guide.compact, separators=separators)
    if guide.kind == "regex":
        return compiler.compile_regex(guide.spec)
    if guide.kind == "choice":
        return compiler.compile_regex("|".join(f"({_regex_literal(c)})" for c in json.loads(guide.spec)))
    return compiler.compile_grammar(guide.spec)


def _regex_literal(text: str) -> str:
    """`text` as a regular expression matching it alone: every character but letters, digits and space escaped
    (Python's re.escape leaves some that xgrammar's dialect reads as syntax)."""
    return "".join(c if c.isalnum() or c == " " else f"\\u{ord(c):04x}" if ord(c) < 0x10000 else re.escape(c) for c in text)
