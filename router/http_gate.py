"""The HTTP API's gate, what a request must pass before its body is read (an ASGI app around the FastAPI one), and
its server (uvicorn in the router's event loop: `start`, `stop`).

A body is read into memory and parsed on the event loop the gRPC streams share, so the gate refuses what
it can before reading a byte of it: without the API key (on /v1, /tokenize and /detokenize) with 401, and a declared Content-Length
over `router.max_request_bytes` with 413. A body without a declared length (chunked) is read up to that
limit and refused with 413 past it. The body read is handed to the app as it arrived, one message, and
the client's later messages (its disconnect) after it, so a handler still sees its client go away.

Every answer carries an `X-Request-Id` header (vLLM's): the client's own where it sent one (printable, at most
`MAX_REQUEST_ID_CHARS`), else a new one; the app finds it in `scope["state"]["request_id"]` and names the request by
it where the body names none, so that a load balancer's id and the router's log lines meet.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import socket
import uuid

import uvicorn

from fastapi.responses import JSONResponse

from router.openai_schema import ApiError

# The paths that need the API key: the OpenAI API's and vLLM's tokenizer routes (router/tokens_api.py).
KEYED = ("/v1", "/tokenize", "/detokenize")
KEY_HINT = "invalid API key: send Authorization: Bearer <the key given to --api-key or SPECFLEET_API_KEY>"
MAX_REQUEST_ID_CHARS = 64


class BodyGate:
    def __init__(self, app, max_request_bytes: int, api_key: str = ""):
        self.app, self.max_request_bytes, self.api_key = app, max_request_bytes, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        send = _with_request_id(scope, headers.get(b"x-request-id", b""), send)
        if self.api_key and scope["path"].startswith(KEYED) and not self._key_ok(headers.get(b"authorization", b"")):
            return await _refuse(scope, receive, send, ApiError(401, KEY_HINT, code="invalid_api_key"))
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_request_bytes):
            return await _refuse(scope, receive, send, self._too_large(declared.decode("latin-1")))
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_request_bytes:
                return await _refuse(scope, receive, send, self._too_large(f"more than {len(body)}"))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _key_ok(self, given: bytes) -> bool:
        return hmac.compare_digest(given, f"Bearer {self.api_key}".encode())

    def _too_large(self, size: str) -> ApiError:
        return ApiError(
            413,
            f"request body of {size} bytes is over this server's limit of {self.max_request_bytes} (router.max_request_bytes)",
            code="request_too_large",
        )


def _with_request_id(scope, given: bytes, send):
    """`send` with the request's id added to the answer's headers, the id kept in the scope's state for the app."""
    request_id = given.decode("latin-1")
    if not (0 < len(request_id) <= MAX_REQUEST_ID_CHARS and request_id.isprintable()):
        request_id = uuid.uuid4().hex
    scope.setdefault("state", {})["request_id"] = request_id

    async def sending(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]}
        await send(message)

    return sending


class _ErrorResponse(JSONResponse):
    """An error in JSON with every non-ASCII character escaped: a message may quote the client's input,
    and a lone surrogate in it would make UTF-8 fail, turning the 400 into a 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def error_response(err: ApiError, headers: dict | None = None) -> JSONResponse:
    """`err` in OpenAI's shape, as every answer of the HTTP API that is not a success."""
    return _ErrorResponse(err.body(), status_code=err.status, headers=headers)


async def _refuse(scope, receive, send, err: ApiError) -> None:
    # Closing the connection: the unread body cannot be skipped.
    await error_response(err, {"connection": "close"})(scope, receive, send)


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the router's own serve loop owns SIGINT/SIGTERM."""

    def capture_signals(self):
        return contextlib.nullcontext()


async def start(app: BodyGate, sock: socket.socket, **tls) -> tuple[_Server, asyncio.Task]:
    """Serve `app` on `sock` in this event loop; stop with `stop`. tls: uvicorn's ssl_* settings (Security.uvicorn_tls)."""
    server = _Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, timeout_graceful_shutdown=5, **tls))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # raises what stopped it
    return server, task


async def stop(server: _Server, task: asyncio.Task) -> None:
    server.should_exit = True
    await task
