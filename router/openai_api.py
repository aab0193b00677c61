"""The OpenAI-compatible HTTP API, served by the router process next to its gRPC port.

    POST /v1/completions        POST /v1/chat/completions     POST /v1/responses
    GET  /v1/models             GET  /health             GET /version

An adapter over router.frontdoor, as the gRPC servicer is: a request body becomes router.api.GenerationParams
(router/openai_schema.py: the OpenAI fields, chat messages, the fields specfleet refuses; openai_guides.py and
openai_tools.py: structured output and tool calls), one per choice, and enters `FrontDoor.submit_all`: the same
validation, queue and scheduler as the gRPC `Generate`, in this process, with no network hop. The events that come
back become OpenAI's JSON or server-sent events; a client that goes away cancels its requests.

`logprobs` are the target's, computed by the verifier from the logits it verified with: the raw distribution
(log-softmax before temperature, top-k and top-p), as vLLM reports them by default.

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
and status codes: 400 bad input, 401 bad key, 404 unknown model or route, 429
queue full, 503 verifier down or server shutting down, 504 deadline.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from router.api import GenerationError, GenerationParams
from router.frontdoor import FrontDoor, Generation
from router.http_gate import BodyGate, error_response
from router.tokens_api import token_routes
from router.metrics_api import metrics_routes
from router.openai_stream import run_unary, stream
from router.openai_responses import ResponsesRequest, create_response
from router.response_background import Background
from router.response_store import Responses, ResponseStore, input_items, responses_of
from router.openai_logprobs import chat_logprobs, completion_logprobs, echo_logprobs, prompt_logprobs_json, token_text
from router.chat_reply import ChatReply
from router.reasoning import ReasoningReader, guide_after_thought, special_tags, thinks
from router.tool_parsers import KEEP_SPECIAL_TOKENS, parser_for
from specfleet.config import RouterConfig
from router.openai_schema import (
    FINISH_REASONS,
    ApiError,
    ChatRequest,
    CompletionRequest,
    Sampling,
    chat_max_tokens,
    completion_prompts,
    params_of,
    refuse_unsupported,
    chat_prompt,
    render_chat,
    speculation_json,
    usage_json,
)

__all__ = ["ApiError", "create_app", "render_chat"]


class OpenAIServer:
    """The /v1 endpoints over `front_door`, serving `model_name`."""

    def __init__(
        self,
        front_door: FrontDoor,
        model_name: str,
        tool_call_parser: str = "auto",
        reasoning_parser: str = "auto",
        responses: Responses | None = None,
    ):
        self.front_door = front_door
        self.model_name = model_name
        template = getattr(front_door.tokenizer, "chat_template", None)
        self.tool_parser = parser_for(tool_call_parser, template)
        self.thinks = thinks(reasoning_parser, template)  # the thought's tags, or None
        self.special_thoughts = special_tags(front_door.tokenizer, self.thinks)
        self.created = int(time.time())
        self.responses = responses or Responses(ResponseStore(0))  # what /v1/responses keeps (router/response_store.py)
        self.background = Background(self.responses)  # the background responses it runs (router/response_background.py)

    @contextlib.contextmanager
    def refusals(self):
        """What HTTP refuses before a request reaches the front door counts as a failure, as the front door's refusals do."""
        try:
            yield
        except ApiError as err:
            self.front_door.refused(GRPC_STATUS_NAMES.get(err.status, "INTERNAL"))
            raise

    def _check(self, body: Sampling) -> None:
        """Open, fields specfleet implements, the model it serves: in that order."""
        try:
            self.front_door.check_open()
        except GenerationError as err:
            raise ApiError.of(err) from None
        refuse_unsupported(body)
        if body.model != self.model_name:
            raise ApiError(
                404,
                f"model {body.model!r} does not exist; this server serves {self.model_name!r} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    async def _submit(self, params: list[GenerationParams], request: Request) -> list[Generation]:
        # A connection's calls share their turns at admission (a keep-alive client's requests, one after another).
        peer = request.scope.get("client")
        client = f"http:{peer[0]}:{peer[1]}" if peer else ""
        named = request.scope.get("state", {}).get("request_id")  # the X-Request-Id header's (router/http_gate.py)
        for index, p in enumerate(params):
            if not p.request_id and named:
                p.request_id = f"{named}-{index}"
        try:
            return await self.front_door.submit_all(params, via="HTTP", client=client)
        except GenerationError as err:
            raise ApiError.of(err) from None

    def _name(self, body: Sampling):
        return token_text(self.front_door.tokenizer, body.return_tokens_as_token_ids)

    def models(self) -> dict:
        target = self.front_door.target
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "specfleet",
                    # The served name, as vLLM gives it: the target's path on disk is the server's business.
                    "root": self.model_name,
                    "max_model_len": target.max_context,
                }
            ],
        }

    async def completions(self, body: CompletionRequest, request: Request):
        with self.refusals():
            self._check(body)
            prompts, n = completion_prompts(body), body.n
            params = [params_of(body, body.max_tokens, p, i * n + c, c) for i, p in enumerate(prompts) for c in range(n)]
        generations = await self._submit(params, request)
        name = self._name(body)
        offsets = [0] * len(generations)  # text_offset of each choice's next streamed token
        # echo: each choice's prompt (text, ids) until its first event carries it, ahead of the output.
        echo = [None] * len(generations)
        if body.echo:
            # The prompt as read: its text where it was sent whole, else its tokens' (ids, or truncated).
            whole = body.truncate_prompt_tokens is None
            texts = [p if isinstance(p, str) and whole else None for p in prompts for _ in range(n)]
            echo = [(text or self.front_door.tokenizer.decode(g.prompt_ids), g.prompt_ids) for text, g in zip(texts, generations)]

        def choice(index: int, text: str, logprobs: list, finish: str | None, prompt: list | None = None) -> dict:
            lp = None
            if echo[index] is not None:
                (prompt_text, prompt_ids), echo[index] = echo[index], None
                text = prompt_text + text
                if body.logprobs is not None:
                    lp = echo_logprobs(name, prompt_ids, prompt or [], body.logprobs)
                    offsets[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            if body.logprobs is not None:
                out = completion_logprobs(name, logprobs, offsets[index])
                offsets[index] += sum(len(t) for t in out["tokens"])
                lp = {key: lp[key] + out[key] for key in out} if lp else out
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

        if body.stream:
            return stream(generations, self._envelope("cmpl", "text_completion"), choice, body)
        await run_unary(generations, request)
        results = [g.completion() for g in generations]
        return {
            **self._envelope("cmpl", "text_completion"),
            "choices": [
                {
                    **choice(i, r.text, r.logprobs, FINISH_REASONS.get(r.finish_reason), r.prompt_logprobs),
                    **self._prompt_logprobs(body, name, r.prompt_logprobs),
                    **({"prompt_token_ids": g.prompt_ids, "token_ids": r.token_ids} if body.return_token_ids else {}),
                }
                for i, (r, g) in enumerate(zip(results, generations))
            ],
            "usage": usage_json([r.usage for r in results], body.n),
            "speculation": [speculation_json(r.speculation) for r in results],
        }

    def _chat_params(self, body: ChatRequest, max_tokens: int | None, prompt: str, mode: str) -> list:
        """Each choice's request: a guide leaves a reasoning model's thought alone, and where tool calls are read from
        the text by a parser whose tags may be special tokens, or a thought's tags are, their text is kept (vLLM's
        parsers ask alike)."""
        params = [params_of(body, max_tokens, prompt, c, c) for c in range(body.n)]
        encode = functools.partial(self.front_door.tokenizer.encode, add_special_tokens=False)
        for p in params:
            if self.thinks:
                p.guide = guide_after_thought(p.guide, prompt, encode, self.thinks)
            if (mode == "auto" and self.tool_parser in KEEP_SPECIAL_TOKENS) or self.special_thoughts:
                p.skip_special_tokens = False
        return params

    async def submit_chat(self, body: ChatRequest, request: Request, renamed=contextlib.nullcontext) -> tuple[list[ChatReply], list[Generation]]:
        """A chat request checked, rendered and submitted: each choice's reply reader and generation. `renamed()`: a
        context its refusals leave through (the Responses API's, router/openai_responses.py, names fields its own way)."""
        with self.refusals(), renamed():
            self._check(body)
            max_tokens = chat_max_tokens(body)
            prompt = chat_prompt(self.front_door.tokenizer, body)
            tags = self.thinks
            replies = [
                ChatReply(body.tools, body.tool_choice, body.parallel_tool_calls, self.tool_parser, ReasoningReader(prompt, tags) if tags else None)
                for _ in range(body.n)
            ]
            params = self._chat_params(body, max_tokens, prompt, replies[0].mode)
        with renamed():
            return replies, await self._submit(params, request)

    async def chat(self, body: ChatRequest, request: Request):
        replies, generations = await self.submit_chat(body, request)
        name = self._name(body)

        def logprobs_of(logprobs: list) -> dict | None:
            return chat_logprobs(name, logprobs) if body.logprobs else None

        if body.stream:
            held = [[] for _ in range(body.n)]  # log-probabilities of tokens whose text is held back

            def choice(index: int, text: str, logprobs: list, finish: str | None, prompt: list | None = None) -> dict | None:
                out = replies[index].delta(text, finish)
                if out is None:
                    held[index] += logprobs
                    return None
                (delta, finish), logprobs, held[index] = out, held[index] + logprobs, []
                return {"index": index, "delta": delta, "logprobs": logprobs_of(logprobs), "finish_reason": finish}

            first = [{"index": c, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None} for c in range(body.n)]
            return stream(generations, self._envelope("chatcmpl", "chat.completion.chunk"), choice, body, first)
        await run_unary(generations, request)
        results = [g.completion() for g in generations]
        return {
            **self._envelope("chatcmpl", "chat.completion"),
            "choices": [
                {
                    "index": c,
                    "message": {"role": "assistant", "content": None, **reply},
                    "logprobs": logprobs_of(r.logprobs),
                    "finish_reason": finish,
                    **({"token_ids": r.token_ids} if body.return_token_ids else {}),
                }
                for c, r in enumerate(results)
                for reply, finish in [replies[c].message(r.text, FINISH_REASONS.get(r.finish_reason))]
            ],
            "usage": usage_json([r.usage for r in results], body.n),
            "speculation": [speculation_json(r.speculation) for r in results],
            **self._prompt_logprobs(body, name, results[0].prompt_logprobs),
            **({"prompt_token_ids": generations[0].prompt_ids} if body.return_token_ids else {}),
        }

    @staticmethod
    def _prompt_logprobs(body: Sampling, name, prompt: list | None) -> dict:
        """vLLM's prompt_logprobs field, where the request asked for it."""
        return {} if body.prompt_logprobs is None else {"prompt_logprobs": prompt_logprobs_json(name, prompt, body.prompt_logprobs)}

    def _envelope(self, prefix: str, kind: str) -> dict:
        return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()), "model": self.model_name}


# What an unknown route's 404 lists.
ROUTES = (
    "POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET and DELETE /v1/responses/{id}, "
    "GET /v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel, GET /v1/models, GET /v1/models/{model}, "
    "POST /tokenize, POST /detokenize, GET /health, GET or POST /ping, GET /load, GET /version"
)


# An HTTP refusal's gRPC status name: the label it counts under in specfleet:request_failure_total.
GRPC_STATUS_NAMES = {400: "INVALID_ARGUMENT", 404: "NOT_FOUND", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def _add_error_handlers(app: FastAPI, front_door: FrontDoor) -> None:
    @app.exception_handler(ApiError)
    async def apierror_response(_request: Request, err: ApiError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, err: RequestValidationError):
        if request.url.path in GENERATION_ROUTES:
            front_door.refused("INVALID_ARGUMENT")
        first = err.errors()[0] if err.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path") and not isinstance(p, int)]
        param = loc[0] if loc else None
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request body')}"
        return error_response(ApiError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def no_route(request: Request, err: HTTPException):
        # Starlette's own answers (404 no route, 405 wrong method) in OpenAI's shape, as every other error.
        if err.status_code == 404:
            return error_response(ApiError(404, f"{request.method} {request.url.path}: no such route; this server serves {ROUTES}", code="not_found"))
        return error_response(ApiError(err.status_code, f"{request.method} {request.url.path}: {err.detail}"), err.headers)


def _add_health(app: FastAPI, front_door: FrontDoor) -> None:
    # /ping (GET or POST) is /health under the name SageMaker's and vLLM's load balancers probe.
    @app.api_route("/health", methods=["GET"])
    @app.api_route("/ping", methods=["GET", "POST"])
    async def health():
        if front_door.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return {"status": "ok"}

    @app.get("/load")
    async def load():
        """vLLM's: the requests this router holds (running and waiting), for a load balancer to spread new ones by."""
        scheduler = front_door.scheduler
        return {"server_load": scheduler.running + scheduler.waiting}

    @app.get("/version")
    async def version():
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            return {"version": package_version("specfleet")}
        except PackageNotFoundError:
            return {"version": "unknown"}


def _v1(server: OpenAIServer) -> APIRouter:
    # The API key is checked before this, by the gate (router/http_gate.py), before the body is read.
    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def models():
        return server.models()

    @v1.get("/models/{model:path}")
    async def model(model: str):
        """One model's card (OpenAI's retrieve): the served model's, else a 404 naming it."""
        card = server.models()["data"][0]
        if model != card["id"]:
            raise ApiError(404, f"model: {model!r} is not served here; this server serves {card['id']!r}", param="model", code="model_not_found")
        return card

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await server.completions(body, request)

    @v1.post("/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        return await server.chat(body, request)

    @v1.post("/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await create_response(server, body, request)

    @v1.get("/responses/{response_id}")
    async def stored_response(response_id: str):
        return (await server.responses.get(response_id)).response

    @v1.get("/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None, before: str | None = None):
        return input_items(await server.responses.get(response_id), limit, order, after, before)

    @v1.post("/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return await server.background.cancel(response_id)

    @v1.delete("/responses/{response_id}")
    async def delete_response(response_id: str):
        await server.responses.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return v1


def create_app(front_door: FrontDoor, model_name: str, settings: RouterConfig, api_key: str = "", metrics=None, metrics_token: str = "") -> BodyGate:
    """The ASGI app over `front_door`, behind its gate. api_key: when set, /v1/*, /tokenize and /detokenize need it; a body over
    settings.max_request_bytes is refused (both before the body is read). /health answers 503 once the front door
    drains. settings: the router's section (its parsers, the largest body). metrics, metrics_token: what the metrics
    port serves and the token it asks for, also served at /metrics (router/metrics_api.py)."""
    app = FastAPI(title="specfleet", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app, front_door)
    _add_health(app, front_door)
    app.include_router(_v1(OpenAIServer(front_door, model_name, settings.tool_call_parser, settings.reasoning_parser, responses_of(settings))))
    app.include_router(token_routes(front_door, model_name))
    if metrics is not None:
        app.include_router(metrics_routes(metrics, metrics_token))
    return BodyGate(app, settings.max_request_bytes, api_key)
