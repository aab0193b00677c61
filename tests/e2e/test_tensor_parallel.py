"""A verifier whose target is split over two processes (`verifier.tensor_parallel_size: 2`, shared memory between
CPU ranks) under `specfleet serve`: the target's own greedy output, and a killed rank costs no request (the
verifier exits with it, serve restarts the whole group, the router carries the requests through); the same for a
drafter service's split model. The sampled tests on a split target are in test_lossless.py, Ray's ranks in
test_ray.py."""

from __future__ import annotations

import os
import pathlib
import signal
import time

from tests.e2e.test_supervision import Streams, wait_restarted
from tests.harness import Cluster, cluster_config
from tests.helpers import PROMPTS
from tests.operations import children, paused, service_pid


def rank_pids(service: int) -> list[int]:
    """A service's other ranks: its child processes running `specfleet.engine.rank`."""
    ranks = []
    for pid in children(service):
        try:
            if b"specfleet.engine.rank" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks.append(pid)
        except OSError:
            continue
    return ranks


def test_a_split_target_serves_its_greedy_output_and_survives_a_killed_rank(random_family, tmp_path):
    """8 greedy streams through a verifier of two ranks; kill -9 rank 1 mid-run: the verifier leaves with it,
    serve restarts it (two ranks again), and every stream ends with the target's own greedy output."""
    target = str(random_family["target"])
    config = cluster_config(random_family, verifier={"colocate": False, "tensor_parallel_size": 2})
    cluster = Cluster(config, tmp_path, "split").start()
    try:
        verifier = service_pid(cluster, "verifier")
        [rank] = rank_pids(verifier)
        streams = Streams([cluster.router], [PROMPTS[i % len(PROMPTS)] for i in range(8)], max_tokens=300)
        streams.start()
        with paused(verifier):  # the requests are surely mid-generation when the rank dies
            os.kill(rank, signal.SIGKILL)
        restarted = wait_restarted(cluster, "verifier", verifier)
        streams.join()
        streams.check(target)
        assert len(rank_pids(restarted)) == 1
        log = cluster.log_path.read_text()
        assert "tensor-parallel rank 1 exited (code -9)" in log and "restarting verifier" in log, log[-3000:]
    finally:
        cluster.stop()


def test_a_split_drafter_drafts_and_a_killed_rank_costs_only_speed(random_family, tmp_path):
    """A drafter service whose model is split over two ranks (`drafters[].tensor_parallel_size: 2`, a process of its
    own): greedy output is the target's and drafts are made; kill -9 its rank 1 under 8 streams: the service leaves
    with it, serve restarts it (two ranks again), and every stream ends with the target's own output."""
    from specfleet.v1 import generation_pb2_grpc
    from tests.helpers import greedy_request, target_greedy

    target = str(random_family["target"])
    config = cluster_config(random_family, drafter_service={"colocate": False, "tensor_parallel_size": 2})
    cluster = Cluster(config, tmp_path, "split-drafter").start()
    try:
        with cluster.channel() as channel:
            reply = generation_pb2_grpc.GenerationStub(channel).Generate(greedy_request(PROMPTS[0], 24, k=4), timeout=120)
        assert list(reply.token_ids) == target_greedy(target, PROMPTS[0], 24)
        assert reply.speculation.draft_tokens > 0, reply.speculation
        drafter = service_pid(cluster, "drafter")
        [rank] = rank_pids(drafter)
        streams = Streams([cluster.router], [PROMPTS[i % len(PROMPTS)] for i in range(8)], max_tokens=200)
        streams.start()
        os.kill(rank, signal.SIGKILL)
        restarted = wait_restarted(cluster, "drafter", drafter)
        streams.join()
        streams.check(target)
        # The streams need no drafter to finish: the restarted one may still be starting its rank.
        deadline = time.monotonic() + 120
        while len(rank_pids(restarted)) != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(rank_pids(restarted)) == 1
        assert "tensor-parallel rank 1 exited (code -9)" in cluster.log_path.read_text()
    finally:
        cluster.stop()
