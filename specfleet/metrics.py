"""Prometheus metrics of every service (`prometheus_client`), each on its own /metrics port.

Names follow vLLM's where the meaning is the same (prefix `specfleet:` for
`vllm:`), so dashboards and autoscalers written for vLLM read specfleet:

    router    specfleet:num_requests_running, :num_requests_waiting,
              :time_to_first_token_seconds, :inter_token_latency_seconds,
              :e2e_request_latency_seconds, :request_success_total{finished_reason},
              :prompt_tokens_total, :generation_tokens_total,
              :spec_decode_num_drafts_total, :spec_decode_num_draft_tokens_total,
              :spec_decode_num_accepted_tokens_total,
              :spec_decode_num_accepted_tokens_per_pos_total{position}
              and specfleet's own: :drafter_draft_tokens_total{drafter,domain},
              :drafter_accepted_tokens_total{drafter,domain}, :routing_decisions_total{drafter,domain},
              :fusion_width, :pipeline_lane_requests{lane}, :draft_call_seconds{drafter_service},
              :verify_call_seconds
    verifier  specfleet:verifier_batch_size, :verifier_pass_seconds, :sessions, :kv_cache_used_bytes
    drafter   specfleet:drafter_batch_size{drafter_service}, :drafter_pass_seconds{drafter_service},
              :sessions{drafter_service}, :kv_cache_used_bytes{drafter_service}

Each service has its own registry, so a test (or a process hosting several
services) never mixes their samples.
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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

# No `*_created` sample beside every counter and histogram (as vLLM): they double the text
# and nothing here reads them.
disable_created_metrics()

# vLLM's buckets for request latencies (seconds), so that quantiles compare across the two.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
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


async def serve(
    sock: socket.socket,
    registry: CollectorRegistry,
    ssl_context: ssl.SSLContext | None = None,
    token: str = "",
    deadline_s: float = REQUEST_DEADLINE_S,
    max_connections: int = MAX_CONNECTIONS,
) -> asyncio.Server:
    """GET /metrics on `sock` (specfleet.ports.listen): the registry's samples.

    ssl_context: serve HTTPS; token: answer 401 unless the request has `Authorization: Bearer token`
    (specfleet.security.Security.metrics_options gives both).
    """
    expected = f"bearer {token}".encode()
    open_connections = 0

    def respond(writer: asyncio.StreamWriter, status: str, body: bytes, ctype: str = "text/plain") -> None:
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
        )

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
            scheme, _, given = authorization.partition(b" ")
            authorized = not token or hmac.compare_digest(scheme.lower() + b" " + given.strip(), expected)
            parts = request_line.split()
            if not authorized:
                respond(writer, "401 Unauthorized", b"unauthorized: send Authorization: Bearer <the metrics token>\n")
            elif len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] == "/metrics":
                body = generate_latest(registry)
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


class PassTelemetry:
    """A verifier's or drafter service's forward passes: batch size and time, sessions, KV memory."""

    def __init__(self, kind: str, stores: Callable[[], list], labels: dict[str, str] | None = None):
        self.registry = CollectorRegistry()
        labels = labels or {}
        self.labels = labels
        names = list(labels)
        self.batch_size = Histogram(
            f"specfleet:{kind}_batch_size", f"Sessions in one {kind} forward pass.", names, buckets=BATCH_BUCKETS, registry=self.registry
        )
        self.pass_seconds = Histogram(
            f"specfleet:{kind}_pass_seconds", f"Time of one {kind} batch (forward pass and its bookkeeping).", names, buckets=PASS_BUCKETS, registry=self.registry
        )
        _store_gauges(self.registry, stores, labels)

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


class RouterTelemetry:
    """The router's request, token and speculation metrics; the scheduler reports to it."""

    def __init__(self, scheduler):
        self.scheduler = scheduler
        r = self.registry = CollectorRegistry()
        Gauge("specfleet:num_requests_running", "Requests being generated.", registry=r).set_function(lambda: scheduler.running)
        Gauge("specfleet:num_requests_waiting", "Requests queued for admission.", registry=r).set_function(lambda: scheduler.waiting)
        lanes = Gauge("specfleet:pipeline_lane_requests", "Requests in each pipeline lane.", ["lane"], registry=r)
        for i in range(len(scheduler._lanes)):
            lanes.labels(lane=str(i)).set_function(lambda i=i: len(scheduler._lanes[i]))
        self.ttft = Histogram("specfleet:time_to_first_token_seconds", "Time from admission to the first output token.", buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(
            "specfleet:inter_token_latency_seconds", "Time between output tokens (a round's tokens share its interval).", buckets=ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram("specfleet:e2e_request_latency_seconds", "Time from admission to the last token.", buckets=E2E_BUCKETS, registry=r)
        self.success = Counter("specfleet:request_success", "Requests finished, by reason (eos, length, stop).", ["finished_reason"], registry=r)
        self.failed = Counter("specfleet:request_failure", "Requests that ended with an error, by gRPC status.", ["code"], registry=r)
        self.cancelled = Counter("specfleet:request_cancelled", "Requests whose client went away before the end.", registry=r)
        self.prompt_tokens = Counter("specfleet:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("specfleet:generation_tokens", "Output tokens streamed.", registry=r)
        self.drafts = Counter("specfleet:spec_decode_num_drafts", "Draft trees verified (one per request and drafting round).", registry=r)
        self.draft_tokens = Counter("specfleet:spec_decode_num_draft_tokens", "Draft tokens verified.", registry=r)
        self.accepted = Counter("specfleet:spec_decode_num_accepted_tokens", "Draft tokens the target accepted.", registry=r)
        self.accepted_per_pos = Counter(
            "specfleet:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by their depth in the draft (0: first).", ["position"], registry=r
        )
        self.routing = Counter(
            "specfleet:routing_decisions", "Drafting rounds led by each drafter, per request domain.", ["drafter", "domain"], registry=r
        )
        self.fusion_width = Histogram(
            "specfleet:fusion_width", "Drafters cooperating on one request's drafting round.", buckets=(1, 2, 3, 4, 6, 8), registry=r
        )
        self.draft_call = Histogram(
            "specfleet:draft_call_seconds", "Wall time of one Draft call, as the router sees it.", ["drafter_service"], buckets=PASS_BUCKETS, registry=r
        )
        self.verify_call = Histogram("specfleet:verify_call_seconds", "Wall time of one Verify call, as the router sees it.", buckets=PASS_BUCKETS, registry=r)
        up = Gauge("specfleet:verifier_replica_up", "1 while the router sends rounds to this verifier replica, 0 while it skips it.", ["replica"], registry=r)
        for name in scheduler.verifiers.replicas:
            up.labels(replica=name).set_function(lambda name=name: float(scheduler.verifiers.breaker.allow(name)))
        self.replica_sessions = Counter(
            "specfleet:verifier_replica_sessions", "Request rounds each verifier replica verified.", ["replica"], registry=r
        )
        r.register(_RoundState(scheduler))
        self._last_token_at: dict[int, float] = {}  # id(state) -> when its last tokens went out

    def published(self, state, chunk) -> None:
        """A chunk went to the client (Scheduler._publish)."""
        now = time.monotonic()
        n = len(chunk.token_ids)
        if n:
            self.generation_tokens.inc(n)
            last = self._last_token_at.get(id(state))
            if last is None:
                self.ttft.observe(now - state.admitted_at)
            else:
                for _ in range(n):
                    self.itl.observe((now - last) / n)
            self._last_token_at[id(state)] = now
        if chunk.final:
            self._last_token_at.pop(id(state), None)
            self.e2e.observe(now - state.admitted_at)
            self.success.labels(finished_reason=state.finish_reason).inc()
            self.prompt_tokens.inc(len(state.spec.prompt_ids))

    def cancelled_request(self, state) -> None:
        """Its client went away before the end (Scheduler._publish drops it)."""
        self._last_token_at.pop(id(state), None)
        self.cancelled.inc()

    def failed_with(self, state, code) -> None:
        self._last_token_at.pop(id(state), None)
        self.failed.labels(code=getattr(code, "name", str(code))).inc()

    def verified(self, state, drafters: list[str], tree, accepted_nodes: list[int]) -> None:
        """One request's draft tree came back from verification (router/verifying.py, Verifying._learn);
        drafters: who drafted it this round, in routing order."""
        if not tree.tokens:
            return
        self.drafts.inc()
        self.draft_tokens.inc(len(tree.tokens))
        self.accepted.inc(len(accepted_nodes))
        for position in range(len(accepted_nodes)):
            self.accepted_per_pos.labels(position=str(position)).inc()
        if drafters:
            domain = (state.routing.domain if state.routing else "") or "-"
            self.routing.labels(drafter=drafters[0], domain=domain).inc()
            self.fusion_width.observe(len(drafters))


class _RoundState:
    """What the router's scheduler counts and learns, read at scrape time: drafts and acceptance per drafter
    and domain, rounds, failures, verifier time, verifier replica moves, learned expertise, the cost model."""

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def collect(self):
        shared = self.scheduler.round
        m = shared.metrics
        yield CounterMetricFamily(
            "specfleet:verifier_replica_moves", "Requests moved off a failed verifier replica to a live one.", value=self.scheduler.verifiers.moves
        )
        yield CounterMetricFamily("specfleet:rounds", "Draft-and-verify rounds, one per lane and pass.", value=m.rounds)
        yield CounterMetricFamily("specfleet:drafter_errors", "Failed Draft calls (their requests decoded that round without drafts).", value=m.drafter_errors)
        yield CounterMetricFamily("specfleet:session_misses", "Sessions a verifier or drafter had lost and was sent again whole.", value=m.session_misses)
        yield CounterMetricFamily(
            "specfleet:verify_busy_seconds", "Verifier compute time reported for this router's Verify calls.", value=m.verify_busy_ms / 1e3
        )
        proposed = CounterMetricFamily("specfleet:drafter_draft_tokens", "Tokens each drafter proposed, per request domain.", labels=["drafter", "domain"])
        accepted = CounterMetricFamily(
            "specfleet:drafter_accepted_tokens", "Proposals of each drafter that matched the target's tokens, per domain.", labels=["drafter", "domain"]
        )
        for (domain, drafter), counts in sorted(m.by_domain.items()):
            proposed.add_metric([drafter, domain or "-"], counts.draft_tokens)
            accepted.add_metric([drafter, domain or "-"], counts.accepted_tokens)
        yield proposed
        yield accepted
        expertise = GaugeMetricFamily(
            "specfleet:expertise_acceptance", "Learned per-token acceptance (posterior mean without prior) per drafter and domain.",
            labels=["drafter", "domain"],
        )
        for (domain, drafter), e in sorted(shared.router.store.snapshot().items()):
            if e.accepted + e.rejected > 0:
                expertise.add_metric([drafter, domain or "-"], e.accepted / (e.accepted + e.rejected))
        yield expertise
        cost = shared.controller.cost
        model = GaugeMetricFamily("specfleet:cost_model_ms", "The fitted cost model adaptive speculation plans with.", labels=["term"])
        for term, ms in [
            ("verify_base", cost.verify_scale * cost.verify_base),
            ("verify_per_session", cost.verify_scale * cost.verify_per_session),
            ("verify_per_token", cost.verify_scale * cost.verify_per_token),
            ("draft_base", cost.draft_base),
            ("draft_per_token", cost.draft_per_token),
        ]:
            model.add_metric([term], ms)
        yield model
