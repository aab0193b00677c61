"""vLLM's `POST /tokenize` and `POST /detokenize` beside the OpenAI API (router/openai_api.py), behind the same gate.

/tokenize gives a prompt's token ids exactly as the completions and chat endpoints send them to the model (a prompt
encoded with the tokenizer's special tokens, a BOS say; chat messages rendered by the tokenizer's chat template, which
writes its own, and encoded without; `add_special_tokens` as each endpoint takes it), so `count`
is the `usage.prompt_tokens` a request with that prompt reports, beside `max_model_len`, the context it must fit.
/detokenize gives token ids' text, special tokens included.

    curl -s localhost:8000/tokenize -d '{"model": "target", "prompt": "def fibonacci(n):"}'
    {"count": 5, "max_model_len": 512, "tokens": [...]}
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from router.api import GenerationError
from router.frontdoor import FrontDoor
from router.openai_schema import ApiError, chat_prompt, refuse_lone_surrogates

ROUTES = ("/tokenize", "/detokenize")


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: str | None = None  # or
    messages: list[dict] | None = Field(None, min_length=1)
    # With messages, as the chat endpoint takes them (router/openai_schema.py render_chat).
    tools: list[dict] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool | None = None  # vLLM's; unset: with a prompt, with messages not

    def special_tokens(self) -> bool:
        """Whether the text is encoded with the tokenizer's special tokens, as the endpoint it stands for encodes it."""
        return self.prompt is not None if self.add_special_tokens is None else self.add_special_tokens


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    tokens: list[int]


def token_routes(front_door: FrontDoor, model_name: str) -> APIRouter:
    routes = APIRouter()

    def check(model: str) -> None:
        try:
            front_door.check_open()
        except GenerationError as err:
            raise ApiError.of(err) from None
        if model != model_name:
            raise ApiError(
                404, f"model {model!r} does not exist; this server serves {model_name!r} (GET /v1/models)", param="model", code="model_not_found"
            )

    @routes.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check(body.model)
        refuse_lone_surrogates(body)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "prompt: set either prompt or messages", param="prompt")
        text = body.prompt if body.prompt is not None else chat_prompt(front_door.tokenizer, body)
        limits = front_door.limits
        if len(text) > limits.max_prompt_chars:
            raise ApiError(400, f"prompt: {len(text)} characters cannot fit the model's context of {limits.max_context} tokens", param="prompt")
        ids = await front_door.tokenize(text, body.special_tokens())
        return {"count": len(ids), "max_model_len": limits.max_context, "tokens": ids}

    @routes.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check(body.model)
        vocab = front_door.limits.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise ApiError(400, f"tokens: ids outside the vocabulary [0, {vocab}): {bad[:5]}", param="tokens")
        return {"prompt": await front_door.detokenize(body.tokens)}

    return routes
