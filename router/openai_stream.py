"""How an HTTP request's generations reach its client (router/openai_api.py): server-sent events as their output comes
(`stream`), or nothing until every choice has finished (`run_unary`); a client that goes away cancels what has not
finished."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import Request
from fastapi.responses import StreamingResponse

from router.api import Finished, GenerationError, Usage
from router.frontdoor import Generation, interleave
from router.openai_schema import FINISH_REASONS, ApiError, Sampling, speculation_json, sse, usage_json

# How often a unary request checks that its client is still connected.
DISCONNECT_POLL_S = 0.25

# Why an HTTP request's unfinished choices are cancelled (the log says it).
GONE = "its HTTP client went away or a sibling prompt failed"


def stream(generations: list[Generation], head: dict, choice, body: Sampling, first: list[dict] | None = None) -> StreamingResponse:
    """Server-sent events, each `head` (id, object, created, model) with choices, ending with [DONE].

    choice(index, text, logprobs, finish_reason, prompt_logprobs): one choice's JSON, or None to send nothing for it
    yet; `first`: choices sent before any output. With continuous usage (vLLM's), each event with a choice carries that
    choice's usage so far. With return_token_ids (vLLM's), each choice carries the token ids its text came from since
    its last event, and the prompt's ids come once: a chat's in the first event, a completion's in each choice's first."""
    chat = head["object"].startswith("chat")
    streamed = [0] * len(generations)  # tokens each choice has sent
    pending: list[list[int]] = [[] for _ in generations]  # token ids not yet sent with a choice
    prompted: set[int] = set()  # choices (a chat: the request, as -1) whose prompt's ids were sent

    def event(choices: list[dict], **extra) -> str:
        if body.continuous_usage and len(choices) == 1:
            index = choices[0]["index"]
            so_far = generations[index].usage()  # its output may run ahead of what this choice has streamed
            extra["usage"] = usage_json([Usage(so_far.prompt_tokens, streamed[index], so_far.cached_tokens)])
        if body.return_token_ids:
            for c in choices:
                c["token_ids"], pending[c["index"]] = pending[c["index"]], []
                if not chat and c["index"] not in prompted:
                    c["prompt_token_ids"] = generations[c["index"]].prompt_ids
                    prompted.add(c["index"])
            if chat and choices and -1 not in prompted:
                extra["prompt_token_ids"] = generations[0].prompt_ids
                prompted.add(-1)
        return sse({**head, "choices": choices, **extra})

    async def events():
        try:
            for c in first or []:
                yield event([c])
            # Closed however this ends (a client gone closes this generator): its unfinished requests are cancelled.
            async with contextlib.aclosing(interleave(generations, GONE)) as updates:
                async for index, update in updates:
                    streamed[index] += len(update.token_ids)
                    pending[index] += update.token_ids
                    final = isinstance(update, Finished)
                    if not update.text and not final and not update.logprobs and update.prompt_logprobs is None:
                        continue
                    finish = FINISH_REASONS.get(update.finish_reason) if final else None
                    c = choice(index, update.text, update.logprobs, finish, update.prompt_logprobs)
                    if c is None:  # held back (a tool choice's output until it is complete)
                        continue
                    if final:
                        c["speculation"] = speculation_json(update.speculation)
                    yield event([c])
            if body.include_usage:
                yield event([], usage=usage_json([g.usage() for g in generations], body.n))
        except GenerationError as err:
            # The status line is already sent: the error travels as an event, as vLLM does.
            yield sse(ApiError.of(err).body())
        yield sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


async def run_unary(generations: list[Generation], request: Request) -> None:
    """Until every generation has finished; a client that hangs up meanwhile cancels them. Raises ApiError for a failure."""

    async def drain() -> None:
        async with contextlib.aclosing(interleave(generations, GONE)) as updates:
            async for _ in updates:
                pass

    task = asyncio.create_task(drain())
    try:
        while True:
            # uvicorn tells a waiting handler nothing of a closed connection: ask every so often.
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                try:
                    return task.result()
                except GenerationError as err:
                    raise ApiError.of(err) from None
            if await request.is_disconnected():
                return
    finally:
        task.cancel()  # interleave's cleanup cancels whatever has not finished
