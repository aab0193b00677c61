"""verifier_service/verifier.py with `prompt_logprobs`: a session's context log-probabilities are transformers' for the
same model (every token past the first, its rank, its position's most likely tokens), whether the context is prefilled
in one pass or in chunks, and when its blocks are already in the prefix cache (they are computed again, not read from
it); they are answered in the first result that verifies a token after a call asks, and change none of the session's tokens; a
count of alternatives out of range is refused naming the field."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from specfleet.engine import SessionStore, load_model
from specfleet.sampling import SamplingParams
from verifier_service.validation import validate_item
from verifier_service.verifier import Verifier, VerifyItem

TOP = 3


def _verifier(random_family, prefix_caching: bool = True, max_prefill_tokens: int = 0) -> Verifier:
    loaded = load_model("target", str(random_family["target"]), prefix_caching=prefix_caching)
    verifier = Verifier(loaded, SessionStore(1 << 30, 100), max_prefill_tokens=max_prefill_tokens)
    verifier.loaded.eos_token_id = -1
    return verifier


def _prompt(n: int = 41) -> list[int]:
    return torch.randint(1, 300, (n,), generator=torch.Generator().manual_seed(11)).tolist()


@pytest.fixture(scope="module")
def reference(random_family):
    """transformers' log-softmax of the target's logits over the prompt: (logprobs, ranks, top ids, top logprobs) of
    tokens 1.. given what precedes each."""
    model = AutoModelForCausalLM.from_pretrained(str(random_family["target"]), dtype=torch.float32).eval()
    prompt = _prompt()
    with torch.no_grad():
        logp = model(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
    chosen = logp.gather(1, torch.tensor(prompt[1:]).unsqueeze(1))
    top = logp.topk(TOP, dim=-1)
    return chosen.squeeze(1).tolist(), ((logp > chosen).sum(1) + 1).tolist(), top.indices.tolist(), top.values.tolist()


def _check(prompt_logprobs, reference) -> None:
    logprobs, ranks, top_ids, top_lps = reference
    assert prompt_logprobs is not None and prompt_logprobs.top == TOP
    assert prompt_logprobs.logprobs == pytest.approx(logprobs, abs=2e-4)
    # Ranks and the top tokens where the reference's own order is clear (no near ties).
    assert sum(a != b for a, b in zip(prompt_logprobs.ranks, ranks)) <= 1
    got = [prompt_logprobs.top_token_ids[i * TOP : (i + 1) * TOP] for i in range(len(logprobs))]
    assert sum(a != b for a, b in zip(got, top_ids)) <= 1
    assert prompt_logprobs.top_logprobs == pytest.approx([v for row in top_lps for v in row], abs=2e-4)


def _until_verified(verifier: Verifier, item: VerifyItem):
    """The item's result once its context is prefilled (chunked prefill answers `prefilling` until then)."""
    for _ in range(20):
        (result,) = verifier.verify_batch([item])
        if not result.prefilling:
            return result
        item = dataclasses.replace(item, prefix_length=item.prefix_length + len(item.new_token_ids), new_token_ids=[])
    raise AssertionError("never verified")


@pytest.mark.parametrize("max_prefill_tokens", [0, 8], ids=["one-pass", "chunks-of-8"])
def test_prompt_logprobs_are_transformers_and_answered_once(random_family, reference, max_prefill_tokens):
    verifier = _verifier(random_family, max_prefill_tokens=max_prefill_tokens)
    prompt = _prompt()
    plain = _until_verified(_verifier(random_family), VerifyItem("plain", 0, prompt, SamplingParams(), plain_steps=4))
    asked = _until_verified(verifier, VerifyItem("s", 0, prompt, SamplingParams(), prompt_logprobs=TOP, plain_steps=4))
    _check(asked.prompt, reference)
    assert asked.token_ids == plain.token_ids and plain.prompt is None
    # A call that does not ask gets none; one that asks again (a client that lost the answer) gets them again.
    (later,) = verifier.verify_batch([VerifyItem("s", len(prompt) + 4, [], SamplingParams())])
    assert later.prompt is None and later.token_ids
    again = _until_verified(verifier, VerifyItem("s", len(prompt) + 5, [], SamplingParams(), prompt_logprobs=TOP))
    assert again.prompt.logprobs[: len(prompt) - 1] == pytest.approx(asked.prompt.logprobs, abs=2e-4)


@pytest.mark.parametrize("max_prefill_tokens", [0, 8], ids=["one-pass", "chunks-of-8"])
def test_a_prompt_already_in_the_prefix_cache_is_computed_again(random_family, reference, max_prefill_tokens):
    """Another session with the same prompt leaves its full blocks cached; the session that asks gets every position's
    log-probability all the same, and its tokens are the other's."""
    verifier = _verifier(random_family, max_prefill_tokens=max_prefill_tokens)
    prompt = _prompt()
    first = _until_verified(verifier, VerifyItem("a", 0, prompt, SamplingParams()))
    assert verifier.loaded.pool.prefix_caching and verifier.loaded.pool.cached(verifier.store.get("a").blocks[0])
    asked = _until_verified(verifier, VerifyItem("b", 0, prompt, SamplingParams(), prompt_logprobs=TOP))
    _check(asked.prompt, reference)
    assert asked.token_ids == first.token_ids


def test_a_one_token_prompt_has_no_entries(random_family):
    (result,) = _verifier(random_family).verify_batch([VerifyItem("s", 0, [5], SamplingParams(), prompt_logprobs=0)])
    assert result.prompt is not None and result.prompt.logprobs == [] and result.prompt.top_token_ids == []


@pytest.mark.parametrize("value", [-1, 21, 100])
def test_too_many_alternatives_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match=f"prompt_top_logprobs must be between 0 and 20, got {value}"):
        validate_item(VerifyItem("s", 0, [1, 2, 3], SamplingParams(), prompt_logprobs=value), vocab_size=300, max_context=64)
