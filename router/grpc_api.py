"""The router's gRPC service, specfleet.v1.Generation: an adapter over router.frontdoor.

A GenerateRequest becomes router.api.GenerationParams, the front door's events
become GenerateChunk and GenerateResponse messages, and its errors gRPC status
codes. The client's deadline is the request's; a call that ends early (the
client cancelled it, or its deadline passed) cancels the request. The only
module of the router's front where protobuf appears.
"""

from __future__ import annotations

import time

import grpc

from router.api import (
    Completion,
    Delta,
    ErrorKind,
    Finished,
    GenerationError,
    GenerationParams,
    SpeculationOptions,
    SpeculationStats,
    TokenLogprobs,
    Usage,
)
from router.frontdoor import FrontDoor, Generation
from specfleet.guides import Guide
from specfleet.v1 import generation_pb2, generation_pb2_grpc

STATUS = {
    ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


def params_of(req: generation_pb2.GenerateRequest) -> GenerationParams:
    """The request's fields, unset optional ones at their documented defaults."""
    return GenerationParams(
        prompt=req.prompt,
        prompt_token_ids=list(req.prompt_token_ids),
        max_tokens=req.max_tokens if req.HasField("max_tokens") else None,
        temperature=req.temperature,
        top_p=req.top_p if req.HasField("top_p") else 1.0,
        top_k=req.top_k,
        min_p=req.min_p,
        seed=req.seed if req.HasField("seed") else None,
        stop=list(req.stop),
        stop_at_eos=req.stop_at_eos if req.HasField("stop_at_eos") else True,
        speculation=SpeculationOptions(disabled=req.speculation.disabled, max_draft_tokens=req.speculation.max_draft_tokens),
        domain=req.domain,
        request_id=req.request_id,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs,
        logit_bias=dict(req.logit_bias),
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty if req.HasField("repetition_penalty") else 1.0,
        stop_token_ids=list(req.stop_token_ids),
        min_tokens=req.min_tokens,
        prompt_logprobs=req.prompt_logprobs if req.HasField("prompt_logprobs") else None,
        guide=Guide.from_proto(req.guide) if req.HasField("guide") else None,
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens if req.HasField("skip_special_tokens") else True,
        allowed_token_ids=list(req.allowed_token_ids),
        bad_words=list(req.bad_words),
        truncate_prompt_tokens=req.truncate_prompt_tokens if req.HasField("truncate_prompt_tokens") else None,
        priority=req.priority,
        cache_salt=req.cache_salt or None,
        add_special_tokens=req.add_special_tokens if req.HasField("add_special_tokens") else True,
    )


def logprobs_proto(logprobs: list[TokenLogprobs]) -> list[generation_pb2.TokenLogprobs]:
    return [
        generation_pb2.TokenLogprobs(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[generation_pb2.TokenLogprob(token_id=t.token_id, logprob=t.logprob) for t in lp.top],
            rank=lp.rank,
        )
        for lp in logprobs or []
    ]


def usage_proto(usage: Usage) -> generation_pb2.Usage:
    return generation_pb2.Usage(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens)


def speculation_proto(stats: SpeculationStats) -> generation_pb2.SpeculationStats:
    return generation_pb2.SpeculationStats(
        rounds=stats.rounds,
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        drafters=[
            generation_pb2.DrafterStats(drafter=d.drafter, rounds=d.rounds, draft_tokens=d.draft_tokens, accepted_tokens=d.accepted_tokens)
            for d in stats.drafters
        ],
        domain=stats.domain,
        draft_wall_ms=stats.draft_wall_ms,
        draft_compute_ms=stats.draft_compute_ms,
        verify_wall_ms=stats.verify_wall_ms,
        verify_compute_ms=stats.verify_compute_ms,
        draft_queue_ms=stats.draft_queue_ms,
        verify_queue_ms=stats.verify_queue_ms,
        router_ms=stats.router_ms,
    )


def response_of(result: Completion) -> generation_pb2.GenerateResponse:
    return generation_pb2.GenerateResponse(
        request_id=result.request_id,
        text=result.text,
        token_ids=result.token_ids,
        finish_reason=result.finish_reason,
        usage=usage_proto(result.usage),
        speculation=speculation_proto(result.speculation),
        logprobs=logprobs_proto(result.logprobs),
        prompt_logprobs=logprobs_proto(result.prompt_logprobs),
    )


def chunk_of(request_id: str, event: Delta) -> generation_pb2.GenerateChunk:
    """A streamed chunk; the last (Finished) carries finish_reason, usage and speculation."""
    msg = generation_pb2.GenerateChunk(
        request_id=request_id,
        text=event.text,
        token_ids=event.token_ids,
        logprobs=logprobs_proto(event.logprobs),
        prompt_logprobs=logprobs_proto(event.prompt_logprobs),
    )
    if isinstance(event, Finished):
        msg.finish_reason = event.finish_reason
        msg.usage.CopyFrom(usage_proto(event.usage))
        msg.speculation.CopyFrom(speculation_proto(event.speculation))
    return msg


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, front_door: FrontDoor):
        self.front_door = front_door

    async def _start(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> Generation:
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        try:
            # A channel's calls share its connection, and so its turns at admission.
            generation = await self.front_door.submit(params_of(request), deadline, via="gRPC", client=context.peer())
        except GenerationError as err:
            await context.abort(STATUS[err.kind], err.message)
        # However the call ends: a client that cancelled it, or whose deadline passed, stops the request.
        context.add_done_callback(lambda _: generation.cancel("its gRPC client cancelled it or its deadline passed"))
        return generation

    async def Generate(self, request, context):
        generation = await self._start(request, context)
        try:
            return response_of(await generation.complete())
        except GenerationError as err:
            await context.abort(STATUS[err.kind], err.message)

    async def GenerateStream(self, request, context):
        generation = await self._start(request, context)
        try:
            async for event in generation.events():
                yield chunk_of(generation.request_id, event)
        except GenerationError as err:
            await context.abort(STATUS[err.kind], err.message)
