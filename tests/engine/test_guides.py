"""specfleet/engine/guides.py: a session's matcher follows its output as the router rolls it forward and back, and
gives each row the mask of the grammar after the output and the row's own path; specfleet/guides.py compiles for
specfleet's own tokenizer as for transformers'."""

from __future__ import annotations

import json

import pytest
import torch

from specfleet.engine.guides import GuideState, mask_rows, unpack
from specfleet.guides import Guide, GuideCompiler
from specfleet.tokenizer import load_tokenizer

GUIDE = Guide("choice", json.dumps(["the cat sat", "the dog ran", "a bird"]))


@pytest.fixture(scope="module")
def compiler(random_family) -> GuideCompiler:
    tokenizer = load_tokenizer(str(random_family["target"]))
    return GuideCompiler(tokenizer, len(tokenizer), tokenizer.eos_token_id)


def _encode(compiler: GuideCompiler, text: str) -> list[int]:
    return compiler.tokenizer.encode(text, add_special_tokens=False)


def allowed(state: GuideState, output: list[int], paths: list[list[int]]) -> torch.Tensor | None:
    """[len(paths), vocab] bool: the state's bitmask unpacked (None: nothing masked)."""
    bitmask = state.bitmask(output, paths)
    return None if bitmask is None else unpack(bitmask, state.vocab_size)


def _fresh(compiler: GuideCompiler, output: list[int], paths: list[list[int]]) -> torch.Tensor:
    return allowed(GuideState(GUIDE, compiler.compile(GUIDE), compiler.vocab_size), output, paths)


def test_the_mask_after_a_rollback_is_that_of_a_matcher_fed_only_what_is_left(compiler):
    cat, dog = _encode(compiler, "the cat sat"), _encode(compiler, "the dog ran")
    state = GuideState(GUIDE, compiler.compile(GUIDE), compiler.vocab_size)
    allowed(state, cat[:-1], [[]])
    for output in (dog[:2], dog[:1], cat[:2], dog[:-1], []):
        assert torch.equal(allowed(state, output, [[]]), _fresh(compiler, output, [[]])), output


def test_each_row_is_masked_after_its_own_path_and_a_row_past_a_disallowed_token_allows_everything(compiler):
    cat = _encode(compiler, "the cat sat")
    state = GuideState(GUIDE, compiler.compile(GUIDE), compiler.vocab_size)
    paths = [[], cat[:1], cat[:2], [cat[0], _encode(compiler, "z")[0]]]
    masks = allowed(state, [], paths)
    for r, path in enumerate(paths[:3]):
        assert torch.equal(masks[r], _fresh(compiler, path, [[]])[0]), path
    assert masks[3].all(), "no emitted token comes from a row whose path the grammar disallows"
    assert masks[0].sum() < compiler.vocab_size and masks[1].sum() < masks[0].sum() + compiler.vocab_size


def test_an_output_that_left_the_grammar_is_unmasked_until_rolled_back_into_it(compiler):
    cat = _encode(compiler, "the cat sat")
    eos = compiler.eos_token_id
    state = GuideState(GUIDE, compiler.compile(GUIDE), compiler.vocab_size)
    assert allowed(state, cat + [eos], [[]]) is None, "a completed grammar masks nothing (past end of sequence)"
    assert allowed(state, cat + [eos, 5], [[]]) is None
    assert torch.equal(allowed(state, cat[:1], [[]]), _fresh(compiler, cat[:1], [[]]))


def test_specfleet_s_tokenizer_and_transformers_compile_the_same_grammar(random_family, compiler):
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(random_family["target"]))
    other = GuideCompiler(theirs, compiler.vocab_size, compiler.eos_token_id)
    cat = _encode(compiler, "the cat sat")
    for output in ([], cat[:1], cat[:2]):
        mine = allowed(GuideState(GUIDE, compiler.compile(GUIDE), compiler.vocab_size), output, [[]])
        assert torch.equal(mine, allowed(GuideState(GUIDE, other.compile(GUIDE), other.vocab_size), output, [[]]))


def test_a_token_mapped_row_is_masked_as_the_full_row_read_at_its_ids_and_both_kernels_agree(compiler):
    """mask_rows on a drafter's rows over part of the vocabulary (ids_of: each position's id) masks what the full row
    masks at those ids; xgrammar's kernel (float32 on the CPU) and the unpacked bits (any other row) agree."""
    cat = _encode(compiler, "the cat sat")
    bitmask = GuideState(GUIDE, compiler.compile(GUIDE), compiler.vocab_size).bitmask([], [[], cat[:1], cat[:2]])
    full = torch.randn(3, compiler.vocab_size, generator=torch.Generator().manual_seed(0))
    fast, slow = full.clone(), full.double()
    mask_rows(fast, bitmask, None)
    mask_rows(slow, bitmask, None)
    assert torch.equal(fast.double(), slow) and bool(torch.isinf(fast).any()) and bool(torch.isfinite(fast).any(dim=1).all())
    ids_of = torch.randperm(compiler.vocab_size, generator=torch.Generator().manual_seed(1))[: compiler.vocab_size // 2]
    mapped = full[:, ids_of].clone()
    mask_rows(mapped, bitmask, ids_of)
    assert torch.equal(mapped, fast[:, ids_of])


def test_forced_drafts_the_text_the_guide_forces_then_end_of_sequence_once_it_is_complete(compiler):
    one = Guide("choice", json.dumps(["the cat sat"]))
    cat, eos, tokenizer = _encode(compiler, "the cat sat"), compiler.eos_token_id, compiler.tokenizer
    rest = tokenizer.decode(cat)[len(tokenizer.decode(cat[:1])) :]  # the text after the first token

    state = GuideState(one, compiler.compile(one), compiler.vocab_size)
    assert state.forced([], 32, tokenizer) == cat + [eos]
    assert state.forced(cat[:1], 32, tokenizer) == _encode(compiler, rest) + [eos]
    assert state.forced([], 2, tokenizer) == cat[:2]
    assert state.forced(cat, 32, tokenizer) == [eos]  # only end of sequence is allowed: a point mass
    assert GuideState(GUIDE, compiler.compile(GUIDE), compiler.vocab_size).forced([], 32, tokenizer) == []  # "the" or "a"
    # The matcher is where the output left it: the masks after forced() are a fresh state's.
    assert torch.equal(allowed(state, cat[:1], [[]]), allowed(GuideState(one, compiler.compile(one), compiler.vocab_size), cat[:1], [[]]))


def test_allows_counts_the_tokens_the_guide_allows_in_a_row_and_leaves_the_matcher_where_it_was(compiler):
    cat, dog = _encode(compiler, "the cat sat"), _encode(compiler, "the dog ran")
    state = GuideState(GUIDE, compiler.compile(GUIDE), compiler.vocab_size)
    assert state.allows([], cat) == len(cat) and state.allows([], cat + [5]) == len(cat)
    assert state.allows(cat[:1], dog[1:]) == len(dog) - 1 or cat[:1] != dog[:1]
    assert state.allows([], _encode(compiler, "zebra")) == 0
    assert torch.equal(allowed(state, [], [[]]), _fresh(compiler, [], [[]]))


def _thinking(compiler: GuideCompiler, opens: int | None = None) -> GuideState:
    guide = Guide(GUIDE.kind, GUIDE.spec, thought_end=tuple(_encode(compiler, "</think>")), thought_open=opens)
    return GuideState(guide, compiler.compile(guide), compiler.vocab_size)


def test_a_thought_the_output_starts_inside_is_unmasked_and_the_grammar_reads_what_follows_its_end(compiler):
    """The output starts inside the thought: it is unmasked until the thought's end (several tokens here), after which
    each row is masked as the plain guide's after what follows the end; an end a row's path completes counts from that
    row; rolled back into the thought, nothing is masked again; inside it nothing is cut or forced."""
    cat, end, thought = _encode(compiler, "the cat sat"), _encode(compiler, "</think>"), _encode(compiler, "hmm, a cat")
    assert len(end) > 1
    state = _thinking(compiler)
    assert allowed(state, thought, [[], cat[:1]]) is None
    assert torch.equal(allowed(state, thought + end, [[]]), _fresh(compiler, [], [[]]))
    assert torch.equal(allowed(state, thought + end + cat[:1], [[], cat[1:2]]), _fresh(compiler, cat[:1], [[], cat[1:2]]))
    masks = allowed(state, thought + end[:-1], [[], end[-1:], end[-1:] + cat[:1], [5]])
    assert masks[0].all() and masks[3].all(), "rows inside the thought allow every token"
    assert torch.equal(masks[1:3], _fresh(compiler, [], [[], cat[:1]]))
    assert allowed(state, thought, [[]]) is None
    assert state.allows(thought, [5, 6]) == 2 and state.forced(thought, 8, compiler.tokenizer) == []
    assert state.allows(thought + end, cat + [5]) == len(cat)


def test_an_output_that_may_open_a_thought_allows_its_token_first_and_is_guided_from_its_start_without_one(compiler):
    """thought_open set: the first row allows the grammar's tokens and the opening token; an output that starts with
    it is inside a thought until its end; one that does not is guided from its first token."""
    cat, end, thought = _encode(compiler, "the cat sat"), _encode(compiler, "</think>"), _encode(compiler, "hmm")
    opens = _encode(compiler, "z")[0]
    state = _thinking(compiler, opens)
    first = allowed(state, [], [[], [opens], [opens, *end], cat[:1]])
    plain = _fresh(compiler, [], [[], cat[:1]])
    assert first[0, opens] and not plain[0, opens]
    assert torch.equal(first[0].clone().index_fill_(0, torch.tensor([opens]), False), plain[0])
    assert first[1].all() and torch.equal(first[2], plain[0]) and torch.equal(first[3], plain[1])
    assert allowed(state, [opens, *thought], [[]]) is None
    assert torch.equal(allowed(state, [opens, *thought, *end, *cat[:1]], [[]]), _fresh(compiler, cat[:1], [[]]))
    assert torch.equal(allowed(state, cat[:1], [[]]), _fresh(compiler, cat[:1], [[]]))
    assert state.allows([], [5]) == 1 and state.forced([], 8, compiler.tokenizer) == []
    assert Guide("regex", "a", thought_open=opens).problem() == "thought_open needs thought_end: the tokens that end the thought it opens"
