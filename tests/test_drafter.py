"""The drafter's batched proposals on a real model: the all-greedy fast path equals the general one,
and a session's later calls draft what a fresh session would from the whole context."""

from __future__ import annotations

import pytest

from drafter_service.drafter import STEP_CATCH_UP, DraftItem, DraftModel, draft_batch
from specfleet.engine import SessionStore, load_model
from specfleet.sampling import SamplingParams

CONTEXTS = [[5, 17, 42, 9, 33], [7, 7, 7], [101, 3, 250, 8, 19, 44, 2], [60]]


@pytest.fixture(scope="module")
def drafter_path(random_family):
    return random_family["drafter-noisy"]


def draft(path, items):
    model = DraftModel(load_model("d", path, use_token_map=True), SessionStore(1 << 30, 100), proposal_top_k=8)
    return draft_batch({"d": model}, [("d", item) for item in items])


def test_greedy_fast_path_equals_the_general_path(drafter_path):
    greedy = [DraftItem(f"g{i}", 0, c, num_draft_tokens=4, sampling=SamplingParams()) for i, c in enumerate(CONTEXTS)]
    fast = draft(drafter_path, greedy)
    # One sampled session in the batch sends every session down the general path.
    sampled = DraftItem("s", 0, CONTEXTS[0], num_draft_tokens=4, sampling=SamplingParams(temperature=1.0, seed=1))
    general = draft(drafter_path, greedy + [sampled])[: len(greedy)]
    for a, b in zip(fast, general):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 4
        assert a.proposals == b.proposals == [([t], [1.0]) for t in a.token_ids]
        assert a.confidences == pytest.approx(b.confidences, abs=1e-6)
        assert all(0 < c <= 1 for c in a.confidences)


def test_later_calls_catch_up_and_draft_as_a_fresh_session_would(drafter_path):
    """The next call brings what was committed since: nothing, a few tokens (fed in the first
    draft step) or more than STEP_CATCH_UP (prefilled first), all in one batch."""
    model = DraftModel(load_model("d", drafter_path, use_token_map=True), SessionStore(1 << 30, 100), proposal_top_k=8)
    contexts = CONTEXTS + [[9, 8, 7, 6, 5, 4]]
    committed = [[], [11], [12, 13, 14], list(range(30, 30 + STEP_CATCH_UP)), list(range(50, 50 + STEP_CATCH_UP + 5))]
    greedy = SamplingParams()
    draft_batch({"d": model}, [("d", DraftItem(f"s{i}", 0, c, num_draft_tokens=4, sampling=greedy)) for i, c in enumerate(contexts)])
    # Keep each context, drop the previous drafts, add the committed tokens.
    later = draft_batch(
        {"d": model},
        [("d", DraftItem(f"s{i}", len(c), new, num_draft_tokens=4, sampling=greedy)) for i, (c, new) in enumerate(zip(contexts, committed))],
    )
    fresh = draft(drafter_path, [DraftItem(f"f{i}", 0, c + new, num_draft_tokens=4, sampling=greedy) for i, (c, new) in enumerate(zip(contexts, committed))])
    for a, b in zip(later, fresh):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 4
        assert a.confidences == pytest.approx(b.confidences, abs=1e-5)
