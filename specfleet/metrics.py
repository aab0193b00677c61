"""Prometheus metrics of every service (`prometheus_client`), each on its own /metrics port.

Names follow vLLM's where the meaning is the same (prefix `specfleet:` for
`vllm:`), and the router's series carry `model_name` (the served model's name), so
dashboards and autoscalers written for vLLM read specfleet:

    router    specfleet:num_requests_running, :num_requests_waiting,
              :time_to_first_token_seconds, :inter_token_latency_seconds,
              :e2e_request_latency_seconds, :request_success_total{finished_reason},
              :request_queue_time_seconds, :request_prefill_time_seconds, :request_decode_time_seconds,
              :request_inference_time_seconds, :request_prompt_tokens, :request_generation_tokens,
              :request_params_max_tokens,
              :prompt_tokens_total, :generation_tokens_total,
              :spec_decode_num_drafts_total, :spec_decode_num_draft_tokens_total,
              :spec_decode_num_accepted_tokens_total,
              :spec_decode_num_accepted_tokens_per_pos_total{position}
              and specfleet's own: :drafter_draft_tokens_total{drafter,domain},
              :drafter_accepted_tokens_total{drafter,domain}, :routing_decisions_total{drafter,domain},
              :fusion_width, :pipeline_lane_requests{lane}, :draft_call_seconds{drafter_service},
              :verify_call_seconds, :round_phase_seconds{phase}
    verifier  specfleet:verifier_batch_size, :verifier_pass_seconds, :sessions, :kv_cache_used_bytes,
              :kv_cache_usage_perc, :num_preemptions_total, :prefix_cache_queries_total, :prefix_cache_hits_total
    drafter   specfleet:drafter_batch_size{drafter_service}, :drafter_pass_seconds{drafter_service},
              :sessions{drafter_service}, :kv_cache_used_bytes{drafter_service}, :kv_cache_usage_perc{drafter_service},
              :num_preemptions_total{drafter_service}, :prefix_cache_queries_total{drafter_service},
              :prefix_cache_hits_total{drafter_service}

Each service has its own registry, so a test (or a process hosting several
services) never mixes their samples.

The router's metrics are its own (`router/telemetry.py`, `RouterTelemetry`); this module has
the verifier's and drafters' (`PassTelemetry`) and the /metrics endpoint every service serves.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import ssl
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

log = logging.getLogger(__name__)

# No `*_created` sample beside every counter and histogram (as vLLM): they double the text
# and nothing here reads them.
disable_created_metrics()

# vLLM's buckets for request latencies (seconds), so that quantiles compare across the two.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
# Token counts (vLLM's 1-2-5 series), up to a long context's.
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
# A forward pass or an RPC of ours: a millisecond to a few seconds.
PASS_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0, 4.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


# A scrape is one short request: a client gets this long to send it all (a slow client cannot hold a
# connection), at most this many connections are served at once (more are answered 503 and closed), and
# a request has at most this many header lines (each within asyncio's 64 KB line limit).
REQUEST_DEADLINE_S = 10.0
MAX_CONNECTIONS = 64
MAX_HEADER_LINES = 100


class _BadRequest(Exception):
    def __init__(self, status: str):
        super().__init__(status)
        self.status = status


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, bytes]:
    """The request line and its Authorization header's value (b"" without one); other headers are
    read and ignored. Raises _BadRequest for what a scrape never sends."""
    try:
        request_line = await reader.readline()
        authorization = b""
        for _ in range(MAX_HEADER_LINES + 1):
            header = (await reader.readline()).strip()
            if not header:
                return request_line.decode("latin-1"), authorization
            name, _, value = header.partition(b":")
            if name.strip().lower() == b"authorization":
                authorization = value.strip()
    except ValueError:  # a line over the stream's 64 KB limit (asyncio.LimitOverrunError, raised as ValueError)
        raise _BadRequest("431 Request Header Fields Too Large") from None
    raise _BadRequest("431 Request Header Fields Too Large")


def bearer_ok(authorization: bytes, token: str) -> bool:
    """Whether an Authorization header's value is `Bearer token` (the scheme in any case); any value where no token is set."""
    scheme, _, given = authorization.partition(b" ")
    return not token or hmac.compare_digest(scheme.lower() + b" " + given.strip(), f"bearer {token}".encode())


class Labelled:
    """A registry's samples, each with the same labels added: vLLM labels every metric with the served model's
    `model_name`, and dashboards written for vLLM filter on it."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]):
        self.registry, self.labels = registry, labels

    def collect(self):
        for family in self.registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labelled.add_sample(sample.name, {**self.labels, **sample.labels}, sample.value, sample.timestamp, sample.exemplar)
            yield labelled


async def serve(
    sock: socket.socket,
    registry: CollectorRegistry | Labelled,
    ssl_context: ssl.SSLContext | None = None,
    token: str = "",
    deadline_s: float = REQUEST_DEADLINE_S,
    max_connections: int = MAX_CONNECTIONS,
    labels: dict[str, str] | None = None,
) -> asyncio.Server:
    """GET /metrics on `sock` (specfleet.ports.listen): the registry's samples, with `labels` added to each.

    ssl_context: serve HTTPS; token: answer 401 unless the request has `Authorization: Bearer token`
    (specfleet.security.Security.metrics_options gives both).
    """
    exposed = Labelled(registry, labels) if labels else registry
    open_connections = 0

    def respond(writer: asyncio.StreamWriter, status: str, body: bytes, ctype: str = "text/plain") -> None:
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)

    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, status: str, body: bytes) -> None:
        # Answer, then read (briefly) what the client still sends: closing with unread data resets the
        # connection, and the client would see the reset instead of the answer.
        respond(writer, status, body)
        await asyncio.wait_for(writer.drain(), timeout=deadline_s)
        writer.write_eof()
        with contextlib.suppress(asyncio.TimeoutError, ValueError):
            await asyncio.wait_for(reader.read(1 << 20), timeout=min(0.5, deadline_s))

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal open_connections
        open_connections += 1
        try:
            if open_connections > max_connections:
                await refuse(reader, writer, "503 Service Unavailable", b"too many connections\n")
                return
            try:
                request_line, authorization = await asyncio.wait_for(_read_request(reader), timeout=deadline_s)
            except _BadRequest as err:
                await refuse(reader, writer, err.status, b"request too large\n")
                return
            authorized = bearer_ok(authorization, token)
            parts = request_line.split()
            if not authorized:
                respond(writer, "401 Unauthorized", b"unauthorized: send Authorization: Bearer <the metrics token>\n")
            elif len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] == "/metrics":
                body = generate_latest(exposed)
                respond(writer, "200 OK", body, "text/plain; version=0.0.4; charset=utf-8")
            else:
                respond(writer, "404 Not Found", b"not found: try /metrics\n")
            await asyncio.wait_for(writer.drain(), timeout=deadline_s)
        except (asyncio.TimeoutError, ConnectionError, ssl.SSLError):
            pass
        finally:
            open_connections -= 1
            writer.close()

    server = await asyncio.start_server(handle, sock=sock, ssl=ssl_context, ssl_handshake_timeout=5 if ssl_context else None)
    host, port = sock.getsockname()[:2]
    log.info("metrics on %s://%s:%d/metrics%s", "https" if ssl_context else "http", host, port, " (token required)" if token else "")
    return server


@contextlib.asynccontextmanager
async def exported(sock: socket.socket | None, registry: CollectorRegistry, **options):
    """Serve /metrics on `sock` while the body runs; None: metrics are off. options: `serve`'s ssl_context and token."""
    server = await serve(sock, registry, **options) if sock is not None else None
    try:
        yield
    finally:
        if server is not None:
            server.close()


def _store_gauges(registry: CollectorRegistry, stores: Callable[[], list], labels: dict[str, str]) -> None:
    """Sessions held and KV bytes used, read at scrape time from the services' SessionStores."""
    names = list(labels)
    sessions = Gauge("specfleet:sessions", "Sessions held (token ids, and KV unless evicted).", names, registry=registry)
    kv = Gauge("specfleet:kv_cache_used_bytes", "Memory used by the sessions' KV caches.", names, registry=registry)

    def held() -> list:
        # A copy of the dict's values is taken atomically; the model thread may change it meanwhile.
        return [s for store in stores() for s in list(store._sessions.values())]

    (sessions.labels(**labels) if names else sessions).set_function(lambda: len(held()))
    (kv.labels(**labels) if names else kv).set_function(lambda: sum(s.kv_bytes() for s in held()))


class _KVCache:
    """The service's KV cache at scrape time, over its KV pools and session stores: the prefix cache's lookups and
    hits (in tokens), the share of the KV budget sessions hold, and the sessions that lost their KV (preempted, as
    vLLM counts them: their KV is computed again when they next run)."""

    def __init__(self, pools: Callable[[], list], stores: Callable[[], list], labels: dict[str, str]):
        self.pools, self.stores, self.labels = pools, stores, labels

    def collect(self):
        pools = self.pools()
        for name, doc, count in (
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", sum(p.queries for p in pools)),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache (their KV not computed again).", sum(p.hits for p in pools)),
            ("num_preemptions", "Sessions that lost their KV to the budget (computed again when used).", sum(s.evictions for s in self.stores())),
        ):
            yield self._family(CounterMetricFamily, name, doc, count)
        # A pool grown past its budget (one pass's sessions needed more) is measured against what it holds: at most 1.
        budget = sum(max(p.cache_budget, p.blocks - 1) for p in pools)
        doc = "Share of the KV budget's blocks that sessions hold (1: all; vLLM's kv_cache_usage_perc)."
        yield self._family(GaugeMetricFamily, "kv_cache_usage_perc", doc, sum(p.held_blocks for p in pools) / budget if budget else 0.0)

    def _family(self, kind, name: str, doc: str, value: float):
        family = kind(f"specfleet:{name}", doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family


class PassTelemetry:
    """A verifier's or drafter service's forward passes: batch size and time, sessions, KV memory, the prefix cache."""

    def __init__(self, kind: str, stores: Callable[[], list], labels: dict[str, str] | None = None, pools: Callable[[], list] = list):
        self.registry = CollectorRegistry()
        labels = labels or {}
        self.labels = labels
        names = list(labels)
        self.batch_size = Histogram(
            f"specfleet:{kind}_batch_size", f"Sessions in one {kind} forward pass.", names, buckets=BATCH_BUCKETS, registry=self.registry
        )
        self.pass_seconds = Histogram(
            f"specfleet:{kind}_pass_seconds",
            f"Time of one {kind} batch (its forward pass, or passes where sessions decode plain steps, and their bookkeeping).",
            names,
            buckets=PASS_BUCKETS,
            registry=self.registry,
        )
        _store_gauges(self.registry, stores, labels)
        self.registry.register(_KVCache(pools, stores, labels))

    def timed(self, process: Callable[[list], list]) -> Callable[[list], list]:
        """`process` (a BatchQueue's batch function), observing each batch."""
        batch_size = self.batch_size.labels(**self.labels) if self.labels else self.batch_size
        pass_seconds = self.pass_seconds.labels(**self.labels) if self.labels else self.pass_seconds

        def run(items: list) -> list:
            started = time.perf_counter()
            try:
                return process(items)
            finally:
                pass_seconds.observe(time.perf_counter() - started)
                batch_size.observe(len(items))

        return run
