"""Fuzzing the OpenAI-compatible HTTP API of a real `specfleet serve` with random and mutated requests over sockets.

Seeded and bounded: SPECFLEET_HTTP_FUZZ_REQUESTS requests (default 1,200: about a minute here), or with
SPECFLEET_HTTP_FUZZ_SECONDS as many as fit in that time (the 30-minute run of docs/benchmarks/http-fuzz.md);
SPECFLEET_HTTP_FUZZ_SEED picks the sequence. Requests are valid completion and chat bodies with one to three
fields set to what a hostile or careless client sends (wrong types, numbers past every integer width, NaN and
infinities, lone surrogates, deep nesting, huge strings and lists, unknown fields), bodies cut short or made of
random bytes, wrong methods, unknown and odd routes, missing or wrong API keys and content types, lying
Content-Length headers, streaming and non-streaming, and requests whose client hangs up early.

Afterwards: no answer of 500 or above, every refusal in OpenAI's error shape, no connection dropped without
`Connection: close`, the router alive with its RSS and its /metrics page flat over the second half of the run, no
traceback in any log, and a greedy request equal to the target alone.
"""

from __future__ import annotations

import collections
import json
import os
import random
import socket
import string
import threading
import time

import pytest

from tests.e2e.test_fuzz import rss_mb
from tests.harness import Cluster, cluster_config, free_port
from tests.helpers import PROMPTS, target_greedy
from tests.operations import host_pid

REQUESTS = int(os.environ.get("SPECFLEET_HTTP_FUZZ_REQUESTS", "1200"))
SECONDS = float(os.environ.get("SPECFLEET_HTTP_FUZZ_SECONDS", "0"))
SEED = int(os.environ.get("SPECFLEET_HTTP_FUZZ_SEED", "29"))
CLIENTS = 6  # connections sending at once
API_KEY = "fuzz-key"
MAX_REQUEST_BYTES = 256 * 1024
SOCKET_TIMEOUT_S = 120.0
# As in test_fuzz.py: what the router may keep after a burst (the allocator's high-water mark), against a leak
# that raises it quarter after quarter.
RSS_GROWTH_MB = 40
METRICS_GROWTH_BYTES = 16 * 1024

HUGE_INTS = [2**31, 2**32 + 1, 2**63, 2**64 + 7, -(2**63) - 1, 10**30]
ODD_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "1e-999", "-0.0", "0.5", "-1", "0"]
ODD_STRINGS = ["", " ", "\ud800", "\udfff\ud800", "\x00", "\u202e", "💥" * 50, "a" * 100_000, "%s%n", "../../etc/passwd", "null"]
FIELDS = [
    "model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user", "n",
    "frequency_penalty", "presence_penalty", "logit_bias", "repetition_penalty", "top_k", "ignore_eos",
    "return_tokens_as_token_ids", "speculation", "domain", "request_id", "logprobs", "echo", "best_of", "suffix",
    "prompt", "messages", "max_completion_tokens", "top_logprobs",
]  # fmt: skip
ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ping", "/load", "/version"]
ODD_ROUTES = [
    "/",
    "/v1",
    "/v1/",
    "/v1/completions/",
    "/v1/embeddings",
    "/v2/completions",
    "/v1/../v1/models",
    "/%ff%fe",
    "/v1/models?x=" + "y" * 5000,
]
METHODS = ["GET", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]


class Fuzzer:
    def __init__(self, rng: random.Random, model: str, vocab: int):
        self.rng, self.model, self.vocab = rng, model, vocab

    def odd_value(self, depth: int = 0):
        """A JSON value a schema would not expect: any type, any size."""
        r = self.rng.random()
        if r < 0.15:
            return self.rng.choice(HUGE_INTS)
        if r < 0.3:
            return _Raw(self.rng.choice(ODD_NUMBERS))
        if r < 0.45:
            return self.rng.choice(ODD_STRINGS)
        if r < 0.55:
            return self.rng.choice([None, True, False, [], {}, 0, -1, 1.5])
        if r < 0.62:
            return _Raw("[" * 3000 + "]" * 3000)  # deeper than a recursive parser's stack
        if r < 0.7:
            return [self.rng.randrange(-5, self.vocab + 5) for _ in range(self.rng.choice([1, 10, 5000]))]
        if r < 0.8 and depth < 3:
            return {self.word(): self.odd_value(depth + 1) for _ in range(self.rng.randint(0, 4))}
        if r < 0.9 and depth < 3:
            return [self.odd_value(depth + 1) for _ in range(self.rng.randint(0, 4))]
        return self.word()

    def word(self) -> str:
        return "".join(self.rng.choice(string.ascii_letters + "_-") for _ in range(self.rng.randint(1, 12)))

    def valid(self, chat: bool) -> dict:
        body: dict = {"model": self.model, "max_tokens": self.rng.randint(1, 6), "temperature": self.rng.choice([0, 0.7, 1.0])}
        if chat:
            body["messages"] = [{"role": self.rng.choice(["user", "system"]), "content": self.rng.choice(PROMPTS)}]
        else:
            body["prompt"] = self.rng.choice([self.rng.choice(PROMPTS), [self.rng.choice(PROMPTS)] * 2, [1, 2, 3]])
        for field, value in [("stream", True), ("n", 2), ("seed", 7), ("stop", ["\n"]), ("logprobs", 2 if not chat else True)]:
            if self.rng.random() < 0.15:
                body[field] = value
        if body.get("stream") and self.rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        if self.rng.random() < 0.2:
            body["speculation"] = {"max_draft_tokens": self.rng.randint(0, 6)}
        return body

    def request(self) -> tuple[str, str, dict, bytes]:
        """(method, path, headers, body) of one request."""
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
        r = self.rng.random()
        if r < 0.04:
            headers.pop("Authorization")
        elif r < 0.07:
            headers["Authorization"] = self.rng.choice(["Bearer wrong", "Basic eA==", "Bearer " + API_KEY + " ", "Bearer"])
        if self.rng.random() < 0.05:
            headers["Content-Type"] = self.rng.choice(["text/plain", "application/x-www-form-urlencoded", "", "application/json; charset=latin-1"])
        r = self.rng.random()
        if r < 0.05:
            return self.rng.choice(METHODS), self.rng.choice(ROUTES), headers, b""
        if r < 0.1:
            return self.rng.choice(["GET", "POST"]), self.rng.choice(ODD_ROUTES), headers, b"{}"
        if r < 0.13:
            return "GET", self.rng.choice(ROUTES[2:]), headers, b""
        chat = self.rng.random() < 0.5
        path = ROUTES[1] if chat else ROUTES[0]
        body = self.valid(chat)
        r = self.rng.random()
        if r < 0.55:
            for _ in range(self.rng.randint(1, 3)):
                body[self.rng.choice(FIELDS)] = self.odd_value()
        elif r < 0.6:
            body.pop(self.rng.choice(list(body)))
        elif r < 0.65:
            body["messages" if chat else "prompt"] = self.odd_value()
        data = _dumps(body)
        r = self.rng.random()
        if r < 0.04:
            data = data[: self.rng.randrange(len(data))]
        elif r < 0.07:
            data = bytes(self.rng.randrange(256) for _ in range(self.rng.randint(0, 200)))
        elif r < 0.09:
            data = data.replace(b'"', b"\xff", 1)
        elif r < 0.11:
            data = b"x" * (MAX_REQUEST_BYTES + self.rng.choice([1, 1000]))
        return "POST", path, headers, data


class _Raw(str):
    """A JSON token written as is (NaN, 1e999, deep brackets): json.dumps cannot write them."""


def _dumps(value) -> bytes:
    if isinstance(value, _Raw):
        return value.encode()
    if isinstance(value, dict):
        return b"{" + b",".join(json.dumps(k).encode() + b":" + _dumps(v) for k, v in value.items()) + b"}"
    if isinstance(value, list):
        return b"[" + b",".join(_dumps(v) for v in value) + b"]"
    return json.dumps(value).encode("utf-8", "surrogatepass")


class Connection:
    """One keep-alive HTTP/1.1 connection over a plain socket, reopened only where the server said it would close."""

    def __init__(self, port: int):
        self.port, self.sock, self.buffer = port, None, b""

    def send(self, method: str, path: str, headers: dict, body: bytes, hang_up: bool, content_length: int | None) -> tuple[int, dict, bytes] | None:
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=SOCKET_TIMEOUT_S)
            self.buffer = b""
        length = len(body) if content_length is None else content_length
        head = f"{method} {path} HTTP/1.1\r\nHost: fuzz\r\nContent-Length: {length}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        self.sock.sendall(head.encode("latin-1") + body)
        if hang_up:
            self.close()
            return None
        status, response_headers, payload = self._read(method)
        if response_headers.get("connection", "").lower() == "close" or length != len(body):
            self.close()
        return status, response_headers, payload

    def _read(self, method: str) -> tuple[int, dict, bytes]:
        while b"\r\n\r\n" not in self.buffer:
            self._more()
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
        if method == "HEAD":
            payload = b""
        elif "content-length" in headers:
            size = int(headers["content-length"])
            while len(self.buffer) < size:
                self._more()
            payload, self.buffer = self.buffer[:size], self.buffer[size:]
        elif headers.get("transfer-encoding") == "chunked":
            payload = self._chunked()
        else:
            payload = b""
        return status, headers, payload

    def _chunked(self) -> bytes:
        payload = b""
        while True:
            while b"\r\n" not in self.buffer:
                self._more()
            size_line, self.buffer = self.buffer.split(b"\r\n", 1)
            size = int(size_line.split(b";")[0], 16)
            while len(self.buffer) < size + 2:
                self._more()
            payload, self.buffer = payload + self.buffer[:size], self.buffer[size + 2 :]
            if size == 0:
                return payload

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection without saying Connection: close")
        self.buffer += data

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
        self.sock = None


def check_answer(method: str, status: int, headers: dict, payload: bytes) -> str:
    """What is wrong with an answer, or ''."""
    if status >= 500:
        return f"status {status}: {payload[:300]!r}"
    if status >= 400 and method != "HEAD":
        try:
            error = json.loads(payload)["error"]
            assert isinstance(error["message"], str) and error["message"] and "type" in error and "code" in error
        except Exception:
            return f"status {status} not in OpenAI's error shape: {payload[:300]!r}"
    if status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
        events = [line for line in payload.decode("utf-8").split("\n\n") if line.strip()]
        if events[-1].strip() != "data: [DONE]" or any('"error"' in event for event in events):
            return f"a stream that did not end in [DONE]: {payload[-300:]!r}"
    return ""


@pytest.fixture(scope="module")
def http_fuzz_cluster(random_family, tmp_path_factory):
    config = cluster_config(
        random_family,
        router={
            "http_port": free_port(),
            "metrics_port": free_port(),
            "max_request_bytes": MAX_REQUEST_BYTES,
            "max_tokens_limit": 6,  # valid requests stay short: the fuzz is about input, not throughput
            "default_max_tokens": 4,
        },
    )
    cluster = Cluster(config, tmp_path_factory.mktemp("http-fuzz"), "http-fuzz", env={"SPECFLEET_API_KEY": API_KEY}).start()
    yield cluster
    cluster.stop()


@pytest.mark.timeout(900 + SECONDS)
def test_fuzz_the_http_api(http_fuzz_cluster, random_family):
    cluster = http_fuzz_cluster
    port, metrics_port = cluster.config["router"]["http_port"], cluster.config["router"]["metrics_port"]
    pid = host_pid(cluster, "router")
    model = json.loads(Connection(port).send("GET", "/v1/models", {"Authorization": f"Bearer {API_KEY}"}, b"", False, None)[2])["data"][0]["id"]
    vocab = json.loads((random_family["target"] / "config.json").read_text())["vocab_size"]
    statuses: collections.Counter = collections.Counter()
    failures: list[str] = []
    lock = threading.Lock()

    def client(index: int, count: int, until: float, part: int) -> None:
        fuzzer = Fuzzer(random.Random(f"{SEED}-{part}-{index}"), model, vocab)
        connection = Connection(port)
        sent = 0
        while sent < count and time.monotonic() < until:
            sent += 1
            method, path, headers, body = fuzzer.request()
            hang_up = fuzzer.rng.random() < 0.03
            lie = fuzzer.rng.random() < 0.03 and body
            try:
                answer = connection.send(method, path, headers, body, hang_up, len(body) - 1 if lie else None)
            except Exception as err:  # a dropped connection, a hang past the socket's timeout
                connection.close()
                # A body over the limit or without the key is refused unread, and a lying Content-Length leaves bytes
                # the server reads as a broken next request: each closes the connection with bytes unread, which
                # resets it, and the client may see the reset before the answer.
                unread = len(body) > MAX_REQUEST_BYTES or (path.startswith("/v1") and headers.get("Authorization") != f"Bearer {API_KEY}")
                if not (isinstance(err, ConnectionResetError) and (lie or unread)):
                    with lock:
                        failures.append(f"{method} {path}: {type(err).__name__}: {err}; body {body[:200]!r}")
                continue
            if answer is None:
                continue
            problem = check_answer(method, *answer)
            with lock:
                statuses[answer[0]] += 1
                if problem:
                    failures.append(f"{method} {path} {body[:200]!r}: {problem}")
        connection.close()

    def metrics_bytes() -> int:
        sock = Connection(metrics_port)
        try:
            return len(sock.send("GET", "/metrics", {}, b"", False, None)[2])
        finally:
            sock.close()

    rss, page = [], []
    deadline = time.monotonic() + SECONDS if SECONDS else float("inf")
    started = time.monotonic()
    for part in range(4):
        until = started + SECONDS * (part + 1) / 4 if SECONDS else deadline
        count = REQUESTS // (4 * CLIENTS) if not SECONDS else 1 << 40
        threads = [threading.Thread(target=client, args=(i, count, until, part)) for i in range(CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rss.append(round(rss_mb(pid), 1))
        page.append(metrics_bytes())

    print(
        f"HTTP fuzz: {sum(statuses.values())} answers in {time.monotonic() - started:.0f} s, seed {SEED}, statuses {dict(sorted(statuses.items()))}"
    )
    print(f"  router RSS MB after each quarter {rss}; /metrics bytes {page}")
    assert not failures, "\n".join(failures[:20])
    assert os.path.exists(f"/proc/{pid}"), "the router died"
    assert statuses[200] and statuses[400] and statuses[401] and statuses[404] and statuses[413], statuses
    assert rss[-1] - max(rss[:-1]) <= RSS_GROWTH_MB, f"router RSS after each quarter {rss} MB"
    assert page[-1] - max(page[:-1]) <= METRICS_GROWTH_BYTES, f"/metrics bytes after each quarter {page}"
    log = cluster.log_path.read_text()
    assert "Traceback" not in log, log[log.index("Traceback") - 2000 : log.index("Traceback") + 3000]

    reference = target_greedy(str(random_family["target"]), PROMPTS[0], 6)
    body = {"model": model, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "return_tokens_as_token_ids": True, "logprobs": 0}
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    status, _, payload = Connection(port).send("POST", "/v1/completions", headers, json.dumps(body).encode(), False, None)
    assert status == 200, payload
    tokens = [int(t.removeprefix("token_id:")) for t in json.loads(payload)["choices"][0]["logprobs"]["tokens"]]
    assert tokens == reference
