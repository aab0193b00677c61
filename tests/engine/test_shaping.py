"""specfleet/engine/shaping.py: draft proposals and their confidences, greedy and sampled rows in one batch."""

from __future__ import annotations

import torch

from specfleet.engine import shaping
from specfleet.sampling import SamplingParams


def test_each_row_of_a_mixed_batch_is_confident_as_its_own_law_says():
    """A greedy row proposes its argmax as a point mass, confident by the model's own probability of it (temperature 1);
    a sampled row proposes a token of its truncated q, confident by its shaped probability of that token; a batch of
    sampled rows alone gives them the same."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3)) * 2
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=5)]
    tokens, proposals, confidences = shaping.propose(lambda ids: ids, logits, params, [10, 10], [1, 1], 8)
    assert tokens[0] == int(logits[0].argmax()) and proposals[0] == ([tokens[0]], [1.0])
    assert abs(confidences[0] - float(logits[0].softmax(dim=0)[tokens[0]])) < 1e-6
    shaped = (logits[1] / 0.7).softmax(dim=0)
    assert tokens[1] in proposals[1][0] and len(proposals[1][0]) == 8
    assert abs(confidences[1] - float(shaped[tokens[1]])) < 1e-6
    alone = shaping.propose(lambda ids: ids, logits[1:], params[1:], [10], [1], 8)
    assert (alone[0], alone[2]) == (tokens[1:], confidences[1:])
