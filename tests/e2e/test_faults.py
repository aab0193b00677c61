"""Faults in one process cost speed, not requests: real processes, real signals."""

from __future__ import annotations

import os
import signal
import threading
import time

from router.breaker import Breaker
from router.drafters import DrafterService
from specfleet.v1 import generation_pb2_grpc
from tests.harness import Cluster, cluster_config, free_port
from tests.helpers import PROMPTS, greedy_request, target_greedy
from tests.operations import service_pid


def test_breaker_skips_a_failing_service_and_probes_it_with_growing_backoff():
    now = [0.0]
    breaker = Breaker(clock=lambda: now[0])
    assert breaker.allow("a")
    breaker.failed("a")
    breaker.failed("a")  # another lane's call, sent before the breaker opened: the same outage
    assert not breaker.allow("a") and breaker.allow("b") and breaker.open == ["a"]
    assert not breaker.probe_due("a")
    now[0] = 0.6
    assert breaker.probe_due("a") and not breaker.probe_due("a")  # one probe at a time
    assert not breaker.allow("a")  # rounds skip it until a probe succeeds
    breaker.failed("a")  # the probe failed: twice the backoff
    now[0] = 1.5
    assert not breaker.probe_due("a")
    now[0] = 1.7
    assert breaker.probe_due("a")
    breaker.succeeded("a")
    assert breaker.allow("a") and breaker.open == []
    breaker.failed("a")
    now[0] = 2.3
    assert breaker.probe_due("a")  # back to the first backoff after a success


class _Replica:
    def __init__(self, name: str):
        self.name = self.address = name


def test_drafter_replicas_keep_a_request_and_move_it_off_a_skipped_one():
    service = DrafterService("beta", [_Replica("beta"), _Replica("beta[1]")])
    up = {"beta": True, "beta[1]": True}
    live = up.__getitem__
    first, moved = service.pick("r1", live)
    second, _ = service.pick("r2", live)
    assert {first.name, second.name} == {"beta", "beta[1]"} and not moved  # spread over the replicas
    assert service.pick("r1", live) == (first, False)  # and kept there (its KV is there)
    up[first.name] = False
    other, moved = service.pick("r1", live)
    assert other.name != first.name and moved  # off a skipped replica, told it moved (resend everything)
    assert service.pick("r1", live) == (other, False)
    up[other.name] = False
    assert service.pick("r1", live) == (other, False)  # none live: stays, and the caller skips it
    service.unplaced("r1")
    service.unplaced("r2")
    up.update({"beta": True, "beta[1]": True})
    assert service.pick("r3", live)[0].name == "beta"  # the least loaded again


def test_a_stopped_drafter_does_not_stall_requests_drafted_by_others(random_family, tmp_path):
    """SIGSTOP one of two drafter services while eight streams are mid-generation: rounds go on without it
    (its calls get a short deadline, then the breaker skips it), so the streams keep receiving tokens
    while it is stopped, and every output is the target's. Without the deadline every round that routes
    a request to it waits rpc_timeout_s."""
    config = cluster_config(random_family)
    config["drafters"] = [
        {
            "name": "alpha",
            "address": f"127.0.0.1:{free_port()}",
            "models": [{"name": "drafter-noisy", "path": str(random_family["drafter-noisy"])}],
            "metrics_port": 0,
        },
        {
            "name": "beta",
            "address": f"127.0.0.1:{free_port()}",
            "models": [{"name": "drafter-copy", "path": str(random_family["drafter-copy"])}],
            "metrics_port": 0,
            "colocate": False,  # a process of its own, to stop
        },
    ]
    # Every round draws each request's drafter at random, so most rounds have requests on both services.
    config["router"].update({"routing_policy": "random", "default_drafter": "drafter-noisy", "adaptive_speculation": False, "rpc_timeout_s": 300})
    cluster = Cluster(config, tmp_path, "stopped-drafter").start()
    prompts, max_tokens = PROMPTS[:8], 900
    tokens: dict[str, list[int]] = {p: [] for p in prompts}
    chunks = threading.Semaphore(0)
    started = threading.Barrier(len(prompts) + 1)
    done = threading.Event()  # progress shown: the clients hang up, and what they received is checked

    def client(prompt: str) -> None:
        request = greedy_request(prompt, max_tokens, 2, stop_at_eos=False)
        with cluster.channel() as channel:
            stream = generation_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=900)
            for i, chunk in enumerate(stream):
                tokens[prompt] += chunk.token_ids
                chunks.release()
                if i == 0:
                    started.wait(timeout=300)
                if done.is_set():
                    stream.cancel()
                    break

    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    try:
        for t in threads:
            t.start()
        started.wait(timeout=300)  # every stream is mid-generation, with hundreds of tokens to go
        beta = service_pid(cluster, "drafter", also="--name beta")
        os.kill(beta, signal.SIGSTOP)
        try:
            while chunks.acquire(blocking=False):  # count only what arrives from now on
                pass
            # A few rounds may complete without touching beta; fifty chunks need rounds that route around it.
            progressed = all(chunks.acquire(timeout=60) for _ in range(50))
        finally:
            os.kill(beta, signal.SIGCONT)
        chunks.acquire(timeout=60)  # a round after beta is back
        done.set()
        for t in threads:
            t.join(timeout=900)
    finally:
        cluster.stop()
    assert progressed, "the streams stalled while one drafter service was stopped"
    for prompt in prompts:
        assert 0 < len(tokens[prompt]) < max_tokens, len(tokens[prompt])
        assert tokens[prompt] == target_greedy(str(random_family["target"]), prompt, len(tokens[prompt])), prompt
    assert "drafter service beta: skipped" in cluster.log_path.read_text()


def test_pipelining_needs_a_drafter_that_can_run_beside_the_verifier():
    from router.server import pipeline_depth
    from specfleet import placement
    from specfleet.v1 import common_pb2

    def info(host="h", device="cpu", cpus=(0,), threads=1):
        return common_pb2.ModelInfo(host=host, device=device, cpus=list(cpus), threads=threads)

    one_core = info(cpus=[1])
    assert not placement.can_overlap(one_core, info(cpus=[1]))  # `taskset -c 1 specfleet serve`
    assert placement.can_overlap(info(cpus=[0, 1]), info(cpus=[0, 1]))  # two cores for two threads
    assert not placement.can_overlap(info(cpus=[0, 1]), info(cpus=[0, 1]), info(cpus=[0, 1]))  # and the router's
    assert placement.can_overlap(info(cpus=[0, 1]), info(cpus=[0, 1]), info(host="other"))
    assert placement.can_overlap(info(cpus=[0, 1]), info(cpus=[0, 1]), info(cpus=[2]))  # the router on a core of its own
    assert not placement.can_overlap(info(cpus=[0, 1], threads=2), info(cpus=[0, 1]))
    assert placement.can_overlap(one_core, info(host="other", cpus=[1]))
    assert placement.can_overlap(info(device="cuda:0"), info())
    assert not placement.can_overlap(info(device="cuda:0"), info(device="cuda:0"))
    service = DrafterService("d", [_Replica("d")])
    service.placement = info(cpus=[1])
    router = info(cpus=[1])
    assert pipeline_depth(0, one_core, {"general": service}, router) == 1
    assert pipeline_depth(2, one_core, {"general": service}, router) == 2  # a configured depth stands
    service.placement = info(host="other")
    assert pipeline_depth(0, one_core, {"general": service}, router) == 2
    assert pipeline_depth(0, one_core, {}, router) == 2


def test_sessions_are_released_once_a_stalled_drafter_answers_again(random_family, tmp_path):
    """A request ends while its drafter service is stopped (SIGSTOP) for longer than a release call's 10 s deadline:
    the router retries the release, so once the service answers again it holds none of the request's sessions,
    instead of keeping them (and their KV) until it needs the room."""
    from tests.operations import held_sessions, paused, session_of, wait_released

    config = cluster_config(random_family, drafter_service={"colocate": False})  # a process of its own, to stop
    config["router"].update({"adaptive_speculation": False})
    cluster = Cluster(config, tmp_path, "stalled-release").start()
    try:
        request = greedy_request(PROMPTS[2], 900, 2, request_id="stalled-release", stop_at_eos=False)
        with cluster.channel() as channel:
            stream = generation_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=120)
            next(stream)
            session_id = session_of(cluster, request.request_id)
            assert session_id in held_sessions(cluster)["drafter"]  # it drafted: the drafter holds its session
            with paused(service_pid(cluster, "drafter")):
                stream.cancel()  # the request ends; its release to the stopped drafter times out
                time.sleep(15.0)  # a release call's deadline is 10 s
        held = wait_released(cluster, session_id, timeout_s=30.0)
    finally:
        cluster.stop()
    assert session_id not in held["drafter"], held
    assert "releasing 1 sessions failed" in cluster.log_path.read_text()


def test_a_router_that_stops_calling_leaves_no_session_held_past_the_idle_time_and_finishes_when_it_returns(random_family, tmp_path):
    """The router stops (SIGSTOP, as a router killed or cut off would) mid-request, holding the request's sessions on
    the verifier and the drafter service: each forgets them once no call has used them for its session_idle_s, and
    the router, let go on, resends what they lost and finishes the request with the target's own output."""
    from tests.operations import held_sessions, paused, session_of

    idle = {"session_idle_s": 1.0}
    config = cluster_config(random_family, verifier={"colocate": False, **idle}, drafter_service={"colocate": False, **idle})
    config["router"].update({"adaptive_speculation": False})
    cluster = Cluster(config, tmp_path, "idle-expiry").start()
    prompt, max_tokens = PROMPTS[2], 120
    try:
        request = greedy_request(prompt, max_tokens, 2, request_id="idle-expiry", stop_at_eos=False)
        with cluster.channel() as channel:
            stream = generation_pb2_grpc.GenerationStub(channel).GenerateStream(request, timeout=120)
            tokens = list(next(stream).token_ids)
            session_id = session_of(cluster, request.request_id)
            with paused(service_pid(cluster, "router")):
                deadline, held = time.monotonic() + 30, held_sessions(cluster)
                while any(session_id in ids for ids in held.values()) and time.monotonic() < deadline:
                    time.sleep(0.2)
                    held = held_sessions(cluster)
                assert not any(session_id in ids for ids in held.values()), held
            tokens += [t for chunk in stream for t in chunk.token_ids]
    finally:
        cluster.stop()
    assert tokens == target_greedy(str(random_family["target"]), prompt, max_tokens)
    log = cluster.log_path.read_text()
    assert "forgot 1 sessions that no call used for 1 s" in log, log[-3000:]
