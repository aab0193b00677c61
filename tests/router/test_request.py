"""A request's state in the router (router/request.py): its output text as decoding the whole output gives, and the
session mirror's diff."""

from __future__ import annotations

import random

import pytest

from router.request import RequestSpec, RequestState, SessionMirror
from specfleet.sampling import SamplingParams
from specfleet.tokenizer import Tokenizer
from tests.harness import REPO

TEXT = "def f(x):\n    return x  # naïve, 日本語 😀 déjà vu — «quoted» ünïcödé\n\tkey: value, [1, 2, 3]\n"


def _state(tokenizer, prompt_ids, stop=()) -> RequestState:
    spec = RequestSpec("r", "s", list(prompt_ids), 10_000, SamplingParams(), list(stop), False, 0, "")
    return RequestState(spec, tokenizer, eos_token_id=-1, max_context=100_000, deadline=None)


class Counted:
    """A tokenizer that remembers the longest run of ids it was asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def decode(self, ids, skip_special_tokens=False):
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text, add_special_tokens=False):
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def __len__(self):
        return len(self.tokenizer)


class Metaspace:
    """A sentencepiece-style tokenizer (Llama 2, Mistral): a token's leading space decodes by what precedes it, so a
    token decoded alone loses it. Trained here on TEXT."""

    def __init__(self):
        from tokenizers import Tokenizer as Backend
        from tokenizers import decoders, models, pre_tokenizers, trainers

        self.backend = Backend(models.BPE(unk_token="<unk>"))
        self.backend.pre_tokenizer = pre_tokenizers.Metaspace()
        self.backend.decoder = decoders.Metaspace()
        self.backend.train_from_iterator([TEXT] * 5, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>"]))

    def decode(self, ids, skip_special_tokens=False):
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text, add_special_tokens=False):
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __len__(self):
        return self.backend.get_vocab_size()


def _tokenizers(random_family):
    return [Tokenizer(REPO / "models" / "demo" / "tokenizer"), Tokenizer(random_family["target"]), Metaspace()]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["demo", "random-family", "metaspace"])
def test_incremental_text_is_the_whole_outputs_decoding(random_family, which):
    """Whatever the tokens and however they arrive; and each commit decodes a few tokens, not the whole output."""
    tokenizer = Counted(_tokenizers(random_family)[which])
    rng = random.Random(which)
    ids = tokenizer.encode(TEXT * 6, add_special_tokens=False)
    assert tokenizer.decode(ids) == TEXT * 6
    for trial in range(30):
        # The text's own tokens, or random ids (incomplete UTF-8 sequences, byte tokens, special tokens).
        text_tokens = trial % 2 == 0
        output = ids if text_tokens else [rng.randrange(len(tokenizer)) for _ in range(80)]
        state = _state(tokenizer, ids[:5])
        at, longest = 0, 0
        while at < len(output):
            step = rng.randint(1, 5)
            tokenizer.longest = 0
            state.commit(output[at : at + step])
            at += step
            longest = max(longest, tokenizer.longest)
            assert state.text == tokenizer.decode(output[:at], skip_special_tokens=True), (trial, at)
        if text_tokens:  # the context, a step and the tokens of characters still incomplete: a fraction of the output
            assert longest <= 32 < len(output) // 2, (trial, longest, len(output))


def test_a_stop_string_cuts_the_text_and_tokens(random_family):
    tokenizer = _tokenizers(random_family)[0]
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    state = _state(tokenizer, ids[:3], stop=["return"])
    for i in range(len(ids)):
        state.commit([ids[i]])
        if state.finish_reason:
            break
    assert state.finish_reason == "stop" and state.text == "def f(x):\n    "
    assert "return" in tokenizer.decode(state.output_ids) and "return" not in tokenizer.decode(state.output_ids[:-1])


@pytest.mark.parametrize("step", [1, 1000], ids=["token by token", "all at once"])
def test_include_stop_str_in_output_keeps_the_stop_string_that_ended_the_text(random_family, step):
    tokenizer = _tokenizers(random_family)[0]
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    state = _state(tokenizer, ids[:3], stop=["return", "ret", "x  #"])
    state.spec.include_stop_str_in_output = True
    for i in range(3, len(ids), step):
        state.commit(ids[i : i + step])
        if state.finish_reason:
            break
    # "ret" and "return" start at one place: the first found, the shorter, ends the text with it.
    whole = tokenizer.decode(ids[3:])
    assert state.finish_reason == "stop" and state.text == whole[: whole.index("ret") + len("ret")]


def test_special_tokens_text_is_left_out_unless_asked_for(random_family):
    tokenizer = _tokenizers(random_family)[0]
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("def f", add_special_tokens=False)
    texts = {}
    for skip in (True, False):
        state = _state(tokenizer, ids[:1], stop=())
        state.spec.skip_special_tokens = skip
        state.commit([*ids[1:], eos, *ids[1:]])
        texts[skip] = state.text
    special = tokenizer.decode([eos])
    assert (
        special and texts[True] == tokenizer.decode(ids[1:] * 2) and texts[False] == tokenizer.decode(ids[1:]) + special + tokenizer.decode(ids[1:])
    )


@pytest.mark.parametrize("step", [1, 1000], ids=["token by token", "all at once"])
def test_the_token_that_ends_the_output_is_in_its_ids_and_in_its_text_only_where_asked(random_family, step):
    """End of sequence (its text kept: skip_special_tokens false) or a stop token ends the output: the ids keep it, the
    text leaves it out as vLLM's does, unless include_stop_str_in_output asks for it."""
    tokenizer = _tokenizers(random_family)[0]
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    eos, stop = tokenizer.eos_token_id, ids[8]
    for ender, include in ((eos, False), (eos, True), (stop, False), (stop, True)):
        state = _state(tokenizer, ids[:3])
        state.eos_token_id, state.spec.stop_at_eos, state.spec.stop_token_ids = eos, True, [stop]
        state.spec.skip_special_tokens, state.spec.include_stop_str_in_output = False, include
        output = [*ids[3:8], ender, *ids[9:]]
        for i in range(0, len(output), step):
            state.commit(output[i : i + step])
            if state.finish_reason:
                break
        assert state.output_ids == output[:6] and state.finish_reason == ("eos" if ender == eos else "stop")
        assert state.text == tokenizer.decode(output[: 6 if include else 5]), (ender, include)
        assert include or state.take_chunk().text == tokenizer.decode(output[:5])


@pytest.mark.parametrize("step", [1, 8, 1000], ids=["token by token", "8 a commit", "all at once"])
def test_a_stop_string_counts_only_past_the_first_min_tokens_tokens(random_family, step):
    """With min_tokens, a stop string in the output's first min_tokens tokens does not end it, however the tokens
    arrive (a commit of several passes' tokens may cross min_tokens); its next occurrence does, and the tokens are
    cut after the one that completed it."""
    tokenizer = _tokenizers(random_family)[0]
    ids = tokenizer.encode(TEXT + TEXT, add_special_tokens=False)
    state = _state(tokenizer, ids[:3], stop=["return"])
    first = next(n for n in range(1, len(ids)) if "return" in tokenizer.decode(ids[3 : 3 + n]))
    state.spec.min_tokens = first + 2
    for i in range(3, len(ids), step):
        state.commit(ids[i : i + step])
        if state.finish_reason:
            break
    assert state.finish_reason == "stop" and state.text.count("return") == 1
    assert tokenizer.decode(state.output_ids).count("return") == 2 and tokenizer.decode(state.output_ids[:-1]).count("return") == 1


def test_the_mirror_sends_what_the_server_lacks():
    mirror = SessionMirror()
    assert mirror.diff([1, 2, 3]) == (0, [1, 2, 3])
    mirror.held = [1, 2, 3]
    assert mirror.diff([1, 2, 3, 4, 5]) == (3, [4, 5])
    assert mirror.diff([1, 2, 9, 4]) == (2, [9, 4])
    assert mirror.diff([7, 2, 3]) == (0, [7, 2, 3])
    assert mirror.diff([1, 2]) == (2, [])
