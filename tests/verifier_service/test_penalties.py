"""verifier_service/verifier.py and drafter_service/drafter.py with a request's penalties (presence, frequency,
repetition: `SamplingParams`): greedy tokens are transformers' `generate` with the same penalties, on the target
and on a draft model; each row of a tree counts the tokens on its own path, so a chain of the penalized tokens is
accepted whole; a seeded session's tokens do not depend on the tree it is offered; out-of-range values are refused
naming the field."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from drafter_service.drafter import DraftItem, DraftModel, draft_batch
from specfleet.engine import SessionStore, load_model
from specfleet.sampling import SamplingParams
from tests.helpers import load_target
from tools.bench.systems import OutputPenalties
from verifier_service.validation import validate_item
from tests.verifier_service.seeded import assert_emits_plain_tokens_whatever_the_tree
from verifier_service.verifier import Verifier, VerifyItem

STEPS = 6
# Strong enough to change the random models' greedy tokens (their logits are small), within the allowed ranges.
PENALTIES = dict(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3)


def reference(path: str, prompt: list[int], steps: int, penalties: dict | None = PENALTIES) -> list[int]:
    """transformers' greedy `generate` with the penalties (repetition first, as vLLM applies them; None: none), end of
    sequence ignored."""
    model, _ = load_target(path)
    penalties = {**dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0), **(penalties or {})}
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            repetition_penalty=penalties["repetition_penalty"],
            logits_processor=LogitsProcessorList([OutputPenalties(len(prompt), penalties["presence_penalty"], penalties["frequency_penalty"])]),
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _prompt() -> list[int]:
    return [7, 7, 12, 40, 7, 12, 99, 5, 12, 7]  # repeats: the penalties have something to count from the start


def _verifier(random_family) -> Verifier:
    verifier = Verifier(load_model("target", str(random_family["target"])), SessionStore(1 << 30, 100))
    verifier.loaded.eos_token_id = -1  # no session stops at end of sequence here
    return verifier


def _penalized(prompt: list[int], **sampling) -> SamplingParams:
    return SamplingParams(**sampling, **PENALTIES, output_start=len(prompt))


def test_greedy_penalized_tokens_are_transformers_own_and_a_chain_of_them_is_accepted_whole(random_family):
    path, prompt = str(random_family["target"]), _prompt()
    expected = reference(path, prompt, STEPS)
    assert expected != reference(path, prompt, STEPS, None), "the penalties change the greedy tokens"
    (stepped,) = _verifier(random_family).verify_batch([VerifyItem("s", 0, prompt, _penalized(prompt), plain_steps=STEPS)])
    assert stepped.token_ids == expected
    # Each row counts its own path: the chain of the first five is accepted and the sixth emitted after it.
    chain = dict(tree_tokens=expected[:5], tree_parents=[-1, 0, 1, 2, 3], proposals=[([t], [1.0]) for t in expected[:5]])
    (tree,) = _verifier(random_family).verify_batch([VerifyItem("s", 0, prompt, _penalized(prompt), **chain)])
    assert tree.accepted_nodes == [0, 1, 2, 3, 4] and tree.token_ids == expected


def test_a_seeded_penalized_session_emits_the_same_tokens_whatever_tree_it_is_offered(random_family):
    """Obligation 6 under penalties: the race reads each row's penalized p, so a session offered a tree (its plain
    tokens, or other ones) emits the tokens of plain steps."""
    prompt = _prompt()
    sampling = _penalized(prompt, temperature=1.0, seed=11, drafter_invariant=True)
    assert_emits_plain_tokens_whatever_the_tree(lambda: _verifier(random_family), prompt, sampling)


def test_a_draft_model_s_greedy_chain_under_penalties_is_its_own_generate_s(random_family):
    """A drafter counts the tokens it drafted so far as output: its chain of STEPS is transformers' greedy `generate` of
    the draft model with the same penalties."""
    path, prompt = str(random_family["drafter-noisy"]), _prompt()
    model = DraftModel(load_model("d", path, use_token_map=False), SessionStore(1 << 30, 100), proposal_top_k=8)
    (drafted,) = draft_batch({"d": model}, [("d", DraftItem("s", 0, prompt, num_draft_tokens=STEPS, sampling=_penalized(prompt)))])
    assert drafted.token_ids == reference(path, prompt, STEPS)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(presence_penalty=2.5), r"sampling.presence_penalty must be between -2 and 2, got 2.5"),
        (dict(frequency_penalty=float("nan")), "sampling.frequency_penalty must be between"),
        (dict(repetition_penalty=0.0), r"sampling.repetition_penalty must be in \(0, 10\], got 0.0"),
        (dict(repetition_penalty=10.5), "sampling.repetition_penalty must be in"),
        (dict(output_start=-1), "sampling.output_start must be >= 0"),
    ],
)
def test_penalties_out_of_range_are_refused_naming_the_field(change, message):
    with pytest.raises(ValueError, match=message):
        validate_item(VerifyItem("s", 0, [1, 2, 3], SamplingParams(**change)), vocab_size=300, max_context=64)
