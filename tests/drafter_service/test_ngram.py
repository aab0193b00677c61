"""The n-gram drafter: the longest, most recent earlier occurrences of the context's suffix propose, each
proposal is exactly the distribution its token was drawn from, and the service hosts it like a model."""

from __future__ import annotations

import asyncio
import collections
import math
import threading

import pytest
import torch

from drafter_service.drafter import DraftItem, DraftModel, draft_batch
from drafter_service.ngram import NgramModel, load_source
from specfleet.engine.ngram import choose, next_token_counts
from drafter_service.server import load_core
from specfleet import config as config_mod
from specfleet.engine import SessionStore, load_model
from specfleet.engine.sampling import race, race_keys, race_noise
from specfleet.sampling import SamplingParams


def test_the_longest_suffix_that_occurred_before_wins():
    # Suffix (1, 2, 3) occurred once, followed by 9; (2, 3) also occurred followed by 7; (3,) followed by 5 too.
    tokens = [3, 5, 2, 3, 7, 1, 2, 3, 9, 0, 1, 2, 3]
    assert next_token_counts(tokens, 4, 1, 16) == ([9], [1])
    assert next_token_counts(tokens, 2, 1, 16) == ([7, 9], [1, 1])
    assert next_token_counts(tokens, 1, 1, 16) == ([5, 7, 9], [1, 1, 1])


def test_counts_are_over_the_most_recent_occurrences():
    tokens = [4, 8, 4, 8, 4, 6, 4, 6, 4, 6, 4]
    assert next_token_counts(tokens, 1, 1, 16) == ([6, 8], [3, 2])
    assert next_token_counts(tokens, 1, 1, 2) == ([6], [2])
    assert next_token_counts(tokens, 1, 1, 1) == ([6], [1])
    assert next_token_counts([4, 6, 4, 8, 4], 1, 1, 1) == ([8], [1])


def test_no_earlier_occurrence_of_a_long_enough_suffix_is_no_proposal():
    assert next_token_counts([1, 2, 3, 4], 4, 1, 16) == ([], [])
    assert next_token_counts([1, 2, 9, 1, 3, 1, 2], 4, 3, 16) == ([], [])
    assert next_token_counts([1, 2, 9, 1, 3, 1, 2], 4, 2, 16) == ([9], [1])
    assert next_token_counts([7], 4, 1, 16) == ([], [])


def _tensor_counts(tokens: list[int], ngram_max: int, ngram_min: int, matches: int) -> tuple[list[int], list[int]]:
    """The lookup in tensor operations (every window of the context compared at once): the reference."""
    context = torch.tensor(tokens, dtype=torch.long)
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        windows = context[:-1].unfold(0, n, 1)
        starts = (windows == context[-n:]).all(dim=1).nonzero().flatten()
        if len(starts):
            ids, counts = context[starts[-matches:] + n].unique(return_counts=True)
            return ids.tolist(), counts.tolist()
    return [], []


def test_the_lookup_finds_what_comparing_every_window_finds():
    """Random contexts over few token ids (many repeats, overlapping and at the ends), every setting."""
    gen = torch.Generator().manual_seed(11)
    for trial in range(400):
        length = int(torch.randint(1, 60, (1,), generator=gen))
        tokens = torch.randint(0, 1 + trial % 6, (length,), generator=gen).tolist()
        ngram_min = 1 + trial % 3
        for ngram_max, matches in ((ngram_min, 1), (ngram_min + 1, 2), (4, 16)):
            got = next_token_counts(tokens, max(ngram_max, ngram_min), ngram_min, matches)
            assert got == _tensor_counts(tokens, max(ngram_max, ngram_min), ngram_min, matches), (tokens, ngram_min, ngram_max, matches)


def test_greedy_is_a_point_mass_on_the_most_frequent_token_ties_to_the_lowest_id():
    assert choose([3, 5, 8], [1, 2, 2], SamplingParams(), 10, 1) == (5, ([5], [1.0]))
    assert choose([3, 5, 8], [1, 2, 3], SamplingParams(), 10, 1) == (8, ([8], [1.0]))


def test_sampled_proposals_send_the_empirical_distribution_and_draw_from_it():
    ids, counts = [3, 5, 8], [1, 2, 5]
    drawn = collections.Counter()
    n = 4000
    for seed in range(n):
        token, (sent_ids, sent_q) = choose(ids, counts, SamplingParams(temperature=1.0, seed=seed), 10, 1)
        assert sent_ids == ids and sent_q == pytest.approx([1 / 8, 2 / 8, 5 / 8], abs=1e-7) and math.fsum(sent_q) == pytest.approx(1)
        drawn[token] += 1
    for token, count in zip(ids, counts):
        # Binomial standard deviation at most sqrt(n / 4) = 32: a 5-sigma band.
        assert abs(drawn[token] - n * count / 8) < 160


def test_raced_proposals_are_the_race_winner_over_q():
    ids, counts = [3, 5, 8], [1, 2, 5]
    for seed in range(200):
        sampling = SamplingParams(temperature=0.7, seed=seed, drafter_invariant=True)
        token, (_, q) = choose(ids, counts, sampling, 12, 1)
        winner = race(torch.tensor([q]), race_noise(race_keys([seed], [12]), torch.tensor([ids])))
        assert token == ids[int(winner[0])]


@pytest.fixture(scope="module")
def ngram(random_family):
    return NgramModel(load_source("ngram", str(random_family["target"])), SessionStore(1 << 30, 100), 4, 1, 16)


def test_the_service_drafts_a_chain_that_continues_the_repetition_and_stops_without_a_match(ngram):
    items = [
        DraftItem("rep", 0, [1, 2, 3, 4, 1, 2], num_draft_tokens=5, sampling=SamplingParams()),
        DraftItem("new", 0, [1, 2, 3, 4], num_draft_tokens=5, sampling=SamplingParams()),
        DraftItem("end", 0, [1, 2, 3, 1, 2], num_draft_tokens=5, sampling=SamplingParams()),
    ]
    rep, new, end = draft_batch({"ngram": ngram}, [("ngram", item) for item in items])
    assert rep.token_ids == [3, 4, 1, 2, 3] and rep.proposals == [([t], [1.0]) for t in rep.token_ids]
    assert all(0 < c < 1 for c in rep.confidences)
    assert new.known and new.token_ids == [] and new.proposals == []
    # The session holds what it drafted, so the next call syncs as with any drafter.
    assert ngram.store.get("rep").token_ids == [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]
    assert end.token_ids == [3, 1, 2, 3, 1]


def test_sampled_sessions_draw_each_token_from_the_distribution_they_send(ngram):
    context = [2, 1, 5, 3, 1, 5, 4, 1, 5, 8, 1, 6, 9, 1, 7, 0, 1]  # only the suffix (1,) occurred: then 5, 5, 5, 6, 7
    n = 2000
    items = [DraftItem(f"s{seed}", 0, context, num_draft_tokens=1, sampling=SamplingParams(temperature=1.0, seed=seed)) for seed in range(n)]
    results = draft_batch({"ngram": ngram}, [("ngram", item) for item in items])
    drawn = collections.Counter()
    for r in results:
        (ids, q), (token,) = r.proposals[0], r.token_ids
        assert ids == [5, 6, 7] and q == pytest.approx([0.6, 0.2, 0.2]) and token in ids
        drawn[token] += 1
    for token, p in zip([5, 6, 7], [0.6, 0.2, 0.2]):
        assert abs(drawn[token] - n * p) < 5 * math.sqrt(n * p * (1 - p))


def test_in_a_lockstep_group_it_continues_from_the_lead_and_stops_alone(random_family, ngram):
    """With a model drafter: the n-gram session follows the lead token; once no suffix matches it stops, the model goes on."""
    model = DraftModel(load_model("m", random_family["drafter-noisy"], use_token_map=True), SessionStore(1 << 30, 100), proposal_top_k=8)
    context = [9, 8, 7, 9, 8]
    tagged = [
        ("m", DraftItem("g", 0, context, num_draft_tokens=4, sampling=SamplingParams(), lockstep_group="g")),
        ("ngram", DraftItem("g", 0, context, num_draft_tokens=4, sampling=SamplingParams(), lockstep_group="g")),
    ]
    fused, ngram_result = draft_batch({"m": model, "ngram": ngram}, tagged)
    assert len(fused.token_ids) == 4 and 1 <= len(ngram_result.token_ids) <= 4
    assert ngram_result.token_ids[0] == 7
    main = list(context)
    for position, token in enumerate(ngram_result.token_ids):
        assert ngram_result.proposals[position] == ([token], [1.0])
        assert next_token_counts(main, 4, 1, 16)[0]  # it proposed where the main branch had a match
        lead = token if ngram_result.confidences[position] > fused.confidences[position] else fused.token_ids[position]
        main.append(lead)
    assert ngram.store.get("g").token_ids == main


def mixed_service(random_family) -> config_mod.DrafterServiceConfig:
    """A drafter service holding a draft model and the n-gram drafter."""
    return config_mod.DrafterServiceConfig(
        name="mixed",
        models=[
            config_mod.DraftModelConfig(name="noisy", path=str(random_family["drafter-noisy"])),
            config_mod.DraftModelConfig(name="ngram", kind="ngram", path=str(random_family["target"])),
        ],
    )


def test_the_service_hosts_it_beside_a_model_and_reports_the_targets_tokenizer(random_family):
    svc = mixed_service(random_family)
    core = load_core(svc)
    try:
        infos = {m.name: m for m in core.info().models}
        target = load_model("t", random_family["target"])
        assert infos["ngram"].tokenizer_fingerprint == target.fingerprint == infos["noisy"].tokenizer_fingerprint
        assert infos["ngram"].vocab_size == target.vocab_size and infos["ngram"].parameters == 0
    finally:
        core.close()


def test_a_call_of_model_free_drafters_drafts_in_place_and_any_other_through_the_queue(random_family):
    """Handing n-gram lookups to the model thread and back costs more than they do: a call of n-gram sessions alone
    drafts on the caller's thread (no queue wait), one with a model drafter goes through the queue, and so does an
    n-gram call while a batch (here another thread) holds the n-gram drafter's sessions, without holding up the
    event loop."""
    svc = mixed_service(random_family)
    core = load_core(svc)
    greedy = SamplingParams()

    def items(*names: str, sid: str) -> list:
        return [(name, DraftItem(f"{sid}-{name}", 0, [1, 2, 3, 4, 1, 2], num_draft_tokens=3, sampling=greedy)) for name in names]

    async def scenario():
        (alone,), stats = await core.draft_items(items("ngram", sid="a"))
        assert alone.token_ids == [3, 4, 1] and stats.queue_ms == 0.0 and stats.batch_size == 1
        results, stats = await core.draft_items(items("ngram", "noisy", sid="b"))
        assert results[0].token_ids == [3, 4, 1] and len(results[1].token_ids) == 3 and stats.queue_ms > 0

        held, release = threading.Event(), threading.Event()

        def hold():
            with core.models["ngram"].store.lock:
                held.set()
                release.wait(5.0)

        holder = threading.Thread(target=hold)
        holder.start()
        held.wait(5.0)
        call = asyncio.create_task(core.draft_items(items("ngram", sid="c")))
        await asyncio.sleep(0.2)  # the event loop runs on: the call waits in the queue, not on the lock
        assert not call.done()
        release.set()
        (queued,), stats = await call
        holder.join()
        assert queued.token_ids == [3, 4, 1] and stats.queue_ms > 0

    try:
        asyncio.run(scenario())
    finally:
        core.close()
