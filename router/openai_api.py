"""The OpenAI-compatible HTTP API, served by the router process next to its gRPC port.

    POST /v1/completions        POST /v1/chat/completions
    GET  /v1/models             GET  /health             GET /version

A request body is checked here only for what the OpenAI API adds (its field
names, chat messages, the fields specfleet does not implement), then turned
into a `GenerateRequest` and handed to `GenerationServicer.admit`: the same
validation, queue and scheduler as the gRPC `Generate`, in this process, with
no network hop. A field specfleet cannot honour is refused with a 400 naming
it, never ignored: a client that asks for `frequency_penalty` and gets
something else would be misled.

`logprobs` are the target's, computed by the verifier from the logits it
verified with: the raw distribution (log-softmax before temperature, top-k and
top-p), as vLLM reports them by default.

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
and status codes: 400 bad input, 401 bad key, 404 unknown model, 429 queue
full, 503 verifier down or server shutting down, 504 deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from google.protobuf import json_format
from pydantic import BaseModel, ConfigDict, Field

from router.request import InvalidRequest, RequestState
from router.scheduler import Overloaded
from specfleet.v1 import generation_pb2

log = logging.getLogger(__name__)

# How often a unary request checks that its client is still connected.
DISCONNECT_POLL_S = 0.25

# Choices per request at most: each is a request of its own to the scheduler.
MAX_N = 16

# The router's finish reasons in OpenAI's words: the end-of-sequence token is a natural stop.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}

# What a failed request's gRPC status means over HTTP.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
        return {"error": {"message": self.message, "type": kind.get(self.status, "server_error"), "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class Speculation(BaseModel):
    """specfleet's own options (as in GenerateRequest.speculation)."""

    model_config = ConfigDict(extra="forbid")
    max_draft_tokens: int = Field(0, ge=0)
    disabled: bool = False


class Sampling(BaseModel):
    """Fields shared by both endpoints. Unknown fields are kept so that they can be refused by name."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0  # OpenAI's default
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Fields OpenAI defines that specfleet implements only at their neutral value.
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict | None = None
    # vLLM's extra sampling fields, and specfleet's.
    repetition_penalty: float = 1.0  # only its neutral value (`vllm bench serve` sends it)
    top_k: int = 0
    ignore_eos: bool = False
    # Name logprobs' tokens "token_id:<id>" (vLLM's option): exact where a token's text is not.
    return_tokens_as_token_ids: bool = False
    speculation: Speculation | None = None
    domain: str = ""
    request_id: str = ""


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    # The chosen tokens' log-probabilities and this many alternatives each (OpenAI allows 0 to 5).
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatRequest(Sampling):
    messages: list[dict] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


def _refuse_unsupported(body: Sampling) -> None:
    """A 400 naming the first field specfleet cannot honour."""
    unknown = sorted(body.model_extra or {})
    if unknown:
        raise ApiError(400, f"{unknown[0]}: not supported by specfleet", param=unknown[0], code="unsupported_field")
    if not 1 <= body.n <= MAX_N:
        raise ApiError(400, f"n: must be between 1 and {MAX_N}, got {body.n}", param="n")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name) != 0:
            raise ApiError(400, f"{name}: only 0 is supported (penalties would change the target's distribution)", param=name, code="unsupported_field")
    if body.repetition_penalty != 1:
        raise ApiError(400, "repetition_penalty: only 1 is supported (a penalty would change the target's distribution)", param="repetition_penalty", code="unsupported_field")
    if body.logit_bias:
        raise ApiError(400, "logit_bias: not supported by specfleet", param="logit_bias", code="unsupported_field")
    if isinstance(body, CompletionRequest):
        if body.echo:
            raise ApiError(400, "echo: not supported by specfleet", param="echo", code="unsupported_field")
        if body.best_of not in (None, 1):
            raise ApiError(400, "best_of: only 1 is supported", param="best_of", code="unsupported_field")
        if body.suffix:
            raise ApiError(400, "suffix: not supported by specfleet", param="suffix", code="unsupported_field")
    if body.seed is not None and not 0 <= body.seed < 2**63:
        raise ApiError(400, f"seed: must be between 0 and 2**63 - 1, got {body.seed}", param="seed")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options: only allowed with stream: true", param="stream_options")


def _generate_request(body: Sampling, max_tokens: int | None, prompt: str | list[int], index: int, choice: int) -> generation_pb2.GenerateRequest:
    """The router's request for choice `choice` (of n) of one prompt; `index` is its place among all choices."""
    req = generation_pb2.GenerateRequest(
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        domain=body.domain,
        request_id=f"{body.request_id}-{index}" if body.request_id else "",
    )
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.extend(prompt)
    if max_tokens is not None:
        req.max_tokens = max_tokens
    if body.seed is not None:
        # Choice c of n samples with seed + c: each choice differs, and the seed alone still fixes all n.
        req.seed = body.seed + choice
    if body.ignore_eos:
        req.stop_at_eos = False
    if isinstance(body, CompletionRequest) and body.logprobs is not None:
        req.logprobs, req.top_logprobs = True, body.logprobs
    if isinstance(body, ChatRequest):
        req.logprobs, req.top_logprobs = body.logprobs, body.top_logprobs or 0
    if body.speculation is not None:
        req.speculation.max_draft_tokens = body.speculation.max_draft_tokens
        req.speculation.disabled = body.speculation.disabled
    return req


def _param_of(message: str) -> str:
    """The field an InvalidRequest names (its message starts with it), in the OpenAI request's words."""
    name = message.split(":", 1)[0].strip()
    return {"prompt_token_ids": "prompt", "speculation.max_draft_tokens": "speculation"}.get(name, name)


def _speculation(states: list[RequestState]) -> list[dict]:
    return [json_format.MessageToDict(s.stats(), preserving_proto_field_name=True) for s in states]


def _usage(states: list[RequestState]) -> dict:
    prompt = sum(len(s.spec.prompt_ids) for s in states)
    completion = sum(len(s.output_ids) for s in states)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _token_text(tokenizer, as_ids: bool):
    return (lambda token_id: f"token_id:{token_id}") if as_ids else (lambda token_id: tokenizer.decode([token_id]))


def _completion_logprobs(name, logprobs: list, offset: int) -> dict:
    """The completions API's logprobs object for these tokens; `name` gives a token's text; text_offset counts from `offset`."""
    tokens = [name(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        # The chosen token and its alternatives, as vLLM and OpenAI list them.
        "top_logprobs": [
            {name(t.token_id): t.logprob for t in [*lp.top, lp]} for lp in logprobs
        ],
        "text_offset": offsets,
    }


def _chat_logprobs(name, logprobs: list) -> dict:
    """The chat API's logprobs object for these tokens; `name` gives a token's text."""

    def entry(token_id: int, logprob: float) -> dict:
        token = name(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]} for lp in logprobs]}


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def create_app(servicer, model_name: str, api_key: str = "") -> FastAPI:
    """The ASGI app over `servicer` (router.server.GenerationServicer). api_key: when set, /v1/* needs it."""
    app = FastAPI(title="specfleet", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())
    # Set when the router stops: requests in flight finish, new ones get a 503 (and /health says so).
    app.state.draining = False

    def check_open() -> None:
        if app.state.draining:
            raise ApiError(
                503,
                "the server is shutting down: it finishes the requests in flight and takes no new ones; retry on another replica",
                code="shutting_down",
            )

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not isinstance(p, int)]
        param = loc[0] if loc else None
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request body')}"
        return JSONResponse(ApiError(400, message, param=param).body(), status_code=400)

    # A dependency of the /v1 routes rather than an HTTP middleware: Starlette's middleware
    # wraps `receive`, and a unary handler could then no longer see its client hang up.
    async def check_key(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if api_key and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "invalid API key: send Authorization: Bearer <the key given to --api-key or SPECFLEET_API_KEY>", code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    def check_model(name: str) -> None:
        if name != model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {model_name!r} (GET /v1/models)", param="model", code="model_not_found")

    async def admit(reqs: list[generation_pb2.GenerateRequest]) -> list[RequestState]:
        states = []
        try:
            for req in reqs:
                states.append(await servicer.admit(req, deadline=None))
        except InvalidRequest as err:
            cancel(states)
            raise ApiError(400, str(err), param=_param_of(str(err))) from None
        except Overloaded as err:
            cancel(states)
            raise ApiError(429, str(err), code="queue_full") from None
        return states

    def cancel(states: list[RequestState]) -> None:
        for state in states:
            state.cancelled = True  # the scheduler drops it and releases its sessions

    async def updates(states: list[RequestState]) -> AsyncIterator[tuple[int, object]]:
        """(index, chunk) from all states as they come; an ApiError for the first that fails."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, state: RequestState) -> None:
            while True:
                update = await state.updates.get()
                await queue.put((index, update))
                if isinstance(update, tuple) or update.final:
                    return

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(states)]
        try:
            done = 0
            while done < len(states):
                index, update = await queue.get()
                if isinstance(update, tuple):  # (grpc status code, message)
                    code, message = update
                    raise ApiError(HTTP_STATUS.get(code, 500), message, code=code.name.lower())
                yield index, update
                done += update.final
        finally:
            for task in tasks:
                task.cancel()
            # A client that went away (or a failed sibling) leaves nothing running: the
            # scheduler drops a cancelled request at its next round and releases its sessions.
            unfinished = [s for s in states if not s.published_final]
            for state in unfinished:
                log.info("request %s cancelled: its HTTP client went away or a sibling prompt failed", state.spec.request_id)
            cancel(unfinished)

    async def run_unary(states: list[RequestState], request: Request) -> None:
        """Until every state has finished; a client that hangs up meanwhile cancels them."""

        async def drain() -> None:
            async for _ in updates(states):
                pass

        task = asyncio.create_task(drain())
        try:
            while True:
                # uvicorn tells a waiting handler nothing of a closed connection: ask every so often.
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
                if done:
                    return task.result()
                if await request.is_disconnected():
                    return
        finally:
            task.cancel()  # updates' cleanup cancels whatever has not finished

    def stream(states: list[RequestState], kind: str, chunk_of, include_usage: bool, first: list[dict] | None = None) -> StreamingResponse:
        """Server-sent events of `kind` (text_completion or chat.completion.chunk), ending with [DONE]."""
        rid, now = f"{'chatcmpl' if kind.startswith('chat') else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())

        def envelope(choices: list[dict]) -> dict:
            return {"id": rid, "object": kind, "created": now, "model": model_name, "choices": choices}

        async def events():
            try:
                for choice in first or []:
                    yield _sse(envelope([choice]))
                async for index, chunk in updates(states):
                    state = states[index]
                    if not chunk.text and not chunk.final and not chunk.logprobs:
                        continue
                    choice = chunk_of(index, chunk.text, FINISH_REASONS.get(state.finish_reason) if chunk.final else None, chunk.logprobs)
                    if chunk.final:
                        choice["speculation"] = _speculation([state])[0]
                    yield _sse(envelope([choice]))
                if include_usage:
                    yield _sse({**envelope([]), "usage": _usage(states)})
            except ApiError as err:
                # The status line is already sent: the error travels as an event, as vLLM does.
                yield _sse(err.body())
            yield _sse("[DONE]")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        if app.state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/version")
    async def version():
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            return {"version": package_version("specfleet")}
        except PackageNotFoundError:
            return {"version": "unknown"}

    @v1.get("/models")
    async def models():
        target = servicer.target
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": created, "owned_by": "specfleet", "root": target.path, "max_model_len": target.max_context}],
        }

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_open()
        _refuse_unsupported(body)
        check_model(body.model)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ApiError(400, "prompt: must not be empty", param="prompt")
        n = body.n
        states = await admit([_generate_request(body, body.max_tokens, p, i * n + c, c) for i, p in enumerate(prompts) for c in range(n)])

        offsets = [0] * len(states)  # text_offset of each choice's next streamed token

        def chunk_of(index: int, text: str, finish: str | None, logprobs: list) -> dict:
            lp = None
            if body.logprobs is not None:
                lp = _completion_logprobs(_token_text(servicer.tokenizer, body.return_tokens_as_token_ids), logprobs, offsets[index])
                offsets[index] += sum(len(t) for t in lp["tokens"])
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

        if body.stream:
            return stream(states, "text_completion", chunk_of, bool(body.stream_options and body.stream_options.include_usage))
        await run_unary(states, request)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [chunk_of(i, s.text, FINISH_REASONS.get(s.finish_reason), s.logprobs) for i, s in enumerate(states)],
            "usage": _usage(states),
            "speculation": _speculation(states),
        }

    @v1.post("/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        check_open()
        _refuse_unsupported(body)
        check_model(body.model)
        if body.max_tokens is not None and body.max_completion_tokens is not None:
            raise ApiError(400, "max_completion_tokens: set it or max_tokens, not both", param="max_completion_tokens")
        prompt = render_chat(servicer.tokenizer, body.messages)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        states = await admit([_generate_request(body, max_tokens, prompt, c, c) for c in range(body.n)])

        def chunk_of(index: int, text: str, finish: str | None, logprobs: list) -> dict:
            lp = _chat_logprobs(_token_text(servicer.tokenizer, body.return_tokens_as_token_ids), logprobs) if body.logprobs else None
            return {"index": index, "delta": {"content": text} if text else {}, "logprobs": lp, "finish_reason": finish}

        if body.stream:
            first = [{"index": c, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None} for c in range(body.n)]
            return stream(states, "chat.completion.chunk", chunk_of, bool(body.stream_options and body.stream_options.include_usage), first)
        await run_unary(states, request)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [
                {
                    "index": c,
                    "message": {"role": "assistant", "content": s.text},
                    "logprobs": _chat_logprobs(_token_text(servicer.tokenizer, body.return_tokens_as_token_ids), s.logprobs) if body.logprobs else None,
                    "finish_reason": FINISH_REASONS.get(s.finish_reason),
                }
                for c, s in enumerate(states)
            ],
            "usage": _usage(states),
            "speculation": _speculation(states),
        }

    app.include_router(v1)
    return app


def render_chat(tokenizer, messages: list[dict]) -> str:
    """The prompt text of `messages` by the tokenizer's chat template (text content only)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(
            400,
            "messages: this model's tokenizer has no chat template, so chat messages cannot be turned into a prompt; "
            "use /v1/completions, or add a chat_template to the tokenizer_config.json of the target",
            param="messages",
            code="no_chat_template",
        )
    plain = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        if role not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, f"messages[{i}].role: must be system, developer, user or assistant, got {role!r}", param="messages")
        if isinstance(content, list):  # content parts: only text ones
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content: must be a string or a list of text parts", param="messages")
        extra = sorted(set(message) - {"role", "content", "name"})
        if extra:
            raise ApiError(400, f"messages[{i}].{extra[0]}: not supported by specfleet", param="messages")
        plain.append({"role": role, "content": content})
    try:
        return tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # the template's own checks (e.g. roles must alternate) are the client's to fix
        raise ApiError(400, f"messages: the model's chat template refused them: {err}", param="messages") from None


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the router's own serve loop owns SIGINT/SIGTERM."""

    def capture_signals(self):
        return contextlib.nullcontext()


async def start(app: FastAPI, sock: socket.socket, **tls) -> tuple[_Server, asyncio.Task]:
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
