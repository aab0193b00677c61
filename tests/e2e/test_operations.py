"""Admission, overload, metrics and reload through a real `specfleet serve`: one running slot, a short queue.

A paused verifier (SIGSTOP) holds the running request mid-round, so that the
queue fills and drains at moments the test chooses, whatever the machine's speed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import grpc
import pytest
import yaml

from specfleet.tokenizer import load_tokenizer
from specfleet.v1 import generation_pb2_grpc
from tests.harness import Cluster, free_port
from tests.helpers import PROMPTS, greedy_request, target_greedy
from tests.operations import metrics, paused, service_pid, session_of, wait_for_metric
from tests.e2e.test_collaboration import multi_drafter_config

MAX_QUEUED = 4


# router.chat_template (vLLM's --chat-template) for a target whose tokenizer has none.
CHAT_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


@pytest.fixture(scope="module")
def ops(random_family, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    config = multi_drafter_config(
        random_family,
        across_services=False,
        routing_policy="fixed",
        default_drafter="drafter-noisy",
        fusion_width=1,
        max_running=1,
        max_queued=MAX_QUEUED,
        metrics_port=free_port(),
        http_port=free_port(),
        rpc_timeout_s=600.0,  # a round waits out the verifier's pause rather than failing
        # Every round drafts k: the metrics test needs drafts both accepted and rejected, and with adaptive
        # speculation the plan may leave a round's requests to plain steps with the verifier's lookup, where what
        # the lookup learned from the earlier tests' traffic says those commit more (tests/router tests the plan).
        adaptive_speculation=False,
        chat_template=str(template),
        priority_scheduling=True,
        response_store_mb=0,  # stored responses off: test_a_router_that_stores_no_responses_says_so
    )
    config["verifier"]["colocate"] = False  # the tests pause the verifier alone (SIGSTOP), not the router with it
    cluster = Cluster(config, tmp_path_factory.mktemp("ops"), "ops").start()
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def stub(ops):
    with ops.channel() as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def _port(cluster) -> int:
    return cluster.config["router"]["metrics_port"]


@contextlib.contextmanager
def _slot_taken(cluster, stub, request_id: str):
    """The one running slot is held by a request that cannot finish: the verifier is paused. On exit the
    verifier resumes; yields the blocking request's future."""
    with paused(service_pid(cluster, "verifier")):
        blocker = stub.Generate.future(greedy_request(PROMPTS[0], 8, 2, request_id=request_id), timeout=600)
        wait_for_metric(_port(cluster), "specfleet:num_requests_running", 1)
        yield blocker


def _queue(cluster, stub, request, timeout_s: float):
    """Send a request and wait until the router has queued it (so arrival order is this call order)."""
    waiting = metrics(_port(cluster))["specfleet:num_requests_waiting"]
    future = stub.Generate.future(request, timeout=timeout_s)
    wait_for_metric(_port(cluster), "specfleet:num_requests_waiting", waiting + 1)
    return future


def test_admission_is_earliest_deadline_first(ops, stub, random_family):
    """Queued behind a running request in an order that is neither deadline order nor its reverse, requests
    run (one at a time: max_running 1) in deadline order; the router log records the order they finish."""
    reference = target_greedy(str(random_family["target"]), PROMPTS[1], 4)
    timeouts = [300, 100, 400, 200]
    with _slot_taken(ops, stub, "edf-blocker") as blocker:
        queued = {t: _queue(ops, stub, greedy_request(PROMPTS[1], 4, 2, request_id=f"edf-{t}"), t) for t in timeouts}
    assert blocker.result().finish_reason
    for future in queued.values():
        assert list(future.result().token_ids) == reference
    finished = re.findall(r"request (edf-\d+) finished", ops.log_path.read_text())
    assert finished == [f"edf-{t}" for t in sorted(timeouts)]


def test_a_lower_priority_is_admitted_first_ahead_of_deadlines_and_arrival(ops, stub, random_family):
    """With router.priority_scheduling, requests queued behind a running one run (one at a time) by priority, lower
    first, whatever their deadlines and arrival; equal priorities by deadline."""
    reference = target_greedy(str(random_family["target"]), PROMPTS[1], 4)
    asked = [(0, 300), (5, 100), (-1, 400), (0, 200)]  # (priority, timeout)
    with _slot_taken(ops, stub, "priority-blocker") as blocker:
        queued = [_queue(ops, stub, greedy_request(PROMPTS[1], 4, 2, request_id=f"prio-{i}", priority=p), t) for i, (p, t) in enumerate(asked)]
    assert blocker.result().finish_reason
    assert all(list(future.result().token_ids) == reference for future in queued)
    finished = re.findall(r"request (prio-\d+) finished", ops.log_path.read_text())
    assert finished == ["prio-2", "prio-3", "prio-0", "prio-1"]


def test_admission_takes_turns_between_calls(ops, stub, random_family):
    """Queued behind a running request: one HTTP call of three prompts, then a one-prompt gRPC request, none with a
    deadline. The lone request runs right after the call's first prompt, not after all three: admission takes turns
    between calls (one at a time here: max_running 1), and every output is the target's."""
    import concurrent.futures

    import openai

    reference = target_greedy(str(random_family["target"]), PROMPTS[1], 4)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ops.config['router']['http_port']}/v1", api_key="-", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with _slot_taken(ops, stub, "turns-blocker") as blocker:
            waiting = metrics(_port(ops))["specfleet:num_requests_waiting"]
            call = pool.submit(client.completions.create, model=model, prompt=[PROMPTS[1]] * 3, max_tokens=4, temperature=0)
            wait_for_metric(_port(ops), "specfleet:num_requests_waiting", waiting + 3)
            lone = _queue(ops, stub, greedy_request(PROMPTS[1], 4, 2, request_id="turns-lone"), None)
        assert blocker.result().finish_reason
        assert list(lone.result().token_ids) == reference
        texts = [choice.text for choice in call.result().choices]
    tokenizer = load_tokenizer(str(random_family["target"]))
    assert texts == [tokenizer.decode(reference, skip_special_tokens=True)] * 3
    log = ops.log_path.read_text()
    finished = re.findall(r"request (\S+) finished", log[log.index("request turns-blocker finished") :])
    assert len(finished) == 5 and finished.index("turns-lone") == 2, finished


def test_admission_takes_turns_between_clients(ops, stub, random_family):
    """Queued behind a running request: three one-prompt requests on one gRPC channel (one client, three calls),
    each with a deadline, then one on a channel of its own without. The second client's request runs right after the
    first client's first, not after all three: admission takes turns between clients (their connections), whatever
    number of calls and deadlines each sends; every output is the target's."""
    reference = target_greedy(str(random_family["target"]), PROMPTS[1], 4)
    with ops.channel(own_connection=True) as channel:
        other = generation_pb2_grpc.GenerationStub(channel)
        with _slot_taken(ops, stub, "clients-blocker") as blocker:
            busy = [_queue(ops, stub, greedy_request(PROMPTS[1], 4, 2, request_id=f"clients-busy-{i}"), 600) for i in range(3)]
            lone = _queue(ops, other, greedy_request(PROMPTS[1], 4, 2, request_id="clients-lone"), None)
        assert blocker.result().finish_reason
        for future in [*busy, lone]:
            assert list(future.result().token_ids) == reference
    log = ops.log_path.read_text()
    finished = re.findall(r"request (\S+) finished", log[log.index("request clients-blocker finished") :])
    assert len(finished) == 5 and finished.index("clients-lone") == 2, finished


def test_past_max_queued_is_resource_exhausted(ops, stub, random_family):
    """A full queue refuses the next request with RESOURCE_EXHAUSTED naming router.max_queued; the queued
    ones and the running one finish correctly once the verifier resumes."""
    reference = target_greedy(str(random_family["target"]), PROMPTS[2], 4)
    with _slot_taken(ops, stub, "full-blocker") as blocker:
        queued = [_queue(ops, stub, greedy_request(PROMPTS[2], 4, 2, request_id=f"full-{i}"), 600) for i in range(MAX_QUEUED)]
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(greedy_request(PROMPTS[2], 4, 2, request_id="one-too-many"), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value.details()
    assert "router.max_queued" in err.value.details()
    assert blocker.result().finish_reason
    for future in queued:
        assert list(future.result().token_ids) == reference
    assert "request one-too-many finished" not in ops.log_path.read_text()


def test_metrics_count_what_the_replies_report(ops, stub):
    """The router's counters move by exactly what its replies report (nothing else runs meanwhile)."""
    before = metrics(_port(ops))
    # As many as the queue holds, so that none is refused whatever the order of arrival and admission.
    futures = [stub.Generate.future(greedy_request(p, 24, 4), timeout=300) for p in PROMPTS[:MAX_QUEUED]]
    replies = [f.result() for f in futures]
    after = metrics(_port(ops))

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    def moved_family(family: str) -> float:
        return sum(v for k, v in after.items() if k.startswith(family + "{")) - sum(v for k, v in before.items() if k.startswith(family + "{"))

    drafted = sum(r.speculation.draft_tokens for r in replies)
    accepted = sum(r.speculation.accepted_tokens for r in replies)
    # the drafter proposed, and the target both accepted and rejected
    assert 0 < accepted < drafted, [r.speculation for r in replies]
    assert moved("specfleet:spec_decode_num_draft_tokens_total") == drafted
    assert moved("specfleet:spec_decode_num_accepted_tokens_total") == accepted
    assert moved_family("specfleet:request_success_total") == len(replies)
    assert moved_family("specfleet:request_failure_total") == 0
    assert moved("specfleet:rounds_total") >= max(r.speculation.rounds for r in replies)
    # Per drafter (one drafter, chains only: its proposals are the request's drafts).
    assert moved_family("specfleet:drafter_draft_tokens_total") == sum(d.draft_tokens for r in replies for d in r.speculation.drafters)
    assert moved_family("specfleet:drafter_accepted_tokens_total") == sum(d.accepted_tokens for r in replies for d in r.speculation.drafters)
    # Where the rounds' time went: each call's wall holds the server's queue and compute (float32 milliseconds,
    # so a hair of rounding is allowed); the rest is transport. The router's own time is never nothing.
    for r in replies:
        s = r.speculation
        assert min(s.draft_queue_ms, s.verify_queue_ms, s.draft_compute_ms, s.verify_compute_ms) >= 0 and s.router_ms > 0, s
        assert s.draft_queue_ms + s.draft_compute_ms <= s.draft_wall_ms * (1 + 1e-5) + 1e-3, s
        assert s.verify_queue_ms + s.verify_compute_ms <= s.verify_wall_ms * (1 + 1e-5) + 1e-3, s
    # The same per call and per round in specfleet:round_phase_seconds: a router sample each round, the calls' phases
    # each call, and the phases' sums are times.
    phase = 'specfleet:round_phase_seconds_{}{{phase="{}"}}'
    assert moved(phase.format("count", "router")) == moved("specfleet:rounds_total")
    for stage in ("draft", "verify"):
        calls = moved(phase.format("count", f"{stage}_compute"))
        assert calls > 0 and all(moved(phase.format("count", f"{stage}_{part}")) == calls for part in ("queue", "transport"))
        assert all(moved(phase.format("sum", f"{stage}_{part}")) >= 0 for part in ("compute", "queue", "transport"))
    assert moved(phase.format("sum", "router")) > 0
    # vLLM's per-request histograms: one sample a finished request, each length summing what the replies report, and
    # each request's inference time its prefill's and decode's.
    lengths = {"prompt_tokens": sum(r.usage.prompt_tokens for r in replies), "generation_tokens": sum(len(r.token_ids) for r in replies)}
    lengths["params_max_tokens"] = 24 * len(replies)
    for name, total in lengths.items():
        assert (moved(f"specfleet:request_{name}_count"), moved(f"specfleet:request_{name}_sum")) == (len(replies), total), name
    times = {p: moved(f"specfleet:request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode", "inference")}
    assert all(moved(f"specfleet:request_{p}_time_seconds_count") == len(replies) for p in times) and min(times.values()) >= 0, times
    assert times["inference"] == pytest.approx(times["prefill"] + times["decode"], rel=1e-6) and times["prefill"] > 0, times
    e2e = moved("specfleet:e2e_request_latency_seconds_sum")
    assert times["queue"] + times["inference"] == pytest.approx(e2e, rel=1e-6), (times, e2e)


def test_a_cancelled_request_stops_and_counts_as_cancelled(ops, stub):
    """A client cancels mid-generation while the verifier is paused: once the router has seen the
    cancellation, the round in flight is the request's last (counted as cancelled, not finished), and both
    servers drop its sessions."""
    from tests.operations import wait_released

    before = metrics(_port(ops))
    request = greedy_request(PROMPTS[4], 1000, 2, request_id="ops-cancel", stop_at_eos=False)
    stream = stub.GenerateStream(request, timeout=300)
    next(stream)
    with paused(service_pid(ops, "verifier")):
        rounds = metrics(_port(ops))["specfleet:rounds_total"]  # still, but for the round in flight
        stream.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        deadline = time.monotonic() + 60
        while "request ops-cancel cancelled: its gRPC client cancelled it" not in ops.log_path.read_text():
            assert time.monotonic() < deadline, "the router never noticed the cancellation"
            time.sleep(0.1)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    session_id = session_of(ops, request.request_id)
    held = wait_released(ops, session_id)
    assert session_id not in held["verifier"] | held["drafter"], held
    after = metrics(_port(ops))
    # At most two rounds end after the verifier stopped: one whose verify reply was already on its way to the router,
    # and the one in flight when the router saw the cancellation. A request that kept running would make hundreds.
    assert after["specfleet:rounds_total"] - rounds <= 2
    assert after["specfleet:request_cancelled_total"] - before.get("specfleet:request_cancelled_total", 0) == 1
    finished = lambda sample: sum(v for k, v in sample.items() if k.startswith("specfleet:request_success_total{"))  # noqa: E731
    assert finished(after) == finished(before)


def test_bad_config_on_sighup_is_refused_and_the_old_one_kept(ops, stub):
    """A config that fails validation, sent by SIGHUP to `specfleet serve` and then straight to the router:
    each refuses it with a logged error naming the key, keeps the running config, and keeps serving."""
    original = ops.config_path.read_text()
    bad = yaml.safe_load(original)
    bad["router"]["default_drafter"] = "drafter-copy"  # would change routing, were it applied
    bad["router"]["max_running"] = 0

    def drafters_used() -> set[str]:
        reply = stub.Generate(greedy_request(PROMPTS[3], 12, 4), timeout=120)
        assert len(reply.token_ids) == 12
        return {d.drafter for d in reply.speculation.drafters}

    def wait_for_log(text: str) -> str:
        deadline = time.monotonic() + 60
        while text not in (log := ops.log_path.read_text()):
            assert time.monotonic() < deadline, f"{text!r} never logged"
            time.sleep(0.2)
        return log

    assert drafters_used() == {"drafter-noisy"}
    try:
        ops.config_path.write_text(yaml.safe_dump(bad))
        ops.proc.send_signal(signal.SIGHUP)
        log = wait_for_log("reload refused")
        refusal = next(line for line in log.splitlines() if "reload refused" in line)
        assert "router.max_running" in refusal, refusal
        assert drafters_used() == {"drafter-noisy"}

        # The router guards itself too: its own copy of the config, made bad, then SIGHUP to it alone.
        router = service_pid(ops, "router")
        command = open(f"/proc/{router}/cmdline", "rb").read().split(b"\0")
        router_config = command[command.index(b"--config") + 1].decode()
        with open(router_config) as f:
            running = f.read()
        made_bad = yaml.safe_load(running)
        made_bad["router"].update(default_drafter="drafter-copy", max_running=0)
        try:
            with open(router_config, "w") as f:
                f.write(yaml.safe_dump(made_bad))
            os.kill(router, signal.SIGHUP)
            log = wait_for_log("reload failed")
            failure = next(line for line in log.splitlines() if "reload failed" in line)
            assert "router.max_running" in failure, failure
            assert drafters_used() == {"drafter-noisy"}
        finally:
            with open(router_config, "w") as f:
                f.write(running)
    finally:
        ops.config_path.write_text(original)
    assert "reloaded" not in ops.log_path.read_text()


def test_refused_requests_count_as_failures_by_status(ops, stub):
    """A request the router refuses before running it (here: max_tokens 0) is a failure in the metrics, under its
    gRPC status, as much as one that fails later."""
    name = 'specfleet:request_failure_total{code="INVALID_ARGUMENT"}'
    before = metrics(_port(ops)).get(name, 0.0)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(greedy_request(PROMPTS[0], 0, 2), timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert metrics(_port(ops)).get(name, 0.0) - before == 1


def test_chats_are_rendered_by_the_configured_chat_template(ops, random_family):
    """router.chat_template: a target whose tokenizer has no chat template serves chats rendered by the configured one."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ops.config['router']['http_port']}/v1", api_key="-", max_retries=0, timeout=600)
    reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    tokenizer = load_tokenizer(str(random_family["target"]))
    assert reply.usage.prompt_tokens == len(tokenizer.encode("[user] hi\n[assistant]", add_special_tokens=False))


def test_a_router_that_stores_no_responses_says_so(ops):
    """router.response_store_mb 0: a response says store false, reading it back is a 404 naming the setting, and a
    background response (read back by GET) is refused naming it."""
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{ops.config['router']['http_port']}/v1", api_key="-", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    reply = client.responses.create(model=model, input="hi", max_output_tokens=2)
    assert reply.store is False
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(reply.id)
    assert "router.response_store_mb is 0" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=model, input="hi", max_output_tokens=2, background=True)
    assert err.value.body["param"] == "background" and "router.response_store_mb is 0" in err.value.body["message"]
