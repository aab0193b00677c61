"""specfleet/serving.py: what every gRPC server of specfleet shares."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from specfleet import serving


def test_a_port_another_grpc_server_holds_is_refused_not_shared():
    """gRPC servers bind with SO_REUSEPORT unless told otherwise: two on one port would both start and the
    kernel would split connections between them (a client's calls reaching the wrong service)."""

    async def run() -> None:
        other = grpc.aio.server()  # gRPC's defaults, as any other gRPC server on the machine
        port = other.add_insecure_port("127.0.0.1:0")
        await other.start()
        try:
            with pytest.raises(OSError, match=f"verifier: cannot listen on 127.0.0.1:{port}"):
                await asyncio.wait_for(serving.serve("verifier", "127.0.0.1", port, lambda server: []), 30)
        finally:
            await other.stop(None)

    asyncio.run(run())
