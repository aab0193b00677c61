"""verifier_service/verifier.py with a request's logit bias (`SamplingParams.logit_bias`) and min_tokens: the target's
distribution is that of its biased logits, greedy, sampled and raced, in plain steps and trees; its logprobs stay the
raw ones; a session's bias moves no other session of the batch; the tokens min_tokens holds back have no chance before
the output is long enough, at each row by its own position; a bias that is out of range or names an id outside the
vocabulary is refused naming the field."""

from __future__ import annotations

import pytest

from specfleet.engine import SessionStore, load_model
from specfleet.sampling import SamplingParams
from verifier_service.validation import validate_item
from tests.verifier_service import random_target
from verifier_service.verifier import Verifier, VerifyItem

FORCED = 123  # a token the random target seldom picks: a bias of 100 makes it the target's at every position


@pytest.mark.parametrize(
    "sampling",
    [SamplingParams(), SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0, seed=7, drafter_invariant=True)],
    ids=["greedy", "sampled", "raced"],
)
def test_a_forcing_bias_makes_every_token_the_biased_one_and_leaves_the_batch_s_other_session_alone(random_family, sampling):
    """Five plain steps of a session that biases FORCED by 100 emit FORCED five times; the batch's unbiased session emits
    what it emits alone; the biased session's logprobs are those of the raw distribution (FORCED's is the unbiased
    session's first-position logprob of it, from the same prompt)."""
    prompt = random_target.prompt()
    biased = SamplingParams(sampling.temperature, seed=sampling.seed, drafter_invariant=sampling.drafter_invariant, logit_bias=((FORCED, 100.0),))
    plain = VerifyItem("plain", 0, prompt, sampling, logprobs=True, top_logprobs=20, plain_steps=5)
    alone = random_target.verifier(random_family).verify_batch([plain])[0]
    assert FORCED not in alone.token_ids
    both = random_target.verifier(random_family).verify_batch(
        [
            VerifyItem("biased", 0, prompt, biased, logprobs=True, top_logprobs=20, plain_steps=5),
            VerifyItem("plain", 0, prompt, sampling, logprobs=True, top_logprobs=20, plain_steps=5),
        ]
    )
    assert both[0].token_ids == [FORCED] * 5
    assert both[1].token_ids == alone.token_ids and both[1].logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    # Raw logprobs: the first position's top 20 are the unbiased session's, and FORCED's logprob is far below 0.
    assert both[0].top_token_ids[:20] == alone.top_token_ids[:20]
    assert both[0].top_logprobs[:20] == pytest.approx(alone.top_logprobs[:20], abs=1e-5)
    assert both[0].logprobs[0] < -1.0


def test_a_tree_of_the_biased_token_is_accepted_whole_and_a_banned_argmax_never_emitted(random_family):
    """Greedy: a chain of FORCED under a bias of 100 on it is accepted whole (rejected whole without the bias);
    a bias of -100 on the token the target emits unbiased makes the session emit another."""
    prompt = random_target.prompt()
    chain = dict(tree_tokens=[FORCED] * 3, tree_parents=[-1, 0, 1], proposals=[([FORCED], [1.0])] * 3)
    forced = SamplingParams(logit_bias=((FORCED, 100.0),))
    (accepted,) = random_target.verifier(random_family).verify_batch([VerifyItem("s", 0, prompt, forced, **chain)])
    assert accepted.accepted_nodes == [0, 1, 2] and accepted.token_ids == [FORCED] * 4
    (rejected,) = random_target.verifier(random_family).verify_batch([VerifyItem("s", 0, prompt, SamplingParams(), **chain)])
    assert rejected.accepted_nodes == []
    banned = SamplingParams(logit_bias=((rejected.token_ids[0], -100.0),))
    (other,) = random_target.verifier(random_family).verify_batch([VerifyItem("s", 0, prompt, banned)])
    assert other.token_ids[0] != rejected.token_ids[0]


@pytest.mark.parametrize(
    "bias, message",
    [
        (((300, 1.0),), r"logit_bias has an id outside the vocabulary \[0, 300\): 300"),
        (((-1, 1.0),), "outside the vocabulary"),
        (((4, 100.5),), r"logit_bias\[4\] must be between -100 and 100, got 100.5"),
        (((4, float("nan")),), r"logit_bias\[4\] must be between"),
    ],
)
def test_a_bias_out_of_range_or_outside_the_vocabulary_is_refused_naming_the_field(bias, message):
    with pytest.raises(ValueError, match=message):
        validate_item(VerifyItem("s", 0, [1, 2, 3], SamplingParams(logit_bias=bias)), vocab_size=300, max_context=64)


def test_min_tokens_holds_end_of_sequence_back_until_the_output_is_long_enough(random_family):
    """End of sequence raised by 100 is every position's token, except at the positions before min_tokens, where it is
    held back: plain steps emit four other tokens, then it; a chain of four tokens the target would emit there is
    accepted whole and end of sequence follows."""
    prompt = random_target.prompt()
    verifier = Verifier(load_model("target", str(random_family["target"])), SessionStore(1 << 30, 100))
    eos = verifier.loaded.eos_token_id
    sampling = SamplingParams(logit_bias=((eos, 100.0),), output_start=len(prompt), min_tokens=4, held_back=(eos,))
    (stepped,) = verifier.verify_batch([VerifyItem("s", 0, prompt, sampling, plain_steps=8)])
    assert len(stepped.token_ids) == 5 and eos not in stepped.token_ids[:4] and stepped.token_ids[4] == eos
    chain = dict(tree_tokens=stepped.token_ids[:4], tree_parents=[-1, 0, 1, 2], proposals=[([t], [1.0]) for t in stepped.token_ids[:4]])
    (tree,) = random_target.verifier(random_family).verify_batch([VerifyItem("t", 0, prompt, sampling, **chain)])
    assert tree.accepted_nodes == [0, 1, 2, 3] and tree.token_ids == stepped.token_ids
