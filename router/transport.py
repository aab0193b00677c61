"""How the router reaches drafters and the verifier.

The scheduler talks to these two small interfaces only, in the messages of
proto/specfleet/v1, so the transport underneath can change (gRPC, Ray actors,
in-process calls) without touching scheduling. Every transport raises
`TransportError` when a call fails.
"""

from __future__ import annotations

from typing import Protocol

import grpc

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

    async def draft(self, request: drafter_pb2.DraftRequest, timeout_s: float) -> drafter_pb2.DraftResponse: ...
    async def release(self, session_ids: list[str]) -> None: ...
    async def info(self, timeout_s: float) -> drafter_pb2.DrafterInfo: ...


class VerifierTransport(Protocol):
    async def verify(self, request: verifier_pb2.VerifyRequest, timeout_s: float) -> verifier_pb2.VerifyResponse: ...
    async def release(self, session_ids: list[str]) -> None: ...
    async def info(self, timeout_s: float) -> common_pb2.ModelInfo: ...


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

    async def draft(self, request, timeout_s):
        return await self._call("Draft", request, timeout_s)


class GrpcVerifier(_GrpcPeer):
    def __init__(self, address: str, security: Security | None = None):
        super().__init__(address, verifier_pb2_grpc.VerifierStub, security)

    async def verify(self, request, timeout_s):
        return await self._call("Verify", request, timeout_s)
