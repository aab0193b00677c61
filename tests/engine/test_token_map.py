"""A drafter's token map (token_map.json): its output layer scores only the listed ids.

Losslessness needs every proposal to be exactly the distribution its token was
drawn from; with a map that is the model's distribution over the mapped ids.
These tests check that on a real model's forward passes, and that a bad map is
refused at load with a message naming the file. Greedy equality with the
target through the services is covered by tests/e2e/test_demo_serving.py, whose
bundled drafters all carry a map.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from drafter_service.drafter import DraftItem, DraftModel, draft_batch
from specfleet.engine import TOKEN_MAP_FILE, SessionStore, load_model
from specfleet.sampling import SamplingParams
from tests.helpers import load_target


@pytest.fixture(scope="module")
def mapped_drafter(random_family, tmp_path_factory):
    """The random family's drafter-noisy with a map of every other id from 1 (so some of its favourites are out)."""
    path = tmp_path_factory.mktemp("mapped") / "drafter"
    shutil.copytree(random_family["drafter-noisy"], path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    (path / TOKEN_MAP_FILE).write_text(json.dumps(list(range(1, vocab, 2))))
    return path


def full_logits(path, context: list[int]) -> torch.Tensor:
    model, _ = load_target(str(path))  # transformers, full output layer
    with torch.inference_mode():
        return model(torch.tensor([context])).logits[0, -1].float()


def test_proposals_are_the_models_distribution_over_the_mapped_ids(mapped_drafter):
    loaded = load_model("mapped", mapped_drafter, use_token_map=True)
    mapped = loaded.token_map.tolist()
    assert mapped == list(range(1, loaded.vocab_size, 2)) and loaded.model.lm_head.shape[0] == len(mapped)
    drafter = DraftModel(loaded, SessionStore(1 << 30, 100), proposal_top_k=len(mapped))
    context = [5, 17, 42, 9, 33]
    temperature = 0.7
    item = DraftItem("s", 0, context, num_draft_tokens=1, sampling=SamplingParams(temperature=temperature, seed=3))
    (result,) = draft_batch({"mapped": drafter}, [("mapped", item)])
    ids, probs = result.proposals[0]
    assert set(ids) <= set(mapped) and result.token_ids[0] in ids
    expected = torch.zeros(loaded.vocab_size)
    sub = full_logits(mapped_drafter, context)[loaded.token_map] / temperature
    expected[loaded.token_map] = sub.softmax(0)
    sent = torch.zeros(loaded.vocab_size).index_put_((torch.tensor(ids),), torch.tensor(probs))
    assert torch.allclose(sent, expected, atol=1e-5)


def test_greedy_proposes_the_best_mapped_id(mapped_drafter):
    loaded = load_model("mapped", mapped_drafter, use_token_map=True)
    drafter = DraftModel(loaded, SessionStore(1 << 30, 100), proposal_top_k=8)
    contexts = [[5, 17, 42, 9, 33], [7, 7, 7], [101, 3, 250, 8], [60], [2, 4, 6, 8, 10, 12]]
    items = [DraftItem(f"s{i}", 0, c, num_draft_tokens=1, sampling=SamplingParams()) for i, c in enumerate(contexts)]
    results = draft_batch({"mapped": drafter}, [("mapped", item) for item in items])
    favourite_unmapped = 0
    for context, result in zip(contexts, results):
        logits = full_logits(mapped_drafter, context)
        assert result.token_ids[0] == int(loaded.token_map[logits[loaded.token_map].argmax()])
        assert result.proposals[0] == ([result.token_ids[0]], [1.0])
        favourite_unmapped += int(logits.argmax()) % 2 == 0  # the map holds the odd ids
    assert favourite_unmapped > 0  # the map changed at least one choice


def test_the_target_and_the_default_load_ignore_a_map(mapped_drafter):
    assert load_model("plain", mapped_drafter).token_map is None


@pytest.mark.parametrize(
    "content,message",
    [("[1, 1, 2]", "twice"), ("[0, 100000]", "vocabulary ids"), ("{}", "vocabulary ids"), ("[1,", "cannot read")],
)
def test_a_bad_map_is_refused_naming_the_file(mapped_drafter, tmp_path, content, message):
    path = tmp_path / "bad"
    shutil.copytree(mapped_drafter, path)
    (path / TOKEN_MAP_FILE).write_text(content)
    with pytest.raises(ValueError, match=message) as err:
        load_model("bad", path, use_token_map=True)
    assert TOKEN_MAP_FILE in str(err.value)
