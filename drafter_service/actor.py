"""A drafter service as a Ray actor: the same `DrafterCore` as the gRPC service, called with serialized proto bytes.

`specfleet serve --ray` creates one per drafter service of the config (`specfleet.ray_cluster`),
named by `service`; the router reaches it through `router.ray_transport.RayDrafter`. Methods take
and return the bytes of the messages in proto/specfleet/v1/drafter.proto and common.proto;
`specfleet.service_shell.ServiceActor` holds all but `draft` (and says what a refused request raises).
"""

from __future__ import annotations

from specfleet.service_shell import ServiceActor, ServiceSpec
from specfleet.v1 import drafter_pb2


class DrafterActor(ServiceActor):
    def __init__(self, config_yaml: str, service: str):
        super().__init__(config_yaml, service)

    def spec(self) -> ServiceSpec:
        from drafter_service.server import SPEC

        return SPEC

    async def draft(self, data: bytes) -> bytes:
        return await self.call(self.core.draft, drafter_pb2.DraftRequest, data)
