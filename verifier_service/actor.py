"""The verifier as a Ray actor: the same `VerifierCore` as the gRPC service, called with serialized proto bytes.

`specfleet serve --ray` creates it (`specfleet.ray_cluster`); the router reaches it
through `router.ray_transport.RayVerifier`. Methods take and return the bytes of
the messages in proto/specfleet/v1/verifier.proto and common.proto. A request the
verifier refuses raises `verifier_service.server.InvalidArgument` (a ValueError),
which Ray hands to the caller wrapped in a RayTaskError.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class VerifierActor:
    def __init__(self, config_yaml: str):
        from specfleet import ray_actors

        ray_actors.prepare_actor_process()  # before the model stack is imported
        import yaml

        from specfleet import config as config_mod
        from specfleet.serving import setup_logging
        from verifier_service.server import load_core

        setup_logging("verifier")
        cfg = config_mod.parse(yaml.safe_load(config_yaml), "config from specfleet serve --ray")
        self.core = load_core(cfg.verifier)
        log.info("verifier actor ready: %s", ray_actors.where())

    async def verify(self, data: bytes) -> bytes:
        from specfleet.v1 import verifier_pb2

        request = verifier_pb2.VerifyRequest.FromString(data)
        return (await self.core.verify(request)).SerializeToString()

    async def release(self, data: bytes) -> bytes:
        from specfleet.v1 import common_pb2

        return (await self.core.release(common_pb2.ReleaseRequest.FromString(data))).SerializeToString()

    async def info(self) -> bytes:
        return self.core.info().SerializeToString()

    async def where(self) -> dict:
        from specfleet import ray_actors

        return ray_actors.where()
