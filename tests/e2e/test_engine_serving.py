"""The engine's settings end to end: services running batched attention still give the target's own output.

Real `specfleet serve`, real gRPC, the random family: eight concurrent greedy streams at several
draft lengths make verify and draft passes of several sessions with ragged contexts, chains and
rejections (rollback inside each session's buffer); half-way every cache is evicted, and the
next passes rebuild them.
"""

from __future__ import annotations

import pytest

from specfleet.v1 import common_pb2, drafter_pb2_grpc, generation_pb2_grpc, verifier_pb2_grpc
from tests.harness import Cluster, cluster_config
from tests.operations import session_of
from tests.helpers import PROMPTS, greedy_request, target_greedy

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def batched_cluster(random_family, tmp_path_factory):
    config = cluster_config(random_family, verifier={"attention": "batched"}, drafter_service={"attention": "batched"})
    c = Cluster(config, tmp_path_factory.mktemp("batched"), "batched").start()
    yield c
    c.stop()


def test_batched_attention_services_give_the_target_output(batched_cluster, random_family):
    prompts = PROMPTS[:8]
    reference = {p: target_greedy(str(random_family["target"]), p, MAX_TOKENS) for p in prompts}
    ids = [f"batched-{i}" for i in range(len(prompts))]
    with batched_cluster.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        streams = [stub.GenerateStream(greedy_request(p, MAX_TOKENS, 1 + i % 6, request_id=ids[i]), timeout=300) for i, p in enumerate(prompts)]
        chunks = [[next(s)] for s in streams]
        release = common_pb2.ReleaseRequest(session_ids=[session_of(batched_cluster, i) for i in ids], keep_tokens=True)
        with batched_cluster.channel(batched_cluster.verifier) as vch, batched_cluster.channel(batched_cluster.drafter) as dch:
            released = verifier_pb2_grpc.VerifierStub(vch).ReleaseSessions(release, timeout=30).released
            released += drafter_pb2_grpc.DrafterStub(dch).ReleaseSessions(release, timeout=30).released
        for stream, got in zip(streams, chunks):
            got.extend(stream)
    assert released >= 1, "every request finished before its caches could be evicted"
    with batched_cluster.channel(batched_cluster.verifier) as vch, batched_cluster.channel(batched_cluster.drafter) as dch:
        target = verifier_pb2_grpc.VerifierStub(vch).GetInfo(common_pb2.InfoRequest(), timeout=30)
        drafters = drafter_pb2_grpc.DrafterStub(dch).GetInfo(common_pb2.InfoRequest(), timeout=30).models
    assert [(m.attention, m.device, m.dtype) for m in [target, *drafters]] == [("batched", "cpu", "float32")] * 2
    for prompt, got in zip(prompts, chunks):
        assert [t for c in got for t in c.token_ids] == reference[prompt], prompt
    final = [got[-1].speculation for got in chunks]
    # The drafts were both accepted and rejected: rollback inside the buffers was exercised.
    assert 0 < sum(s.accepted_tokens for s in final) < sum(s.draft_tokens for s in final)
