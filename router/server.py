"""The router process: start-up (connect, check, build the scheduler and the front door), the public gRPC service
(router/grpc_api.py) and the optional HTTP API (router/openai_api.py) over it, reload, shutdown."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import pathlib

from router.frontdoor import FrontDoor
from router.profiling import profile_costs
from router.grpc_api import GenerationServicer
from router.request import Limits, prompt_chars_bound
from router.domains import DomainClassifier
from router.expertise import ExpertiseStore, RedisAuthError, RedisExpertiseStore, redacted
from router.routing import DrafterProfile, DrafterRouter
from router.rounds import SchedulerConfig
from router.scheduler import Scheduler
from router.cost_model import CostModel
from router.speculation import SpeculationController
from router.transport import GrpcDrafter, GrpcVerifier
from router.drafters import DrafterService
from router.verifiers import VerifierPool
from specfleet import config as config_mod
from specfleet import limits, metrics, placement, security, serving
from router.telemetry import RouterTelemetry
from specfleet.tokenizer import load_tokenizer, tokenizer_fingerprint
from specfleet.ports import listen, report
from specfleet.serving import ROUTER_DRAIN_S, serve, setup_logging, wait_until_serving
from specfleet.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    pass


async def build(cfg: config_mod.Config, verifiers: list | None = None, drafters: dict | None = None) -> tuple[FrontDoor, Scheduler, list]:
    """Connect to the verifier and drafters, check that they fit together, and build the scheduler and the front door.

    verifiers: the verifier replicas, already connected and ready (Ray actors from `router.ray_transport.connect`,
    or the core in this process, `router.transport.InProcessVerifier`); drafters: {drafter service name: drafter},
    the same (Ray actors, or cores in this process, `InProcessDrafter`). The rest: gRPC to the configured addresses.
    """
    rcfg = cfg.router
    timeout = rcfg.startup_timeout_s
    sec = security.load(cfg.security)
    waits = []
    if verifiers is None:
        addresses = cfg.verifier.addresses()
        verifiers = [GrpcVerifier(address, sec) for address in addresses]
        log.info("waiting for %d verifier replica(s) at %s", len(addresses), ", ".join(addresses))
        waits += [wait_until_serving(address, timeout, security=sec) for address in addresses]
    given = drafters or {}
    services = {name: t if isinstance(t, DrafterService) else DrafterService(name, [t]) for name, t in given.items()}
    over_grpc = [svc for svc in cfg.drafters if svc.name not in given]
    if over_grpc:
        services |= {svc.name: grpc_drafter_service(svc, sec) for svc in over_grpc}
        log.info("waiting for %d drafter service(s)", len(over_grpc))
        waits += [wait_until_serving(address, timeout, security=sec) for svc in over_grpc for address in svc.addresses()]
    await asyncio.gather(*waits)
    infos = await asyncio.gather(*(replica.info(timeout_s=30) for replica in verifiers))
    target = infos[0]
    for replica, info in zip(verifiers[1:], infos[1:]):
        # Requests move between replicas mid-generation: every replica must compute the same target.
        differs = [
            f for f in ("tokenizer_fingerprint", "vocab_size", "max_context", "eos_token_id", "parameters") if getattr(info, f) != getattr(target, f)
        ]
        if differs or pathlib.Path(info.path).name != pathlib.Path(target.path).name:
            raise StartupError(
                f"verifier replica {replica.address} serves {info.path} and {verifiers[0].address} serves {target.path}"
                f" ({', '.join(differs) or 'path'} differ); every replica must host the same target model"
            )
    # A guided request may move to any replica: each must compile guides.
    target.structured_output = all(info.structured_output for info in infos)
    pool = VerifierPool(verifiers, wait_s=rcfg.verifier_wait_s)
    tokenizer = load_tokenizer(rcfg.tokenizer or cfg.verifier.model)
    if rcfg.chat_template:  # vLLM's --chat-template: the tokenizer's own replaced
        tokenizer.chat_template = config_mod.chat_template_text(rcfg.chat_template)
    if tokenizer_fingerprint(tokenizer) != target.tokenizer_fingerprint:
        raise StartupError(
            f"the router's tokenizer ({rcfg.tokenizer or cfg.verifier.model}) differs from the target's "
            f"({target.path}); set router.tokenizer to the target's tokenizer"
        )
    served = await collect_drafters(cfg, services, target)
    drafter_router = build_drafter_router(cfg, sorted(served))
    controller = SpeculationController(CostModel.configured(rcfg.speculation), rcfg.speculation)
    verify_limits, draft_limits = call_limits(cfg, target, await drafter_contexts(cfg, services))
    if not rcfg.speculation.pin_cost_model:
        await profile_costs(pool.first, served, controller.cost, target.eos_token_id, target.max_context, verify_limits)
    depth = pipeline_depth(rcfg.scheduling.pipeline_depth, target, served)
    scheduler = Scheduler(SchedulerConfig(rcfg.scheduling, depth, verify_limits, draft_limits), pool, served, drafter_router, controller)
    limits = Limits(rcfg.requests, target.vocab_size, target.max_context, prompt_chars_bound(tokenizer, target.max_context), target.eos_token_id)
    front_door = FrontDoor(scheduler, tokenizer, limits, target.eos_token_id, target)
    return front_door, scheduler, [*verifiers, *(t for service in services.values() for t in service.replicas)]


def grpc_drafter_service(svc: config_mod.DrafterServiceConfig, sec: security.Security) -> DrafterService:
    # Replica 0 goes by the service's name (logs, metrics, breaker); replica N by name[N].
    names = [svc.name] + [f"{svc.name}[{i}]" for i in range(1, len(svc.addresses()))]
    return DrafterService(svc.name, [GrpcDrafter(name, address, sec) for name, address in zip(names, svc.addresses())])


def pipeline_depth(configured: int, target, drafters: dict[str, DrafterService], router=None) -> int:
    """router.pipeline_depth when set; when 0 (the default), 2 lanes if some drafter can compute while
    the verifier verifies, else 1: on shared cores a second lane only queues its verify calls behind
    the first's. router: where this router runs (placement.here())."""
    if configured:
        return configured
    router = router if router is not None else placement.here()
    placements = [s.placement for s in {service.name: service for service in drafters.values()}.values() if s.placement is not None]
    if placements and not any(placement.can_overlap(target, p, router) for p in placements):
        log.info(
            "pipelining off (one lane): no drafter can compute beside the verifier"
            " (cores %s for the verifier's %d threads, a drafter's %d and the router's)",
            sorted(set(target.cpus) | set(router.cpus)),
            target.threads,
            placements[0].threads,
        )
        return 1
    return 2


async def collect_drafters(cfg: config_mod.Config, services: dict[str, DrafterService], target) -> dict[str, DrafterService]:
    """Draft model name -> its service, refusing models with another tokenizer and replicas that differ."""
    drafters = {}
    for svc_cfg in cfg.drafters:
        service = services[svc_cfg.name]
        infos = await asyncio.gather(*(replica.info(timeout_s=30) for replica in service.replicas))
        info = infos[0]
        for replica, other in zip(service.replicas[1:], infos[1:]):
            mine = sorted((m.name, m.tokenizer_fingerprint, m.parameters) for m in info.models)
            theirs = sorted((m.name, m.tokenizer_fingerprint, m.parameters) for m in other.models)
            if mine != theirs:
                raise StartupError(
                    f"drafter service {svc_cfg.name}: replica {replica.address} hosts {[m[0] for m in theirs]}, "
                    f"{service.replicas[0].address} hosts {[m[0] for m in mine]}; every replica must host the same draft models"
                )
        service.placement = info.models[0] if info.models else None
        for model in info.models:
            if model.tokenizer_fingerprint != target.tokenizer_fingerprint:
                raise StartupError(
                    f"draft model {model.name!r} ({model.path}) on drafter service {svc_cfg.name!r} uses a different "
                    f"tokenizer (vocabulary {model.vocab_size}, fingerprint {model.tokenizer_fingerprint}) from the "
                    f"target {target.path} (vocabulary {target.vocab_size}, fingerprint {target.tokenizer_fingerprint}). "
                    "A drafter's token ids must mean what the target's mean: use a draft model trained with the target's tokenizer."
                )
            drafters[model.name] = service
            log.info("draft model %s on %s (%s): %.1fM parameters", model.name, svc_cfg.name, service.address, model.parameters / 1e6)
    default = cfg.router.routing.default_drafter
    if default and default not in drafters:
        raise StartupError(f"router.default_drafter {default!r} is not served by any drafter service ({sorted(drafters)})")
    if not drafters:
        log.warning("no drafters configured: every request decodes with the target alone")
    return drafters


async def drafter_contexts(cfg: config_mod.Config, services: dict) -> dict[str, int]:
    """Drafter service name -> the longest context of its draft models."""
    contexts = {}
    for svc in cfg.drafters:
        info = await services[svc.name].replicas[0].info(timeout_s=30)
        contexts[svc.name] = max((m.max_context for m in info.models), default=0)
    return contexts


def call_limits(cfg: config_mod.Config, target, drafter_contexts: dict[str, int]) -> tuple[limits.CallLimits, dict[str, limits.CallLimits]]:
    """The per-call limits of the verifier and each drafter service, which the scheduler's calls keep to.

    The scheduler splits a round's calls to fit, down to one session per Verify call and one
    lockstep group (router.fusion_width sessions) per Draft call: a service whose limits refuse
    even that would refuse requests, so the router does not start."""
    v = cfg.verifier
    if v.max_call_tokens and v.max_call_tokens < target.max_context:
        raise StartupError(
            f"verifier.max_call_tokens ({v.max_call_tokens}) is below the target's context ({target.max_context} tokens): "
            "a long request would be refused; raise it (or 0: sized to the context)"
        )
    verify = limits.CallLimits(v.max_call_sessions, limits.call_tokens(v.max_call_tokens, target.max_context), "verifier")
    width = cfg.router.routing.fusion_width
    draft = {}
    for svc in cfg.drafters:
        where = f"drafters[{svc.name}]"
        # A session drafts no further than the target's context (an n-gram drafter has no limit of its own).
        context = min(drafter_contexts[svc.name], target.max_context)
        if svc.max_call_sessions < width or (svc.max_call_tokens and svc.max_call_tokens < width * context):
            raise StartupError(
                f"{where}.max_call_sessions ({svc.max_call_sessions}) and max_call_tokens ({svc.max_call_tokens}) must hold "
                f"router.fusion_width ({width}) sessions of its models' full context ({context} tokens) in one call; raise them"
            )
        draft[svc.name] = limits.CallLimits(svc.max_call_sessions, limits.call_tokens(svc.max_call_tokens, width * context), where)
    return verify, draft


async def reload(front_door: FrontDoor, scheduler: Scheduler, config_path: str, over_grpc: bool) -> None:
    """Apply a changed config file without a restart (SIGHUP).

    Drafter services (gRPC only; Ray actors are placed by `serve --ray`), routing,
    speculation and request limits change; what the router learned is kept. The
    verifier and the tokenizer stay: changing the target needs a restart.
    """
    cfg = config_mod.load(config_path)
    rcfg = cfg.router
    drafters = scheduler.context.drafters
    if over_grpc:
        sec = security.load(cfg.security)
        existing = {service.name: service for service in scheduler.context.drafters.values()}
        services = {}
        for svc in cfg.drafters:
            old = existing.get(svc.name)
            # A service in this process (specfleet.colocated) stays: its core is the one at its address.
            same = old is not None and [r.address for r in old.replicas] == svc.addresses()
            services[svc.name] = old if same else grpc_drafter_service(svc, sec)
            for address in svc.addresses():
                await wait_until_serving(address, 30.0, security=sec)
        drafters = await collect_drafters(cfg, services, front_door.target)
    new_router = build_drafter_router(cfg, sorted(drafters))
    new_router.store = scheduler.context.router.store
    shared = scheduler.context
    draft_limits = call_limits(cfg, front_door.target, await drafter_contexts(cfg, services))[1] if over_grpc else shared.config.draft_limits
    # Each component takes its new section whole, never edited field by field: whoever reads one
    # sees the old settings or the new, not a mix. The lanes (pipeline_depth) and the verifier stay.
    shared.config = dataclasses.replace(shared.config, settings=rcfg.scheduling, draft_limits=draft_limits)
    shared.drafters, shared.router = drafters, new_router
    shared.controller = dataclasses.replace(shared.controller, settings=rcfg.speculation)  # the learned costs and measurements stay
    front_door.limits = dataclasses.replace(front_door.limits, requests=rcfg.requests)
    log.info("reloaded %s: drafters %s, routing policy %s", config_path, sorted(drafters), rcfg.routing.routing_policy)


def build_drafter_router(cfg: config_mod.Config, served: list[str]) -> DrafterRouter:
    """The routing policy, prior and learned-state store the config asks for."""
    routing = cfg.router.routing
    profiles, exemplars = [], {}
    for svc in cfg.drafters:
        for model in svc.models:
            if model.name not in served:
                continue
            profiles.append(DrafterProfile(model.name, list(model.specialities), model_free=model.kind == "ngram"))
            for label in model.specialities:
                exemplars.setdefault(label, []).extend(config_mod.exemplars_of(model))
    url = routing.redis_url
    store = RedisExpertiseStore(url, routing.expertise_decay) if url else ExpertiseStore(routing.expertise_decay)
    log.info(
        "routing: policy %s, domain prior %s, fusion width %d, domains %s, state in %s",
        routing.routing_policy,
        routing.domain_prior,
        routing.fusion_width,
        sorted(exemplars) or "-",
        "redis " + redacted(url) if url else "memory",
    )
    return DrafterRouter(routing, profiles, DomainClassifier(exemplars), store)


async def run(
    cfg: config_mod.Config,
    host: str,
    port: int,
    ray_address: str | None = None,
    ray_namespace: str = "specfleet",
    config_path: str | None = None,
    api_key: str = "",
    verifiers: list | None = None,
    drafters: dict | None = None,
) -> None:
    """Serve; with ray_address, reach the verifier and drafters as Ray actors (`specfleet serve --ray`) instead of gRPC;
    verifiers, drafters: those not reached over gRPC (cores in this process: `specfleet.colocated`), as `build` takes them.

    api_key: when set, the gRPC Generation methods and the HTTP API's /v1/* need `authorization: Bearer api_key`.
    """
    sec = security.load(cfg.security)
    sec.check_binding("router", host, internal=False, api_key=api_key)
    if ray_address is not None:
        from router import ray_transport

        verifiers, drafters = await ray_transport.connect(cfg, ray_address, ray_namespace, cfg.router.startup_timeout_s)
    front_door, scheduler, transports = await build(cfg, verifiers, drafters)
    scheduler.start()
    metrics_server = exposed = None
    metrics_sock = listen(host, cfg.router.metrics_port, config_mod.DEFAULT_METRICS_PORTS["router"], "router metrics", "router.metrics_port")
    if metrics_sock is not None:
        scheduler.context.telemetry = RouterTelemetry(scheduler)
        labels = {"model_name": config_mod.served_model_name(cfg)}  # as vLLM's metrics, and the name /v1/models serves
        exposed = metrics.Labelled(scheduler.context.telemetry.registry, labels)
        metrics_server = await metrics.serve(metrics_sock, exposed, **sec.metrics_options())
    http = await start_http(cfg, host, front_door, api_key, sec, exposed)

    on_reload = (lambda: reload(front_door, scheduler, config_path, over_grpc=drafters is None)) if config_path else None

    def register(server):
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(front_door), server)
        return [generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name]

    try:
        await serve(
            "router",
            host,
            port,
            register,
            grace_s=ROUTER_DRAIN_S,
            on_reload=on_reload,
            on_drain=front_door.drain,
            healthy=lambda: bool(scheduler.verifiers.live()),
            max_request_bytes=cfg.router.max_request_bytes,
            credentials=sec.server_credentials(public=True),
            interceptors=sec.server_interceptors(public=True, api_key=api_key),
        )
    finally:
        if http is not None:
            from router import http_gate

            await http_gate.stop(*http[1:])
        if metrics_server is not None:
            metrics_server.close()
        await scheduler.stop()
        for transport in transports:
            await transport.close()


async def start_http(cfg: config_mod.Config, host: str, front_door: FrontDoor, api_key: str, sec: security.Security, exposed=None):
    """The OpenAI-compatible API on router.http_port (HTTPS when security.tls is set), as (app, server, task),
    or None when it is off; `exposed`: what the router's metrics port serves, served at /metrics too (with its token)."""
    if cfg.router.http_port == 0:
        return None
    try:
        # The HTTP API's packages are optional: a router that does not serve it starts without them.
        from router import http_gate, openai_api
    except ImportError as err:
        if cfg.router.http_port is None:
            log.warning("HTTP API off: it needs %s (pip install fastapi uvicorn pydantic); router.http_port: 0 turns it off", err.name)
            report("HTTP API", None, f"it needs {err.name} (pip install fastapi uvicorn pydantic)")
            return None
        raise StartupError(
            f"router.http_port: the HTTP API needs {err.name}, which is not installed (pip install fastapi uvicorn pydantic), "
            "or set router.http_port to 0"
        ) from None
    sock = listen(host, cfg.router.http_port, config_mod.DEFAULT_HTTP_PORT, "HTTP API", "router.http_port")
    if sock is None:
        return None
    model_name = config_mod.served_model_name(cfg)
    app = openai_api.create_app(front_door, model_name, cfg.router, api_key, exposed, sec.metrics_token)
    started = await http_gate.start(app, sock, **sec.uvicorn_tls())
    address = sock.getsockname()
    log.info(
        "OpenAI-compatible API on %s://%s:%d/v1 (model %r)%s",
        "https" if sec.tls else "http",
        address[0],
        address[1],
        model_name,
        ", API key required" if api_key else "",
    )
    return (app, *started)


def parser(prog: str = "specfleet router") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Serve specfleet.v1.Generation.")
    parser.add_argument("--config", help="deployment YAML (default: bundled demo models)")
    parser.add_argument("--host", help="listen address (default: router.host)")
    parser.add_argument("--port", type=int, help="port (default: router.port)")
    parser.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="reach the verifier and drafters as Ray actors in the cluster at ADDRESS (`auto`: this node's; ray://HOST:10001: through Ray Client)",
    )
    parser.add_argument("--ray-namespace", default="specfleet", help="Ray namespace of the actors (default: specfleet)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SPECFLEET_API_KEY", ""),
        help="require `authorization: Bearer KEY` on the gRPC API and the HTTP API's /v1/* (default: $SPECFLEET_API_KEY; unset: no key)",
    )
    return parser


# What stops a router from starting, reported in one line (exit code 2).
STARTUP_ERRORS = (StartupError, TimeoutError, OSError, config_mod.ConfigError, RedisAuthError)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    setup_logging("router")
    cfg = config_mod.load(args.config) if args.config else config_mod.default_config(config_mod.REPO / ".cache")
    try:
        serving.run(
            run(
                cfg,
                args.host or cfg.router.host,
                args.port if args.port is not None else cfg.router.port,
                args.ray,
                args.ray_namespace,
                config_path=args.config,
                api_key=args.api_key,
            )
        )
    except STARTUP_ERRORS as err:
        log.error("router cannot start: %s", err)
        return 2
    return 0
