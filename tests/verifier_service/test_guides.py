"""verifier_service/verifier.py and drafter_service/drafter.py with a request's guide (structured output:
`SamplingParams.guide`): greedy tokens are transformers' `generate` with xgrammar's own mask applied to each step's
logits, on the target and on a draft model; each row of a tree is masked after its own path, so a chain of the guided
tokens is accepted whole and a draft the grammar disallows is rejected; a seeded session's tokens do not depend on the
tree it is offered; the output follows the guide; a guide that does not compile is refused naming it."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoTokenizer, LogitsProcessorList

from drafter_service.drafter import DraftItem, DraftModel, draft_batch
from specfleet.engine import SessionStore, load_model
from specfleet.guides import Guide
from specfleet.sampling import SamplingParams
from tests.helpers import load_target
from tools.bench.guide_mask import XgrammarMask
from verifier_service.server import InvalidArgument
from tests.verifier_service.seeded import assert_emits_plain_tokens_whatever_the_tree
from verifier_service.verifier import Verifier, VerifyItem

STEPS = 8
GUIDES = [
    Guide("choice", json.dumps(["the cat sat", "a dog ran far", "no"])),
    Guide("regex", r"[a-f]{3} [0-9]+\."),
    Guide("json", json.dumps({"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]})),
]


def reference(path: str, prompt: list[int], guide: Guide | None, steps: int = STEPS) -> list[int]:
    """transformers' greedy `generate` of the model at `path` with xgrammar's mask (None: unguided), up to and with
    end of sequence."""
    model, tokenizer = load_target(path)
    eos, vocab = tokenizer.eos_token_id, model.config.vocab_size
    processors = LogitsProcessorList([XgrammarMask(path, vocab, eos, guide.kind, guide.spec, guide.compact, len(prompt))] if guide else [])
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, logits_processor=processors, pad_token_id=eos)
    return out[0, len(prompt) :].tolist()


def _prompt(random_family) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(str(random_family["target"]))
    return tokenizer.encode("Answer briefly: what did the animal do?")


def _verifier(random_family) -> Verifier:
    return Verifier(load_model("target", str(random_family["target"])), SessionStore(1 << 30, 100))


def _guided(prompt: list[int], guide: Guide, **sampling) -> SamplingParams:
    return SamplingParams(**sampling, output_start=len(prompt), guide=guide)


def _decode(random_family, tokens: list[int]) -> str:
    return AutoTokenizer.from_pretrained(str(random_family["target"])).decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("guide", GUIDES, ids=[g.kind for g in GUIDES])
def test_greedy_guided_tokens_are_transformers_own_with_xgrammar_s_mask_and_a_chain_of_them_is_accepted_whole(random_family, guide):
    path, prompt = str(random_family["target"]), _prompt(random_family)
    expected = reference(path, prompt, guide)
    assert expected != reference(path, prompt, None), "the guide changes the greedy tokens"
    (stepped,) = _verifier(random_family).verify_batch([VerifyItem("s", 0, prompt, _guided(prompt, guide), plain_steps=len(expected))])
    assert stepped.token_ids[: len(expected)] == expected
    # Each row is masked after its own path: the chain of all but the last is accepted and the last emitted after it.
    n = len(expected) - 1
    chain = dict(tree_tokens=expected[:n], tree_parents=list(range(-1, n - 1)), proposals=[([t], [1.0]) for t in expected[:n]])
    (tree,) = _verifier(random_family).verify_batch([VerifyItem("s", 0, prompt, _guided(prompt, guide), **chain)])
    assert tree.accepted_nodes == list(range(n)) and tree.token_ids == expected


def test_a_draft_the_guide_disallows_is_rejected_where_the_unguided_target_would_accept_it(random_family):
    path, prompt = str(random_family["target"]), _prompt(random_family)
    unguided = reference(path, prompt, None, steps=2)
    guide = Guide("regex", r"[0-9]+")
    assert not re.fullmatch(r"[0-9]+", _decode(random_family, unguided[:1])), "the unguided target's first token is no digit"
    chain = dict(tree_tokens=unguided[:1], tree_parents=[-1], proposals=[([unguided[0]], [1.0])])
    (plain,) = _verifier(random_family).verify_batch([VerifyItem("s", 0, prompt, SamplingParams(), **chain)])
    assert plain.accepted_nodes == [0]
    (guided,) = _verifier(random_family).verify_batch([VerifyItem("s", 0, prompt, _guided(prompt, guide), **chain)])
    assert guided.accepted_nodes == [] and guided.token_ids == reference(path, prompt, guide, steps=1)


@pytest.mark.parametrize("guide", GUIDES[:2], ids=[g.kind for g in GUIDES[:2]])
def test_the_output_follows_the_guide_to_end_of_sequence(random_family, guide):
    prompt = _prompt(random_family)
    verifier = _verifier(random_family)
    (done,) = verifier.verify_batch([VerifyItem("s", 0, prompt, _guided(prompt, guide), plain_steps=24)])
    eos = verifier.loaded.eos_token_id
    assert eos in done.token_ids, "the grammar completes within 24 tokens and allows end of sequence alone"
    text = _decode(random_family, done.token_ids[: done.token_ids.index(eos)])
    if guide.kind == "choice":
        assert text in json.loads(guide.spec)
    else:
        assert re.fullmatch(guide.spec, text)


def test_a_seeded_guided_session_emits_the_same_tokens_whatever_tree_it_is_offered(random_family):
    """Obligation 6 under a guide: the race reads each row's guided p, so a session offered a tree (its plain tokens,
    or others, some the guide disallows) emits the tokens of plain steps."""
    prompt = _prompt(random_family)
    sampling = _guided(prompt, GUIDES[1], temperature=1.0, seed=5, drafter_invariant=True)
    assert_emits_plain_tokens_whatever_the_tree(lambda: _verifier(random_family), prompt, sampling)


def test_a_draft_model_s_greedy_chain_under_a_guide_is_its_own_guided_generate(random_family):
    path, prompt = str(random_family["drafter-noisy"]), _prompt(random_family)
    model = DraftModel(load_model("d", path, use_token_map=False), SessionStore(1 << 30, 100), proposal_top_k=8)
    expected = reference(path, prompt, GUIDES[1], steps=6)
    item = DraftItem("s", 0, prompt, num_draft_tokens=len(expected), sampling=_guided(prompt, GUIDES[1]))
    (drafted,) = draft_batch({"d": model}, [("d", item)])
    assert drafted.token_ids == expected


@pytest.mark.parametrize(
    "guide, message",
    [
        (Guide("regex", "(ab"), r"session s: the regex does not compile: Regex parsing error .*parenthesis is not closed"),
        (Guide("grammar", "root ::= other"), r'the grammar does not compile: .*Rule "other" is not defined'),
        (Guide("json", "{"), "sampling.guide: a json spec must be a JSON schema, which this is not"),
        (Guide("choice", "[]"), "sampling.guide: a choice's spec must be a JSON list of non-empty strings"),
        (Guide("yaml", "a: 1"), "sampling.guide: kind must be one of json, regex, choice, grammar, got 'yaml'"),
    ],
)
def test_a_guide_that_does_not_compile_is_refused_naming_it(random_family, guide, message):
    from verifier_service.server import VerifierCore

    core = VerifierCore.__new__(VerifierCore)
    core.verifier = _verifier(random_family)
    with pytest.raises(InvalidArgument, match=message):
        core.validated([VerifyItem("s", 0, [1, 2, 3], SamplingParams(guide=guide))])


def test_tokens_the_guide_forces_are_verified_in_one_pass_and_are_the_tokens_of_plain_passes(random_family):
    """In a call of plain steps with the lookup on, where the guide forces what comes next (a choice of one string, a
    JSON schema's punctuation and keys), the verifier drafts it as the pass's tree (`_forced`): the tokens are those
    of one-token passes (the random target often tokenizes the forced text otherwise: those drafts are rejected), and
    fewer passes emit them."""
    prompt = _prompt(random_family)
    for guide in (Guide("choice", json.dumps(["the quick brown fox jumps"])), Guide("json", GUIDES[2].spec, compact=True)):
        plain = []
        verifier = _verifier(random_family)
        while not plain or (plain[-1] != verifier.loaded.eos_token_id and len(plain) < 24):
            sync = (len(prompt) + len(plain), []) if plain else (0, prompt)
            (one,) = verifier.verify_batch([VerifyItem("s", *sync, _guided(prompt, guide))])
            plain += one.token_ids
        verifier = _verifier(random_family)
        verifier.lookup.for_pass = lambda sessions: None  # no n-gram chains: every drafted token is the guide's
        (chained,) = verifier.verify_batch(
            [VerifyItem("s", 0, prompt, _guided(prompt, guide), plain_steps=24, lookup_tokens=4, max_tokens=len(plain))]
        )
        assert chained.token_ids == plain, guide.kind
        assert chained.lookup_accepted > 0 and chained.steps < len(plain), (guide.kind, chained.steps, len(plain))


def test_a_thought_is_left_unguided_and_the_answer_after_its_end_is_guided(random_family):
    """A guide with a thought's end: a session whose output is inside the thought emits the unguided target's tokens;
    once its output holds the end, the tokens after it are transformers' with xgrammar's mask from there."""
    path, prompt, guide = str(random_family["target"]), _prompt(random_family), GUIDES[1]
    tokenizer = AutoTokenizer.from_pretrained(path)
    end, thought = tokenizer.encode("</think>", add_special_tokens=False), tokenizer.encode(" let me see", add_special_tokens=False)
    thinking = Guide(guide.kind, guide.spec, thought_end=tuple(end))
    inside, answered = prompt + thought, prompt + thought + end
    (unguided,) = _verifier(random_family).verify_batch([VerifyItem("s", 0, inside, _guided(prompt, thinking), plain_steps=STEPS)])
    assert unguided.token_ids == reference(path, inside, None)[: len(unguided.token_ids)] and len(unguided.token_ids) > 1
    expected = reference(path, answered, guide)
    assert expected != reference(path, answered, None), "the guide changes the answer's greedy tokens"
    (guided,) = _verifier(random_family).verify_batch([VerifyItem("t", 0, answered, _guided(prompt, thinking), plain_steps=len(expected))])
    assert guided.token_ids[: len(expected)] == expected
