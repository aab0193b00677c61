"""The shell of a model service: what the verifier and each drafter service run around their core.

A model service (`verifier_service`, `drafter_service`) keeps its core (proto messages in and out,
its model behind a `BatchQueue`), its thin gRPC adapter and its model code, and describes itself in
a `ServiceSpec`. The shell runs it:

- `main`: `specfleet verifier|drafter` (`python -m verifier_service|drafter_service`): the common
  flags, the config, the logs, the bind check, a start-up error refused in one line (exit code 1);
- `serve_core`: its gRPC server (`specfleet.serving.serve`: health, reflection, graceful shutdown)
  with TLS and the internal token (`specfleet.security`) and its /metrics endpoint;
- `CoreServicer`: the RPCs every core answers alike, and a refusal's status code;
- `ServiceActor`: the same core as a Ray actor (`specfleet serve --ray`).

It imports no service: each hands its parts in.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import yaml

from specfleet import config as config_mod
from specfleet import limits as limits_mod
from specfleet import metrics, ray_actors, security, serving
from specfleet.ports import listen
from specfleet.serving import serve, setup_logging
from specfleet.v1 import common_pb2

log = logging.getLogger(__name__)


class InvalidArgument(ValueError):
    """A request the service refuses: INVALID_ARGUMENT over gRPC, raised as is to a Ray caller."""


class Core(Protocol):
    """What the shell asks of a service's core (`VerifierCore`, `DrafterCore`): the service's own call
    (verify, draft) is its servicer's and actor's business."""

    telemetry: metrics.PassTelemetry

    async def release(self, request): ...

    def info(self): ...

    async def stats(self): ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Section:
    """The part of the config one process serves: the verifier, or one drafter service."""

    config: config_mod.ServiceConfig  # a VerifierConfig or a DrafterServiceConfig: what the shell reads is in their shared base
    name: str  # in its logs, its errors and the bind check: "verifier", "drafter NAME"
    key: str  # its config key, in messages: "verifier", "drafters[NAME]"
    metrics_port: int  # its /metrics port when metrics_port is unset (and free)


@dataclass(frozen=True)
class ServiceSpec:
    """What a model service hands the shell."""

    command: str  # `specfleet COMMAND`, and the service its logs name: "verifier", "drafter"
    description: str  # of `specfleet COMMAND --help`
    config_key: str  # its section, as the flags' help names it: "verifier", "drafters[NAME]"
    select: Callable[[config_mod.Config, str | None], Section]  # its section of a config; with a name: that one (--name)
    load_core: Callable[..., Core]  # (section.config, threads=None, **its flags): loads the model(s), builds the core
    servicer: Callable[[Core], object]  # its gRPC servicer over a core
    add_servicer: Callable[[object, grpc.aio.Server], None]  # the stubs' add_...Servicer_to_server
    descriptor: Any  # its proto service's descriptor (reflection and health name it)
    flags: tuple[tuple[str, str], ...] = ()  # its own flags (flag, help): load_core takes each by its dest
    name_help: str | None = None  # --name's help, for a service a config holds several of (None: no --name)
    errors: tuple[type[Exception], ...] = ()  # its own start-up errors, refused like a bad config


# --- the command line ---------------------------------------------------------------------------------------------


def parser(spec: ServiceSpec) -> argparse.ArgumentParser:
    key = spec.config_key
    parser = argparse.ArgumentParser(prog=f"specfleet {spec.command}", description=spec.description)
    parser.add_argument("--config", help="deployment YAML (default: bundled demo models)")
    if spec.name_help:
        parser.add_argument("--name", help=spec.name_help)
    for flag, text in spec.flags:
        parser.add_argument(flag, help=text)
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback; 0.0.0.0 needs security.token_file or mutual TLS)")
    parser.add_argument("--port", type=int, help=f"port (default: the port of {key}.address, or of the replica's with --replica)")
    parser.add_argument("--replica", type=int, default=0, help=f"serve as replica N: 0 is {key}.address, N the Nth of {key}.replicas")
    parser.add_argument("--threads", type=int, help=f"torch threads (default: {key}.threads)")
    return parser


@dataclass
class Started:
    section: Section
    sec: security.Security
    core: Core
    port: int
    metrics_sock: socket.socket | None


def main(spec: ServiceSpec, argv: list[str] | None = None) -> int:
    """`specfleet COMMAND`: serve the service until SIGTERM; a start-up error ends it with one line naming it (exit code 1)."""
    args = parser(spec).parse_args(argv)
    setup_logging(spec.command)
    refused = (config_mod.ConfigError, security.InsecureBinding, OSError, *spec.errors)
    try:
        started = start(spec, args)
        serving.run(serve_core(spec, started.section.name, started.core, args.host, started.port, started.sec, started.metrics_sock))
    except refused as err:
        raise SystemExit(f"specfleet {spec.command}: {err}") from None
    return 0


def start(spec: ServiceSpec, args: argparse.Namespace) -> Started:
    """Everything before serving: the config, the checks (before any model loads), the core, the metrics socket."""
    cfg = config_mod.load(args.config) if args.config else config_mod.default_config(config_mod.REPO / ".cache")
    section = spec.select(cfg, args.name if spec.name_help else None)
    sec = security.load(cfg.security)
    sec.check_binding(section.name, args.host, internal=True)
    replica_port, metrics_port = config_mod.replica_ports(section.config, args.replica, f"{section.name} --replica")
    flags = {dest: getattr(args, dest) for dest in (flag.lstrip("-").replace("-", "_") for flag, _ in spec.flags)}
    core = spec.load_core(section.config, threads=args.threads, **flags)
    port = args.port if args.port is not None else replica_port
    metrics_sock = listen(args.host, metrics_port, section.metrics_port, f"{section.name} metrics", f"{section.key}.metrics_port")
    return Started(section, sec, core, port, metrics_sock)


# --- the gRPC server ----------------------------------------------------------------------------------------------


async def serve_core(
    spec: ServiceSpec,
    name: str,
    core: Core,
    host: str,
    port: int,
    sec: security.Security,
    metrics_sock: socket.socket | None,
    grace_s: float = 10.0,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve `core` over gRPC as `name` until SIGTERM or SIGINT (in-flight calls get grace_s), and /metrics on metrics_sock
    (None: off), both behind `sec`'s TLS and the internal token; the core is closed once the calls have drained.
    stop: ends it instead of SIGTERM and SIGINT (`specfleet.serving.serve`)."""
    servicer = spec.servicer(core)

    def register(server: grpc.aio.Server) -> list[str]:
        spec.add_servicer(servicer, server)
        return [spec.descriptor.full_name]

    async with metrics.exported(metrics_sock, core.telemetry.registry, **sec.metrics_options()):
        await serve(
            name,
            host,
            port,
            register,
            grace_s=grace_s,
            on_stop=core.close,
            credentials=sec.server_credentials(),
            interceptors=sec.server_interceptors(),
            stop=stop,
        )


class CoreServicer:
    """The RPCs every model service answers alike (ReleaseSessions, GetInfo, GetStats), and its refusals' status
    codes. A service's servicer puts it before its generated base and adds its own call through `answer`."""

    def __init__(self, core: Core):
        self.core = core

    async def answer(self, reply: Awaitable, context: grpc.aio.ServicerContext):
        """The core's reply; a refused request aborts the call: INVALID_ARGUMENT, or RESOURCE_EXHAUSTED over the call limits."""
        try:
            return await reply
        except InvalidArgument as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        except limits_mod.CallTooLarge as err:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(err))

    async def ReleaseSessions(self, request, context):
        return await self.core.release(request)

    async def GetInfo(self, request, context):
        return self.core.info()

    async def GetStats(self, request, context):
        return await self.core.stats()


# --- the Ray actor ------------------------------------------------------------------------------------------------


class ServiceActor:
    """A model service's core as a Ray actor, called with the serialized bytes of its proto messages.

    `specfleet serve --ray` creates it (`specfleet.ray_cluster`) with the config as YAML and, for a
    service a config holds several of, the section's name; the router reaches it through
    `router.ray_transport`. A request the core refuses raises `InvalidArgument` (a ValueError), which
    Ray hands to the caller wrapped in a RayTaskError. A service's actor gives its `spec()` and its own
    call (verify, draft) through `call`.
    """

    def __init__(self, config_yaml: str, name: str | None = None):
        ray_actors.prepare_actor_process()  # before the model stack is imported
        spec = self.spec()
        cfg = config_mod.parse(yaml.safe_load(config_yaml), "config from specfleet serve --ray")
        section = spec.select(cfg, name)
        setup_logging(section.name)
        self.core = spec.load_core(section.config)
        log.info("%s actor ready: %s", section.name, ray_actors.where())

    def spec(self) -> ServiceSpec:
        """The service's spec: imported here, in the actor, after `prepare_actor_process` (it brings the model stack)."""
        raise NotImplementedError

    async def call(self, method: Callable[[Any], Awaitable], request_type, data: bytes) -> bytes:
        """`method`'s reply to the request in `data`, serialized."""
        return (await method(request_type.FromString(data))).SerializeToString()

    async def release(self, data: bytes) -> bytes:
        return await self.call(self.core.release, common_pb2.ReleaseRequest, data)

    async def info(self) -> bytes:
        return self.core.info().SerializeToString()

    async def where(self) -> dict:
        return ray_actors.where()

    async def ranks(self) -> list[dict]:
        """Where the other ranks of its split model run (each rank actor's `where()`, `engine/ray_ranks.py`), rank 1
        first; none where no model is split, or where its ranks are child processes (an actor outside a placement group)."""
        return [await worker.where() for loaded in self.core.loaded_models() for worker in loaded.ranks if hasattr(worker, "where")]
