"""How the router reaches drafters and the verifier.

The scheduler talks to these two small interfaces only, in the plain records of
router/messages.py, so the transport underneath can change (gRPC, Ray actors,
a verifier in the router's own process) without touching scheduling. This module is where those
records become proto/specfleet/v1 messages and replies become records again
(`draft_request`, `draft_response`, `verify_request`, `verify_response`, shared
with router/ray_transport.py). Every transport raises `TransportError` when a
call fails.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Protocol

import grpc

from router import messages
from specfleet.guides import Guide
from specfleet.sampling import SamplingParams
from specfleet.security import Security
from specfleet.serving import CHANNEL_OPTIONS
from specfleet.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc


class TransportError(Exception):
    """A call to a drafter or the verifier failed; the scheduler treats every transport's failures alike."""

    def __init__(self, message: str, invalid_argument: bool = False):
        super().__init__(message)
        self.invalid_argument = invalid_argument  # the server refused the request itself, retrying will not help


def _wrap(err: grpc.aio.AioRpcError) -> TransportError:
    # RESOURCE_EXHAUSTED: a call over the server's per-call limits (specfleet/limits.py), as refused as a malformed one.
    refused = err.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    return TransportError(f"{err.code().name}: {err.details()}", invalid_argument=refused)


class DrafterTransport(Protocol):
    name: str

    async def draft(self, sessions: list[messages.DraftSession], timeout_s: float) -> messages.DraftResponse: ...
    async def release(self, session_ids: list[str]) -> None: ...
    async def info(self, timeout_s: float) -> drafter_pb2.DrafterInfo: ...


class VerifierTransport(Protocol):
    async def verify(self, sessions: list[messages.VerifySession], timeout_s: float) -> messages.VerifyResponse: ...
    async def release(self, session_ids: list[str]) -> None: ...
    async def info(self, timeout_s: float) -> common_pb2.ModelInfo: ...


# --- records to messages and back ------------------------------------------------------------------------------

# A request's sampling parameters do not change while it lives: each gets its message once, on its
# first call, kept as long as the request's parameters are (a weak key: the entry goes with them).
_sampling_messages: weakref.WeakKeyDictionary[SamplingParams, common_pb2.SamplingParams] = weakref.WeakKeyDictionary()


def sampling_message(params: SamplingParams) -> common_pb2.SamplingParams:
    message = _sampling_messages.get(params)
    if message is None:
        message = _sampling_messages[params] = common_pb2.SamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            seed=params.seed,
            drafter_invariant=params.drafter_invariant,
            logit_bias=dict(params.logit_bias),
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            output_start=params.output_start,
            min_tokens=params.min_tokens,
            held_back=params.held_back,
            guide=_guide(params.guide) if params.guide else None,
            allowed_token_ids=params.allowed_token_ids,
            bad_words=[common_pb2.TokenSequence(token_ids=word) for word in params.bad_words],
        )
    return message


def _guide(guide: Guide) -> common_pb2.Guide:
    message = common_pb2.Guide(kind=guide.kind, spec=guide.spec, compact=guide.compact, thought_end=guide.thought_end)
    if guide.thought_open is not None:
        message.thought_open = guide.thought_open
    return message


def point_mass(token: int) -> common_pb2.SparseDistribution:
    """A proposal, in the form a drafter's reply carries one, that puts all its mass on `token`."""
    return common_pb2.SparseDistribution(token_ids=[token], probs=[1.0])


def _sync(sync: messages.SessionSync) -> common_pb2.SessionSync:
    return common_pb2.SessionSync(
        session_id=sync.session_id, prefix_length=sync.prefix_length, new_token_ids=sync.new_token_ids, cache_salt=sync.cache_salt
    )


def draft_request(sessions: list[messages.DraftSession]) -> drafter_pb2.DraftRequest:
    return drafter_pb2.DraftRequest(
        sessions=[
            drafter_pb2.DraftSession(
                sync=_sync(s.sync),
                model=s.model,
                num_draft_tokens=s.num_draft_tokens,
                sampling=sampling_message(s.sampling),
                stop_below_confidence=s.stop_below_confidence,
                score_context=s.score_context,
                lockstep_group=s.lockstep_group,
            )
            for s in sessions
        ]
    )


def draft_response(reply: drafter_pb2.DraftResponse) -> messages.DraftResponse:
    return messages.DraftResponse(
        sessions=[
            messages.DraftedSession(
                known=s.status in (common_pb2.SESSION_OK, common_pb2.SESSION_PREFILLING),
                prefilling=s.status == common_pb2.SESSION_PREFILLING,
                token_ids=list(s.token_ids),
                proposals=list(s.proposals),
                confidences=list(s.confidences),
                context_log_prob=s.context_log_prob,
                context_tokens=s.context_tokens,
            )
            for s in reply.sessions
        ],
        compute_ms=reply.compute_ms,
        queue_ms=reply.queue_ms,
    )


def verify_request(sessions: list[messages.VerifySession]) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(
        sessions=[
            verifier_pb2.VerifySession(
                sync=_sync(s.sync),
                tree=verifier_pb2.TokenTree(token_ids=s.tree.token_ids, parents=s.tree.parents, proposals=s.tree.proposals),
                sampling=sampling_message(s.sampling),
                logprobs=s.logprobs,
                top_logprobs=s.top_logprobs,
                prompt_logprobs=s.prompt_logprobs,
                prompt_top_logprobs=s.prompt_top_logprobs,
                plain_steps=s.plain_steps,
                lookup_tokens=s.lookup_tokens,
                max_tokens=s.max_tokens,
            )
            for s in sessions
        ]
    )


def _prompt_logprobs(m: verifier_pb2.PromptLogprobs) -> messages.PromptLogprobs:
    return messages.PromptLogprobs(list(m.logprobs), list(m.ranks), list(m.top_token_ids), list(m.top_logprobs))


def verify_response(reply: verifier_pb2.VerifyResponse) -> messages.VerifyResponse:
    return messages.VerifyResponse(
        sessions=[
            messages.VerifiedSession(
                known=s.status in (common_pb2.SESSION_OK, common_pb2.SESSION_PREFILLING),
                prefilling=s.status == common_pb2.SESSION_PREFILLING,
                accepted_nodes=list(s.accepted_nodes),
                token_ids=list(s.token_ids),
                logprobs=list(s.logprobs),
                top_token_ids=list(s.top_token_ids),
                top_logprobs=list(s.top_logprobs),
                lookup_proposed=s.lookup_proposed,
                lookup_accepted=s.lookup_accepted,
                prompt_logprobs=_prompt_logprobs(s.prompt_logprobs) if s.HasField("prompt_logprobs") else None,
                cached_tokens=s.cached_tokens,
            )
            for s in reply.sessions
        ],
        compute_ms=reply.compute_ms,
        batch_size=reply.batch_size,
        queue_ms=reply.queue_ms,
        passes=reply.passes or 1,
        shared_ms=reply.shared_ms,
    )


# --- gRPC ----------------------------------------------------------------------------------------------------------


class _GrpcPeer:
    """A channel to one drafter or verifier service; the calls both kinds answer alike."""

    def __init__(self, address: str, stub_class, security: Security | None = None):
        self.address = address
        # TLS and the internal token when the config asks for them (specfleet/security.py).
        self._channel = security.aio_channel(address) if security else grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._metadata = security.internal_metadata() if security else ()
        self._stub = stub_class(self._channel)

    async def _call(self, method: str, request, timeout_s: float):
        try:
            return await getattr(self._stub, method)(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise _wrap(err) from None

    async def release(self, session_ids):
        await self._call("ReleaseSessions", common_pb2.ReleaseRequest(session_ids=session_ids), 10.0)

    async def info(self, timeout_s):
        return await self._call("GetInfo", common_pb2.InfoRequest(), timeout_s)

    async def close(self):
        await self._channel.close()


class GrpcDrafter(_GrpcPeer):
    def __init__(self, name: str, address: str, security: Security | None = None):
        super().__init__(address, drafter_pb2_grpc.DrafterStub, security)
        self.name = name

    async def draft(self, sessions, timeout_s):
        return draft_response(await self._call("Draft", draft_request(sessions), timeout_s))


class GrpcVerifier(_GrpcPeer):
    def __init__(self, address: str, security: Security | None = None):
        super().__init__(address, verifier_pb2_grpc.VerifierStub, security)

    async def verify(self, sessions, timeout_s):
        return verify_response(await self._call("Verify", verify_request(sessions), timeout_s))


# --- in process ----------------------------------------------------------------------------------------------------


class _InProcess:
    """A service's core in the router's own process (`specfleet.colocated`): the same validation and batch queue as
    over gRPC, handed over by a call instead of a socket, in the router's records instead of protobuf. The core is
    any object that answers records (`call(sessions)`, `release(session_ids)`, `info()`); the router imports no
    service, the launcher hands it one. A request the core refuses raises a ValueError (INVALID_ARGUMENT or
    RESOURCE_EXHAUSTED over gRPC); anything else fails the call as a dead replica's would."""

    in_process = True

    def __init__(self, core: Any, address: str):
        self.core = core
        self.address = address  # where its service's gRPC server listens for everyone else

    async def _call(self, sessions, timeout_s):
        try:
            async with asyncio.timeout(timeout_s):  # no task of its own, unlike wait_for
                return await self.core.call(sessions)
        except ValueError as err:
            raise TransportError(f"INVALID_ARGUMENT: {err}", invalid_argument=True) from None
        except TimeoutError:
            raise TransportError(f"DEADLINE_EXCEEDED: no answer within {timeout_s:g}s") from None
        except Exception as err:  # the model thread's failure or a closing core: as a replica that went away
            raise TransportError(f"UNAVAILABLE: {type(err).__name__}: {err}") from None

    async def release(self, session_ids):
        await self.core.release(session_ids)

    async def info(self, timeout_s):
        return self.core.info()

    async def close(self):
        pass  # the core is closed by its service's server, after the router has drained


class InProcessVerifier(_InProcess):
    """The verifier's core in the router's process (`verifier.colocate`): a round saves the two process hops of its
    Verify call and the encoding of its messages."""

    async def verify(self, sessions, timeout_s):
        return await self._call(sessions, timeout_s)


class InProcessDrafter(_InProcess):
    """A drafter service's core in the router's process (`drafters[].colocate`), as one replica named `name`."""

    def __init__(self, name: str, core: Any, address: str):
        super().__init__(core, address)
        self.name = name

    async def draft(self, sessions, timeout_s):
        return await self._call(sessions, timeout_s)
