"""A drafter service as a Ray actor: the same `DrafterCore` as the gRPC service, called with serialized proto bytes.

`specfleet serve --ray` creates one per drafter service of the config
(`specfleet.ray_cluster`); the router reaches it through
`router.ray_transport.RayDrafter`. Methods take and return the bytes of the
messages in proto/specfleet/v1/drafter.proto and common.proto. A request the
drafter refuses raises `drafter_service.server.InvalidArgument` (a ValueError),
which Ray hands to the caller wrapped in a RayTaskError.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class DrafterActor:
    def __init__(self, config_yaml: str, service: str):
        from specfleet import ray_actors

        ray_actors.prepare_actor_process()  # before the model stack is imported
        import yaml

        from drafter_service.server import load_core
        from specfleet import config as config_mod
        from specfleet.serving import setup_logging

        setup_logging(f"drafter {service}")
        cfg = config_mod.parse(yaml.safe_load(config_yaml), "config from specfleet serve --ray")
        self.service = service
        self.core = load_core(cfg.drafter_service(service))
        log.info("drafter actor %s ready: %s", service, ray_actors.where())

    async def draft(self, data: bytes) -> bytes:
        from specfleet.v1 import drafter_pb2

        request = drafter_pb2.DraftRequest.FromString(data)
        return (await self.core.draft(request)).SerializeToString()

    async def release(self, data: bytes) -> bytes:
        from specfleet.v1 import common_pb2

        return (await self.core.release(common_pb2.ReleaseRequest.FromString(data))).SerializeToString()

    async def info(self) -> bytes:
        return self.core.info().SerializeToString()

    async def where(self) -> dict:
        from specfleet import ray_actors

        return ray_actors.where()
