"""specfleet/serving.py: what every gRPC server of specfleet shares."""

from __future__ import annotations

import asyncio
import gc

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


@pytest.mark.parametrize("chosen", ["uvloop", "asyncio"])
def test_services_run_on_the_event_loop_chosen(monkeypatch, chosen):
    """uvloop's loop by default (a dependency), asyncio's when SPECFLEET_EVENT_LOOP says so; the main coroutine's
    result comes back either way."""
    import uvloop

    monkeypatch.setenv("SPECFLEET_EVENT_LOOP", chosen)

    async def main():
        return type(asyncio.get_running_loop())

    loop_type = serving.run(main())
    assert issubclass(loop_type, uvloop.Loop) == (chosen == "uvloop")


def test_an_unknown_event_loop_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.setenv("SPECFLEET_EVENT_LOOP", "trio")

    async def main():
        return None

    coroutine = main()
    with pytest.raises(SystemExit, match="SPECFLEET_EVENT_LOOP must be one of uvloop, asyncio, got 'trio'"):
        serving.run(coroutine)
    coroutine.close()


def test_what_a_server_holds_once_it_listens_is_out_of_the_collectors_generations():
    """Objects alive once the server listens (its models, modules and tables) live as long as the process: they are
    frozen, so collections while serving walk only what serving allocates."""
    gc.unfreeze()  # nothing frozen before it serves: only serve's freeze can pass the test

    async def run() -> int:
        stop = asyncio.Event()
        server = asyncio.create_task(serving.serve("verifier", "127.0.0.1", 0, lambda server: [], stop=stop))
        try:
            while gc.get_freeze_count() == 0 and not server.done():
                await asyncio.sleep(0.01)
            return gc.get_freeze_count()
        finally:
            stop.set()
            await server

    try:
        assert asyncio.run(asyncio.wait_for(run(), 30)) > 0
    finally:
        gc.unfreeze()
