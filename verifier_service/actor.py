"""The verifier as a Ray actor: the same `VerifierCore` as the gRPC service, called with serialized proto bytes.

`specfleet serve --ray` creates it (`specfleet.ray_cluster`); the router reaches it through
`router.ray_transport.RayVerifier`. Methods take and return the bytes of the messages in
proto/specfleet/v1/verifier.proto and common.proto; `specfleet.service_shell.ServiceActor` holds
all but `verify` (and says what a refused request raises).
"""

from __future__ import annotations

from specfleet.service_shell import ServiceActor, ServiceSpec
from specfleet.v1 import verifier_pb2


class VerifierActor(ServiceActor):
    def __init__(self, config_yaml: str):
        super().__init__(config_yaml)

    def spec(self) -> ServiceSpec:
        from verifier_service.server import SPEC

        return SPEC

    async def verify(self, data: bytes) -> bytes:
        return await self.call(self.core.verify, verifier_pb2.VerifyRequest, data)
