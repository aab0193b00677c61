"""The model-free n-gram drafter serves through `specfleet serve` like any draft model: greedy output is the
target's own and some of its drafts are accepted; a seeded sampled request's output is the one it gets
with speculation off."""

from __future__ import annotations

import pytest

from specfleet.v1 import generation_pb2, generation_pb2_grpc
from tests.harness import Cluster, cluster_config
from tests.helpers import greedy_request, target_greedy

MAX_TOKENS = 32
# Prompts that repeat themselves, and a greedy random target that soon repeats itself too.
PROMPTS = ["a b c d a b c d a b c", "x = 1\nx = 1\nx = 1\nx =", "The quick brown fox"]


@pytest.fixture(scope="module")
def ngram_cluster(random_family, tmp_path_factory):
    # Every round drafts k = 4 where the n-gram drafter finds a match: adaptive speculation would leave a request
    # with its low prior at k = 0 but for one-token probes, and whether one of those lands on a repeat is luck.
    config = cluster_config(random_family, router={"default_drafter": "ngram", "adaptive_speculation": False})
    config["drafters"][0]["models"] = [{"name": "ngram", "kind": "ngram", "path": str(random_family["target"])}]
    cluster = Cluster(config, tmp_path_factory.mktemp("ngram"), "ngram").start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def stub(ngram_cluster):
    with ngram_cluster.channel() as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def test_greedy_output_is_the_targets_and_drafts_are_accepted(stub, random_family):
    accepted = 0
    for prompt in PROMPTS:
        reply = stub.Generate(greedy_request(prompt, MAX_TOKENS, 4), timeout=120)
        assert list(reply.token_ids) == target_greedy(str(random_family["target"]), prompt, MAX_TOKENS), prompt
        accepted += reply.speculation.accepted_tokens
    assert accepted > 0


def test_seeded_sampled_output_does_not_depend_on_the_drafts(stub):
    drafted = 0
    for seed in range(3):
        request = generation_pb2.GenerateRequest(prompt=PROMPTS[seed], max_tokens=MAX_TOKENS, seed=seed, temperature=0.8, stop_at_eos=False)
        speculated = stub.Generate(request, timeout=120)
        request.speculation.disabled = True
        plain = stub.Generate(request, timeout=120)
        assert list(speculated.token_ids) == list(plain.token_ids), seed
        drafted += speculated.speculation.draft_tokens
    assert drafted > 0


def test_a_round_it_proposed_nothing_in_counts_as_a_round_it_was_asked(random_family, tmp_path):
    """A prompt of distinct tokens has no suffix that occurred before: asked for a token in the first round, the n-gram
    drafter proposes nothing. That round still scores it (a miss) and counts as one it drafted in, or routing and the
    plan would judge it by the rounds it proposed in alone (adaptive speculation off: it is asked in every round that
    may draft)."""
    config = cluster_config(random_family, router={"default_drafter": "ngram", "adaptive_speculation": False})
    config["drafters"][0]["models"] = [{"name": "ngram", "kind": "ngram", "path": str(random_family["target"])}]
    cluster = Cluster(config, tmp_path, "ngram-silent").start()
    try:
        with cluster.channel() as channel:
            request = generation_pb2.GenerateRequest(prompt_token_ids=list(range(10, 20)), max_tokens=2, stop_at_eos=False)
            reply = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120)
    finally:
        cluster.stop()
    spec = reply.speculation
    assert spec.rounds == 2 and spec.draft_tokens == 0, spec
    assert [(d.drafter, d.rounds, d.draft_tokens) for d in spec.drafters] == [("ngram", 1, 0)], spec
