"""xgrammar's own mask as a transformers logits processor for one sequence: the reference that specfleet's guided
output is checked against, by the bench (`--json-schema`: tools/bench/systems.py) and by the tests. It calls
xgrammar directly, never specfleet/guides.py, so that it checks that module rather than repeats it."""

from __future__ import annotations

import json
import pathlib


class XgrammarMask:
    """The tokens after the prompt fed to a matcher of the guide (kind and spec as specfleet.guides.Guide's), the
    scores of every token the grammar disallows next set to -inf."""

    _compiled: dict = {}

    def __init__(self, model_path: str | pathlib.Path, vocab_size: int, eos: int, kind: str, spec: str, compact: bool, prompt_tokens: int):
        import xgrammar

        key = (str(model_path), vocab_size, eos, kind, spec, compact)
        if key not in self._compiled:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(model_path))
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos])
            self._compiled[key] = _compile(xgrammar.GrammarCompiler(info), kind, spec, compact)
        self.xgrammar, self.vocab_size = xgrammar, vocab_size
        self.matcher, self.seen = xgrammar.GrammarMatcher(self._compiled[key]), prompt_tokens

    def __call__(self, input_ids, scores):
        for token in input_ids[0, self.seen :].tolist():
            assert self.matcher.accept_token(token), token  # each was generated under this mask
        self.seen = input_ids.shape[1]
        if self.matcher.is_terminated():
            return scores
        bitmask = self.xgrammar.allocate_token_bitmask(1, self.vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask)
        self.xgrammar.apply_token_bitmask_inplace(scores, bitmask.to(scores.device))
        return scores


def _compile(compiler, kind: str, spec: str, compact: bool):
    if kind == "choice":  # one of the strings, each as its JSON literal
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in json.loads(spec)))
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "grammar":
        return compiler.compile_grammar(spec)
    separators = (",", ":") if compact else None  # vLLM's disable_any_whitespace
    return compiler.compile_json_schema(spec, any_whitespace=not compact, separators=separators)
