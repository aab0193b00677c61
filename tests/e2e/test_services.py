"""Operational behaviour of the servers: health, reflection, start-up checks, graceful shutdown."""

from __future__ import annotations

import os
import pathlib
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specfleet.config import DEFAULT_HTTP_PORT
from specfleet.v1 import generation_pb2_grpc
from tests.harness import REPO, Cluster, cluster_config, free_port
from tests.helpers import PROMPTS, greedy_request, target_greedy
from tests.operations import children


@pytest.mark.parametrize("which", ["router", "verifier", "drafter"])
def test_every_server_has_health_and_reflection(cluster, which):
    address = {"router": cluster.router, "verifier": cluster.verifier, "drafter": cluster.drafter}[which]
    expected = {"router": "specfleet.v1.Generation", "verifier": "specfleet.v1.Verifier", "drafter": "specfleet.v1.Drafter"}[which]
    with cluster.channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", expected):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert {expected, "grpc.health.v1.Health"} <= names


def test_drafter_with_another_tokenizer_is_refused_at_startup(random_family, tmp_path):
    from specfleet.random_models import _train_tokenizer  # a differently trained vocabulary
    from transformers import AutoModelForCausalLM

    other = tmp_path / "other-drafter"
    tokenizer = _train_tokenizer(other, vocab_size=300)
    model = AutoModelForCausalLM.from_pretrained(str(random_family["drafter-random"]))
    model.resize_token_embeddings(len(tokenizer))
    model.save_pretrained(str(other))
    config = cluster_config(random_family)
    config["drafters"][0]["models"] = [{"name": "mismatched", "path": str(other)}]
    config["router"]["default_drafter"] = "mismatched"
    cluster = Cluster(config, tmp_path, "mismatch")
    with pytest.raises(RuntimeError):
        cluster.start(timeout_s=120)
    log = cluster.log_path.read_text()
    assert "uses a different tokenizer" in log and "mismatched" in log, log[-2000:]


def test_ctrl_c_stops_every_service_even_when_started_as_a_background_job(random_family, tmp_path):
    # The drafter service a process of its own: two processes to stop.
    cluster = Cluster(cluster_config(random_family, drafter_service={"colocate": False}), tmp_path, "bg").start(sigint_ignored=True)
    services = children(cluster.proc.pid)
    assert len(services) == 2  # the router with the verifier in its process, the drafter
    cluster.proc.send_signal(signal.SIGINT)
    assert cluster.proc.wait(timeout=20) == 0
    deadline = time.monotonic() + 10
    while any(pathlib.Path(f"/proc/{pid}").exists() for pid in services) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in services if pathlib.Path(f"/proc/{pid}").exists()]
    cluster.stop()


def test_services_die_with_a_killed_serve(random_family, tmp_path):
    """`specfleet serve` killed outright (no chance to stop anything): its services, each in its own
    process group, go with it rather than running on unattended."""
    cluster = Cluster(cluster_config(random_family, drafter_service={"colocate": False}), tmp_path, "killed").start()
    services = children(cluster.proc.pid)
    assert len(services) == 2  # the router with the verifier in its process, the drafter
    cluster.proc.kill()
    cluster.proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while [pid for pid in services if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.2)
    survivors = [pid for pid in services if _alive(pid)]
    for pid in survivors:  # leave nothing behind, whatever the verdict
        os.kill(pid, signal.SIGKILL)
    assert not survivors
    cluster.stop()


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its (dead) parent's reaper."""
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_each_service_runs_on_the_cores_its_config_names(random_family, tmp_path):
    """verifier.cpus / drafters[].cpus / router.cpus pin the processes `specfleet serve` starts; the router with the
    verifier in its process (verifier.colocate, the default) runs on the cores of both (tests/specfleet/test_cli.py: the
    processes of each setting)."""
    last = max(os.sched_getaffinity(0))
    config = cluster_config(random_family, verifier={"cpus": [last]}, drafter_service={"cpus": [0], "colocate": False}, router={"cpus": [0]})
    cluster = Cluster(config, tmp_path, "pinned").start()
    try:
        pinned = {}
        for pid in children(cluster.proc.pid):
            command = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            service = next(name for name in ("verifier_service", "drafter_service", "specfleet.colocated") if f"-m {name}" in command)
            pinned[service] = os.sched_getaffinity(pid)
        assert pinned == {"drafter_service": {0}, "specfleet.colocated": {0, last}}
        with cluster.channel() as channel:  # and it still serves
            reply = generation_pb2_grpc.GenerationStub(channel).Generate(greedy_request(PROMPTS[0], 8, 2), timeout=60)
        assert list(reply.token_ids) == target_greedy(str(random_family["target"]), PROMPTS[0], 8)
    finally:
        cluster.stop()
    bad = cluster_config(random_family, verifier={"cpus": [4096]})
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    out = subprocess.run(
        [sys.executable, "-m", "specfleet.cli", "serve", "--config", str(tmp_path / "bad.yaml")], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "verifier: cpus [4096] are not all usable here" in out.stderr


def _descendants(pid: int) -> list[int]:
    found = children(pid)
    return found + [d for child in found for d in _descendants(child)]


# The OpenAI API's streams during a stop: long enough to be provably mid-generation at the signal.
DRAIN_STREAMS = 8
DRAIN_STREAM_TOKENS = 600  # outlasting the gRPC stream (GRPC_STREAM_TOKENS)
GRPC_STREAM_TOKENS = 300


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_sigterm_lets_in_flight_requests_finish(random_family, tmp_path, monkeypatch, how):
    """SIGTERM to `specfleet serve`, or a terminal's Ctrl-C (SIGINT to its whole process group), while a gRPC
    stream and 8 HTTP streams (the official `openai` client) are provably mid-generation (first chunks
    streamed, the verifier paused, all 9 running, well over a hundred tokens to go): new requests are refused,
    UNAVAILABLE over gRPC and 503 saying why over HTTP; every in-flight one finishes with its full, correct
    output (finish_reason `length`); serve exits 0 by itself, having stopped the router before the services
    the router's last rounds need, and having killed nothing; no process it started is left."""
    import functools

    import openai

    from specfleet.tokenizer import load_tokenizer
    from specfleet.serving import ROUTER_DRAIN_S
    from tests.operations import metrics, paused, service_pid

    http_port = free_port()
    # The verifier in a process of its own: the test pauses it alone. One token a request a plain round (not up to
    # plain_steps): the rounds since a request started then bound the tokens it has made (below).
    router = {"metrics_port": free_port(), "http_port": http_port, "plain_steps": 1}
    config = cluster_config(random_family, verifier={"colocate": False}, router=router)
    cluster = Cluster(config, tmp_path, "graceful")
    with monkeypatch.context() as patch:
        # As from a terminal: serve leads its own process group, which Ctrl-C signals as a whole.
        patch.setattr(subprocess, "Popen", functools.partial(subprocess.Popen, start_new_session=True))
        cluster.start()
    started = _descendants(cluster.proc.pid)
    target = str(random_family["target"])
    prompt = PROMPTS[0]
    reference = target_greedy(target, prompt, GRPC_STREAM_TOKENS)
    assert len(reference) > 150
    tokenizer = load_tokenizer(target)
    http_prompts = PROMPTS[1 : 1 + DRAIN_STREAMS]
    expected = [tokenizer.decode(target_greedy(target, p, DRAIN_STREAM_TOKENS), skip_special_tokens=True) for p in http_prompts]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    try:
        with cluster.channel() as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            # Without drafting every request makes one token a round: the router's rounds (of any lane)
            # since a request started bound the tokens it has made.
            rounds = lambda: metrics(config["router"]["metrics_port"])["specfleet:rounds_total"]  # noqa: E731
            http_started = rounds()
            http_streams, texts = [], []
            for p in http_prompts:
                http_stream = client.completions.create(
                    model=model,
                    prompt=p,
                    max_tokens=DRAIN_STREAM_TOKENS,
                    temperature=0,
                    stream=True,
                    extra_body={"speculation": {"disabled": True}},
                )
                texts.append(next(iter(http_stream)).choices[0].text)  # generating
                http_streams.append(http_stream)
            grpc_started = rounds()
            request = greedy_request(prompt, GRPC_STREAM_TOKENS, 2)
            request.speculation.disabled = True
            stream = stub.GenerateStream(request, timeout=300)
            tokens = list(next(stream).token_ids)
            with paused(service_pid(cluster, "verifier")):
                assert metrics(config["router"]["metrics_port"])["specfleet:num_requests_running"] == 1 + DRAIN_STREAMS
                made = rounds()
                assert made - http_started < DRAIN_STREAM_TOKENS - 50, f"the HTTP streams made up to {made - http_started} tokens before the signal"
                assert made - grpc_started < len(reference) - 100, f"the gRPC stream made up to {made - grpc_started} tokens before the signal"
                if how == "sigterm":
                    cluster.proc.send_signal(signal.SIGTERM)
                else:
                    os.killpg(cluster.proc.pid, signal.SIGINT)
                deadline = time.monotonic() + 60
                while "router shutting down" not in cluster.log_path.read_text():
                    assert time.monotonic() < deadline, "the router never began to shut down"
                    time.sleep(0.1)
                with pytest.raises(grpc.RpcError) as refused:
                    with cluster.channel() as fresh:
                        generation_pb2_grpc.GenerationStub(fresh).Generate(greedy_request(PROMPTS[1], 4), timeout=30)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
                with pytest.raises(openai.APIStatusError) as refused_http:
                    client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=4)
                assert refused_http.value.status_code == 503
                assert "shutting down" in refused_http.value.message and "in flight" in refused_http.value.message
            tokens += [t for chunk in stream for t in chunk.token_ids]
            # No gRPC call is left; the HTTP streams still run, and a slow verifier pass holds them longer
            # than uvicorn's own 5 s shutdown would wait: the router's drain waits for them.
            with paused(service_pid(cluster, "verifier")):
                assert metrics(config["router"]["metrics_port"])["specfleet:num_requests_running"] == DRAIN_STREAMS
                time.sleep(7)
            finishes = []
            for i, http_stream in enumerate(http_streams):
                for chunk in http_stream:
                    texts[i] += chunk.choices[0].text
                    if chunk.choices[0].finish_reason:
                        finishes.append(chunk.choices[0].finish_reason)
        assert tokens == reference
        assert texts == expected
        assert finishes == ["length"] * DRAIN_STREAMS
        assert cluster.proc.wait(timeout=ROUTER_DRAIN_S + 60) == 0
    finally:
        client.close()
        cluster.stop()
    log = cluster.log_path.read_text()
    assert "killing it" not in log, log[-3000:]
    assert "did not finish within" not in log, log[-3000:]
    lines = log.splitlines()

    def first(text: str) -> int:
        return next(i for i, line in enumerate(lines) if text in line)

    assert first("router stopped") < first("verifier shutting down")
    assert first("router stopped") < first("drafters shutting down")
    assert len(started) >= 3
    left = [pid for pid in started if pathlib.Path(f"/proc/{pid}").exists()]
    assert not left, f"processes left after serve exited: {left}"


def test_cli_generate_sends_the_domain_it_is_given(cluster):
    """--domain is GenerateRequest.domain: it replaces the router's guess from the prompt (router.use_domain_hint)."""

    def domain(*flags: str) -> str:
        command = [sys.executable, "-m", "specfleet.cli", "generate", "--server", cluster.router, "--max-tokens", "2", "--stats", *flags, PROMPTS[0]]
        out = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)
        assert out.returncode == 0, out.stderr
        return re.search(r"; domain: (\S+)\]", out.stderr).group(1)

    guessed = domain()
    assert guessed != "a-domain-no-prompt-suggests"
    assert domain("--domain", "a-domain-no-prompt-suggests") == "a-domain-no-prompt-suggests"
    assert "domain a-domain-no-prompt-suggests," in cluster.log_path.read_text()


def test_cli_generate_follows_a_guide_and_names_one_that_does_not_compile(cluster):
    """`specfleet generate --choice/--regex`: the output follows the guide; a guide that does not compile is refused
    with the router's reason and exit code 1."""

    def generate(*flags: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "specfleet.cli", "generate", "--server", cluster.router, "--max-tokens", "16", *flags, PROMPTS[0]]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=REPO)

    chose = generate("--choice", "yes", "--choice", "no")
    assert chose.returncode == 0 and chose.stdout in ("yes\n", "no\n"), (chose.stdout, chose.stderr)
    bad = generate("--regex", "[a-")
    assert bad.returncode == 1 and "INVALID_ARGUMENT: guide: the regex does not compile" in bad.stderr, bad.stderr


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_cli_generate_prints_text(cluster, stream):
    """`specfleet generate` prints the completion (streamed or whole) on stdout, its stats on stderr."""
    with cluster.channel() as channel:
        expected = generation_pb2_grpc.GenerationStub(channel).Generate(greedy_request(PROMPTS[0], 8), timeout=120)
    assert expected.text.strip()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "specfleet.cli",
            "generate",
            "--server",
            cluster.router,
            "--max-tokens",
            "8",
            "--stats",
            *(["--stream"] if stream else []),
            PROMPTS[0],
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected.text + "\n"
    assert "finish: length; rounds: " in out.stderr and "8 tokens, " in out.stderr
    # Which drafters drafted (the cluster has one; none if the router drafted in no round), rounds and accepted tokens.
    drafter = cluster.config["drafters"][0]["models"][0]["name"]
    assert re.search(rf"\[drafters: (none|{drafter} \d+ rounds \d+/\d+ accepted)\]", out.stderr), out.stderr
    # Where the time went: the whole call, the router's draft and verify calls (wall = compute + queue + transport)
    # and the router's own time.
    timing = re.search(
        r"\[time: (\d+) ms, [\d.]+ ms/token, [\d.]+ tokens/s(; first token \d+ ms)?; "
        r"draft \d+ ms wall = \d+ compute \+ \d+ queue \+ \d+ transport; "
        r"verify (\d+) ms wall = (\d+) compute \+ \d+ queue \+ \d+ transport; router \d+ ms; "
        r"per token: draft [\d.]+/[\d.]+ ms, verify [\d.]+/[\d.]+ ms \(wall/compute\)\]",
        out.stderr,
    )
    assert timing, out.stderr
    assert (timing.group(2) is not None) == stream
    assert int(timing.group(4)) <= int(timing.group(3)) <= int(timing.group(1)) and int(timing.group(3)) > 0
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "specfleet.cli",
            "generate",
            "--server",
            cluster.router,
            "--temperature",
            "-1",
            *(["--stream"] if stream else []),
            "x",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert bad.returncode == 1 and "INVALID_ARGUMENT: temperature" in bad.stderr


def test_the_ready_message_prints_what_listens_not_what_was_asked_for(random_family, tmp_path):
    """The HTTP API's default port taken: `serve` says the API is off and why, rather than a URL that reaches
    whoever holds the port; the router's metrics on the port the config names: that address."""
    # Held by this test for the whole run: another test's serve (on the other worker) may hold it a while, and
    # could let it go between this test's look and its router's start.
    holder, deadline = socket.socket(), time.monotonic() + 120
    while True:
        try:
            holder.bind(("127.0.0.1", DEFAULT_HTTP_PORT))
            break
        except OSError:
            assert time.monotonic() < deadline, f"port {DEFAULT_HTTP_PORT} stayed taken for 2 minutes"
            time.sleep(0.5)
    holder.listen()
    metrics = free_port()
    cluster = Cluster(cluster_config(random_family, router={"http_port": None, "metrics_port": metrics}), tmp_path, "ports").start()
    # The lines after the ready line, read beside the test: a line that never comes fails the test after a minute,
    # and serve is stopped only once they are in (a SIGINT between two of them would cut the message short).
    printed: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [printed.put(line.strip()) for line in cluster.proc.stdout], daemon=True).start()
    lines, deadline = [], time.monotonic() + 60
    try:
        while len(lines) < 3 and time.monotonic() < deadline:
            try:
                lines.append(printed.get(timeout=max(0.1, deadline - time.monotonic())))
            except queue.Empty:
                break
    finally:
        cluster.stop()
        holder.close()
    assert len(lines) == 3, lines
    assert lines[0].startswith("try: ")
    assert lines[1] == f"OpenAI-compatible API: off: its default port {DEFAULT_HTTP_PORT} is in use; set router.http_port to another port"
    assert lines[2] == f"metrics: router http://127.0.0.1:{metrics}/metrics"
