"""verifier_service/verifier.py with vLLM's allowed_token_ids and bad_words (`SamplingParams.allowed_token_ids`,
`.bad_words`): the target's distribution keeps the allowed tokens alone, and at each row gives a bad word's last token
no chance where the row's context (the output, then its tree path) ends with the word's other tokens; plain steps and
trees alike, greedy, sampled and raced; ids outside the vocabulary are refused naming the field."""

from __future__ import annotations

import pytest

from specfleet.sampling import SamplingParams
from verifier_service.validation import validate_item
from tests.verifier_service import random_target
from verifier_service.verifier import VerifyItem

ALLOWED = (17, 123, 250)


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=7, drafter_invariant=True)],
    ids=["greedy", "sampled", "raced"],
)
def test_plain_steps_emit_allowed_tokens_alone_and_the_batch_s_other_session_is_left_alone(random_family, sampling):
    prompt = random_target.prompt()
    limited = SamplingParams(sampling.temperature, seed=sampling.seed, drafter_invariant=sampling.drafter_invariant, allowed_token_ids=ALLOWED)
    alone = random_target.verifier(random_family).verify_batch([VerifyItem("plain", 0, prompt, sampling, plain_steps=6)])[0]
    assert not set(alone.token_ids) <= set(ALLOWED)
    both = random_target.verifier(random_family).verify_batch(
        [VerifyItem("limited", 0, prompt, limited, plain_steps=6), VerifyItem("plain", 0, prompt, sampling, plain_steps=6)]
    )
    assert len(both[0].token_ids) == 6 and set(both[0].token_ids) <= set(ALLOWED)
    assert both[1].token_ids == alone.token_ids


def test_a_bad_word_s_last_token_is_rejected_where_the_row_s_path_ends_with_the_rest(random_family):
    """Greedy: the target's first two tokens (a, b) as a bad word make it emit a, then another token than b, in plain
    steps; proposed as a chain [a, b], a is accepted and b rejected (the row after a sees a on its path); the word
    (a, c) for another c leaves the chain accepted whole."""
    prompt = random_target.prompt()
    (free,) = random_target.verifier(random_family).verify_batch([VerifyItem("s", 0, prompt, SamplingParams(), plain_steps=3)])
    a, b = free.token_ids[:2]
    banned = SamplingParams(output_start=len(prompt), bad_words=((a, b),))
    (stepped,) = random_target.verifier(random_family).verify_batch([VerifyItem("s", 0, prompt, banned, plain_steps=3)])
    assert stepped.token_ids[0] == a and stepped.token_ids[1] != b
    chain = dict(tree_tokens=[a, b], tree_parents=[-1, 0], proposals=[([a], [1.0]), ([b], [1.0])])
    (tree,) = random_target.verifier(random_family).verify_batch([VerifyItem("t", 0, prompt, banned, **chain)])
    assert tree.accepted_nodes == [0] and tree.token_ids == stepped.token_ids[:2]
    other = SamplingParams(output_start=len(prompt), bad_words=((a, (b + 1) % 300),))
    (whole,) = random_target.verifier(random_family).verify_batch([VerifyItem("t", 0, prompt, other, **chain)])
    assert whole.accepted_nodes == [0, 1]


@pytest.mark.parametrize(
    "sampling, message",
    [
        (SamplingParams(allowed_token_ids=(3, 300)), r"allowed_token_ids has ids outside the vocabulary \[0, 300\)"),
        (SamplingParams(bad_words=((3,), (4, -1))), r"bad_words has an empty sequence or ids outside the vocabulary \[0, 300\)"),
        (SamplingParams(bad_words=((),)), "bad_words has an empty sequence"),
    ],
)
def test_ids_outside_the_vocabulary_are_refused_naming_the_field(sampling, message):
    with pytest.raises(ValueError, match=message):
        validate_item(VerifyItem("s", 0, [1, 2, 3], sampling), vocab_size=300, max_context=64)
