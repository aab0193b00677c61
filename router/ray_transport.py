"""The router's transports over Ray actors: the same two interfaces as `router.transport`, another wire.

`RayDrafter` and `RayVerifier` call the actor methods of
`drafter_service.actor.DrafterActor` and `verifier_service.actor.VerifierActor`
with serialized proto messages (built from the router's records as gRPC's are,
`router.transport.draft_request` ...) and await the ObjectRefs. Failures become
`RayTransportError`, a `router.transport.TransportError` with the status code a
gRPC service would have answered, so the scheduler treats a Ray actor exactly
like a gRPC service:

| Ray                                                    | status code        | scheduler |
|---|---|---|
| actor dead, restarting, or its node gone (RayActorError) | UNAVAILABLE        | drafter: this round decodes plainly; verifier: the round's |
|                                                        |                    | requests move to another replica (or wait for one) |
| no answer within the deadline                          | DEADLINE_EXCEEDED  | as above |
| the actor refused the request (ValueError inside)      | INVALID_ARGUMENT   | verifier: INTERNAL to the client (a router bug) |
| anything else raised inside the actor                  | INTERNAL           | as UNAVAILABLE |
| any other Ray error (object lost, out of memory, ...)  | UNAVAILABLE        | |

The router does not import the services: it reaches the actors by name
(`specfleet.ray_cluster`), and Ray carries the calls.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from router import messages
from router.transport import TransportError, draft_request, draft_response, verify_request, verify_response
from specfleet.v1 import common_pb2, drafter_pb2, verifier_pb2

log = logging.getLogger(__name__)


class RayTransportError(TransportError):
    """A failed actor call, with the status code the gRPC service would have answered (`code()`, `details()`)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}", invalid_argument=code == grpc.StatusCode.INVALID_ARGUMENT)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def _translate(err: BaseException, what: str) -> RayTransportError:
    import ray.exceptions as rex

    if isinstance(err, rex.RayTaskError):
        cause = getattr(err, "cause", None)
        if isinstance(cause, ValueError):
            return RayTransportError(grpc.StatusCode.INVALID_ARGUMENT, f"{what}: {cause}")
        return RayTransportError(grpc.StatusCode.INTERNAL, f"{what} failed inside the actor: {cause or err}")
    if isinstance(err, rex.RayActorError):
        return RayTransportError(grpc.StatusCode.UNAVAILABLE, f"{what}: actor unavailable ({type(err).__name__}: {_first_line(err)})")
    return RayTransportError(grpc.StatusCode.UNAVAILABLE, f"{what}: {type(err).__name__}: {_first_line(err)}")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


async def _await_ref(ref):
    return await ref


async def call(method, payload: bytes | None, timeout_s: float | None, what: str) -> bytes:
    """Call an actor method, wait at most timeout_s, and map Ray's failures to RayTransportError."""
    import ray
    import ray.exceptions as rex

    try:
        ref = method.remote() if payload is None else method.remote(payload)
    except rex.RayError as err:
        raise _translate(err, what) from err
    try:
        return await asyncio.wait_for(_await_ref(ref), timeout_s)
    except asyncio.TimeoutError:
        try:
            ray.cancel(ref)
        except Exception:
            pass
        raise RayTransportError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{what}: no answer within {timeout_s:g}s") from None
    except rex.RayError as err:
        raise _translate(err, what) from err


class RayDrafter:
    """A drafter service's actor (`drafter-<name>`) as a DrafterTransport."""

    def __init__(self, name: str, handle):
        self.name = name
        self.address = f"ray actor drafter-{name}"
        self._actor = handle

    async def draft(self, sessions: list[messages.DraftSession], timeout_s: float) -> messages.DraftResponse:
        data = await call(self._actor.draft, draft_request(sessions).SerializeToString(), timeout_s, f"drafter {self.name}: Draft")
        return draft_response(drafter_pb2.DraftResponse.FromString(data))

    async def release(self, session_ids: list[str]) -> None:
        await call(
            self._actor.release, common_pb2.ReleaseRequest(session_ids=session_ids).SerializeToString(), 10.0, f"drafter {self.name}: ReleaseSessions"
        )

    async def info(self, timeout_s: float) -> drafter_pb2.DrafterInfo:
        return drafter_pb2.DrafterInfo.FromString(await call(self._actor.info, None, timeout_s, f"drafter {self.name}: GetInfo"))

    async def close(self) -> None:
        pass


class RayVerifier:
    """A verifier replica's actor (`verifier`, `verifier-1`, ...) as a VerifierTransport."""

    def __init__(self, name: str, handle):
        self.name = name
        # The replica's name in the router's VerifierPool, logs and metrics: unique per actor.
        self.address = f"ray actor {name}"
        self._actor = handle

    async def verify(self, sessions: list[messages.VerifySession], timeout_s: float) -> messages.VerifyResponse:
        data = await call(self._actor.verify, verify_request(sessions).SerializeToString(), timeout_s, f"{self.name}: Verify")
        return verify_response(verifier_pb2.VerifyResponse.FromString(data))

    async def release(self, session_ids: list[str]) -> None:
        await call(self._actor.release, common_pb2.ReleaseRequest(session_ids=session_ids).SerializeToString(), 10.0, f"{self.name}: ReleaseSessions")

    async def info(self, timeout_s: float) -> common_pb2.ModelInfo:
        return common_pb2.ModelInfo.FromString(await call(self._actor.info, None, timeout_s, f"{self.name}: GetInfo"))

    async def close(self) -> None:
        pass


async def connect(cfg, address: str, namespace: str, timeout_s: float):
    """Join the Ray cluster, find the config's actors, wait until they are ready.

    address: a GCS address from a Ray node, or `ray://HOST:PORT` (Ray Client) from anywhere.
    Returns ([RayVerifier per replica], {drafter service name: RayDrafter}) for `router.server.build`.
    """
    from specfleet import ray_actors

    gcs = ray_actors.connect(address, namespace, log_to_driver=False, logging_level=logging.WARNING)
    handles = await asyncio.to_thread(ray_actors.lookup_actors, cfg, namespace, timeout_s)
    placements = await ray_actors.wait_ready(handles, timeout_s, cfg)
    log.info("Ray cluster %s, namespace %r; actors:\n%s", gcs, namespace, ray_actors.format_placement(placements))
    verifiers = [RayVerifier(name, handles[name]) for name in ray_actors.verifier_actor_names(cfg)]
    drafters = {svc.name: RayDrafter(svc.name, handles[ray_actors.drafter_actor_name(svc.name)]) for svc in cfg.drafters}
    return verifiers, drafters
