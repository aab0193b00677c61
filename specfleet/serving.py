"""What every specfleet gRPC server shares: logging, health, reflection, graceful shutdown (dynamic batching:
specfleet/batching.py)."""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

log = logging.getLogger(__name__)

# Token trees and many sessions per call make messages larger than gRPC's 4 MB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# How long a stopping router lets its in-flight requests finish; `specfleet serve` stops the
# verifier and drafters only after the router has exited.
ROUTER_DRAIN_S = 30.0
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A restarted service is reached again within a second, not after gRPC's default backoff (up to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


EVENT_LOOPS = ("uvloop", "asyncio")


def run(main: Awaitable) -> object:
    """Run a service's main coroutine to its end on uvloop's event loop where uvloop is installed, else on asyncio's
    (`SPECFLEET_EVENT_LOOP=asyncio` chooses asyncio's). A round wakes the loop several times (its calls' answers
    from the batch queues' model threads, the client's stream), and uvloop's wake-ups and callbacks cost less:
    docs/benchmarks/event-loop.md."""
    chosen = os.environ.get("SPECFLEET_EVENT_LOOP", "uvloop")
    if chosen not in EVENT_LOOPS:
        raise SystemExit(f"SPECFLEET_EVENT_LOOP must be one of {', '.join(EVENT_LOOPS)}, got {chosen!r}")
    if chosen == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.info("uvloop is not installed: serving on asyncio's event loop")
        else:
            return uvloop.run(main)
    return asyncio.run(main)


class _JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(service: str, level: str | None = None) -> None:
    """Logs to stderr: readable text by default, one JSON object a line with SPECFLEET_LOG_FORMAT=json."""
    level = (level or os.environ.get("SPECFLEET_LOG_LEVEL", "INFO")).upper()
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("SPECFLEET_LOG_FORMAT", "text") == "json":
        handler.setFormatter(_JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s {service} %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Quieten libraries that log every weight file and progress bar.
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"


def add_reflection_v1(service_names: Sequence[str], server: grpc.aio.Server) -> None:
    """Server reflection as grpc.reflection.v1 too, which current clients (grpcurl, Postman) ask first.

    grpcio-reflection ships only v1alpha; v1's messages are the same fields under another
    package, so v1alpha's servicer answers v1 calls byte for byte.
    """
    servicer = reflection.aio.ReflectionServicer(service_names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": handler}),))


class _Undecodable:
    """What a request deserializer returns for bytes it cannot decode, so the handler can refuse them."""

    def __init__(self, size: int, error: Exception):
        self.size = size
        self.error = error


def _tolerant(deserialize: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def run(raw: bytes):
        try:
            return deserialize(raw)
        except Exception as err:  # protobuf's DecodeError and whatever else a malformed message raises
            return _Undecodable(len(raw), err)

    return run


class UndecodableRequests(grpc.aio.ServerInterceptor):
    """Answers a request that does not decode (garbage bytes, invalid UTF-8 in a string field, a
    truncated message) with INVALID_ARGUMENT and one log line, on every RPC of the server.

    gRPC raises in its own deserialization step, outside the handler, which turns any exception into
    UNKNOWN with a logged traceback; here the deserializer returns a marker instead, and the handler
    refuses it before the servicer sees it.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method

        async def refuse(request: _Undecodable, context) -> None:
            log.warning("%s: refused an undecodable request of %d bytes (%s)", method, request.size, request.error)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid message for {method}: {request.error}")

        async def checked(requests, context):
            async for request in requests:
                if isinstance(request, _Undecodable):
                    await refuse(request, context)
                yield request

        if handler.request_streaming:
            behavior = handler.stream_stream or handler.stream_unary
            if inspect.isasyncgenfunction(behavior):

                async def guarded(requests, context):
                    async for reply in behavior(checked(requests, context), context):
                        yield reply

            else:

                async def guarded(requests, context):
                    reply = behavior(checked(requests, context), context)
                    return await reply if inspect.isawaitable(reply) else reply

        else:
            behavior = handler.unary_stream or handler.unary_unary
            if inspect.isasyncgenfunction(behavior):

                async def guarded(request, context):
                    if isinstance(request, _Undecodable):
                        await refuse(request, context)
                    async for reply in behavior(request, context):
                        yield reply

            else:

                async def guarded(request, context):
                    if isinstance(request, _Undecodable):
                        await refuse(request, context)
                    reply = behavior(request, context)
                    return await reply if inspect.isawaitable(reply) else reply

        kind = ("stream" if handler.request_streaming else "unary") + "_" + ("stream" if handler.response_streaming else "unary")
        return handler._replace(request_deserializer=_tolerant(handler.request_deserializer), **{kind: guarded})


async def serve(
    name: str,
    host: str,
    port: int,
    register: Callable[[grpc.aio.Server], Sequence[str]],
    grace_s: float = 10.0,
    on_stop: Callable[[], None] | None = None,
    on_reload: Callable[[], Awaitable[None]] | None = None,
    healthy: Callable[[], bool] | None = None,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_request_bytes: int = MAX_MESSAGE_BYTES,
    on_drain: Callable[[], Awaitable[None]] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run a gRPC server until SIGTERM or SIGINT, then let in-flight calls finish (up to grace_s).

    `register` adds the servicers and returns their full service names; health
    checking (grpc.health.v1) and reflection are added for all of them, SERVING
    while `healthy()` says so (when given: the router is healthy only while a
    verifier is). SIGHUP calls `on_reload`, when given. credentials: TLS (None:
    plain text); interceptors: who may call (specfleet.security builds both). A
    request over max_request_bytes is refused by gRPC itself (RESOURCE_EXHAUSTED)
    before it is read into memory. `on_drain`, when given, runs beside the gRPC
    drain, within the same grace_s: the work other than gRPC calls that must
    finish first (the router's HTTP requests). `stop`, when given, ends it instead of the signals: a server
    that shares its process with another (`specfleet.colocated`) leaves them to that one.
    """
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_request_bytes),
        # gRPC binds with SO_REUSEPORT by default: a second server on a taken port would start, and the kernel would
        # split connections between the two. A taken port is an error here.
        ("grpc.so_reuseport", 0),
    ]
    server = grpc.aio.server(options=options, interceptors=[UndecodableRequests(), *interceptors])
    service_names = list(register(server))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflected = [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME, REFLECTION_V1]
    reflection.enable_server_reflection(reflected, server)
    add_reflection_v1(reflected, server)
    address = f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    except RuntimeError:  # how newer grpcio refuses an address it cannot bind
        bound = 0
    if bound == 0:
        raise OSError(f"{name}: cannot listen on {host}:{port} (port in use?)")
    await server.start()
    for service in ["", *service_names]:
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    log.info("%s listening on %s:%d%s", name, host, bound, " (TLS)" if credentials is not None else "")
    freeze_heap()

    loop = asyncio.get_running_loop()
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    if on_reload is not None:
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(_reload(name, on_reload)))
    watcher = asyncio.create_task(_follow_health(name, health, ["", *service_names], healthy)) if healthy else None
    await stop.wait()
    if watcher is not None:
        watcher.cancel()
    log.info("%s shutting down: finishing in-flight calls (up to %.0fs)", name, grace_s)
    for service in ["", *service_names]:
        await health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    drains = [server.stop(grace_s)]
    if on_drain is not None:
        drains.append(_bounded(on_drain(), grace_s, f"{name}: in-flight work did not finish within {grace_s:.0f}s"))
    await asyncio.gather(*drains)
    if on_stop is not None:
        on_stop()
    log.info("%s stopped", name)


def freeze_heap() -> None:
    """Moves what the process holds once it serves (models, their modules and tensors, the router's classifier and
    cost model) out of the garbage collector's generations: it lives as long as the process. Otherwise each full
    collection while serving walks all of it, a pause of tens of milliseconds that stalls a pass mid-round, and each
    younger one walks more than the round left behind (docs/benchmarks/compare.md)."""
    gc.collect()
    gc.freeze()


async def _follow_health(name: str, health, services: list[str], healthy: Callable[[], bool]) -> None:
    serving = True
    while True:
        await asyncio.sleep(0.25)
        now = bool(healthy())
        if now != serving:
            serving = now
            status = health_pb2.HealthCheckResponse.SERVING if now else health_pb2.HealthCheckResponse.NOT_SERVING
            log.warning("%s health: %s", name, health_pb2.HealthCheckResponse.ServingStatus.Name(status))
            for service in services:
                await health.set(service, status)


async def _bounded(awaitable, timeout_s: float, message: str) -> None:
    try:
        await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        log.warning(message)


async def _reload(name: str, on_reload) -> None:
    log.info("%s: SIGHUP, reloading its configuration", name)
    try:
        await on_reload()
    except Exception as err:  # a bad new config must not take down a serving process
        log.error("%s: reload failed, keeping the running configuration: %s", name, err)


async def wait_until_serving(address: str, timeout_s: float, service: str = "", security=None) -> None:
    """Poll grpc.health.v1 at address until it reports SERVING (over TLS when `security`, a specfleet.security.Security, has it)."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer"
    # CHANNEL_OPTIONS' short reconnect backoff: with gRPC's default (1 s, growing 1.6x), a service that starts
    # listening just after a refused poll is seen seconds late, and every cluster start waits for it.
    channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) if security is None else security.aio_channel(address)
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last_error = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.aio.AioRpcError as err:
                last_error = f"{err.code().name}: {err.details()}"
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{address} did not become healthy within {timeout_s:.0f}s (last: {last_error})")


async def wait_started(address: str, procs, timeout_s: float, wait=wait_until_serving) -> bool:
    """Wait until the server at `address` serves (`wait(address, timeout_s)`: `wait_until_serving` with its TLS, say), or one of the
    started processes (`procs`: [(name, subprocess.Popen)]) exits; False, with the reason printed, if it does not serve."""
    task = asyncio.create_task(wait(address, timeout_s))
    while not task.done():
        for name, proc in procs:
            if proc.poll() is not None:
                task.cancel()
                print(f"specfleet serve: {name} exited with code {proc.returncode} during start-up", file=sys.stderr)
                return False
        await asyncio.sleep(0.2)
    try:
        task.result()
    except TimeoutError as err:
        print(f"specfleet serve: {err}", file=sys.stderr)
        return False
    return True
