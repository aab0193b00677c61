"""The router with the verifier, and the drafter services that may join it, in its process: what `specfleet serve`
starts where `verifier.colocate` is true (the default) and it starts one verifier (`python -m
specfleet.colocated`, the router's flags).

One process, one gRPC server a service: the verifier's and each joining drafter service's on its address, which
other routers, tools and health checks reach as ever, and the router's. The router's rounds call those services'
cores directly (`router.transport.InProcessVerifier` over `RecordVerifier`, `InProcessDrafter` over
`RecordDrafter`): the same validation and batch queues, without the two process hops of a call over a socket,
and in records, without protobuf. A drafter service joins where `drafters[].colocate` is true and it has no
replicas (`cli.colocated_drafters`). It stops as separate processes would: the router drains first (its rounds
need the others), then the services' servers. A crash takes them all, and `specfleet serve` restarts them.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from drafter_service import server as drafter_server
from router import messages
from router import server as router_server
from router.transport import InProcessDrafter, InProcessVerifier
from specfleet import cli, limits, security, service_shell
from specfleet import config as config_mod
from specfleet.serving import run, setup_logging, wait_until_serving
from specfleet.v1 import common_pb2
from verifier_service import server as verifier_server

log = logging.getLogger(__name__)


class _RecordCore:
    """A service's core as the router's in-process transports call it (`router.transport.InProcessVerifier`,
    `InProcessDrafter`): `call` in records, and the shell's release and info."""

    def __init__(self, core):
        self.core = core

    async def release(self, session_ids: list[str]) -> None:
        await self.core.release(common_pb2.ReleaseRequest(session_ids=session_ids))

    def info(self):
        return self.core.info()


def _prompt_logprobs(prompt) -> messages.PromptLogprobs:
    """The verifier's record of a context's log-probabilities (`specfleet.engine.prompt_logprobs`) as the router's."""
    return messages.PromptLogprobs(prompt.logprobs, prompt.ranks, prompt.top_token_ids, prompt.top_logprobs)


class RecordVerifier(_RecordCore):
    """The verifier's core (`verifier_service.server.VerifierCore`) in the router's records: the router's
    sessions become the verifier's items, and its results the router's, field by field, with the checks and
    the batch queue a Verify call over gRPC meets. This launcher imports both services; they import neither
    each other nor this."""

    async def call(self, sessions: list[messages.VerifySession]) -> messages.VerifyResponse:
        self.core.check_size(len(sessions), sum(limits.verify_tokens(s) for s in sessions))
        items = [verifier_server.session_item(s, s.sampling) for s in sessions]
        results, stats = await self.core.verify_items(self.core.validated(items))
        if stats is None:
            return messages.VerifyResponse(sessions=[], compute_ms=0.0, batch_size=0)
        verified = [
            messages.VerifiedSession(
                known=r.known,
                prefilling=r.prefilling,
                accepted_nodes=r.accepted_nodes,
                token_ids=r.token_ids,
                logprobs=r.logprobs,
                top_token_ids=r.top_token_ids,
                top_logprobs=r.top_logprobs,
                lookup_proposed=r.lookup_proposed,
                lookup_accepted=r.lookup_accepted,
                prompt_logprobs=None if r.prompt is None else _prompt_logprobs(r.prompt),
                cached_tokens=r.cached_tokens,
            )
            for r in results
        ]
        return messages.VerifyResponse(
            sessions=verified,
            compute_ms=stats.compute_ms,
            batch_size=stats.batch_size,
            queue_ms=stats.queue_ms,
            passes=stats.passes,
            shared_ms=stats.shared_ms,
        )


class RecordDrafter(_RecordCore):
    """A drafter service's core (`drafter_service.server.DrafterCore`) in the router's records, as `RecordVerifier`
    is the verifier's. Proposals go back in the transport's form (router/messages.py): the verifier, in this
    process or over gRPC, takes them as a drafter's reply carries them."""

    async def call(self, sessions: list[messages.DraftSession]) -> messages.DraftResponse:
        self.core.check_size(len(sessions), sum(limits.draft_tokens(s) for s in sessions))
        items = [drafter_server.session_item(s, s.sampling) for s in sessions]
        results, stats = await self.core.draft_items(self.core.validated(items))
        if stats is None:
            return messages.DraftResponse(sessions=[], compute_ms=0.0)
        drafted = [
            messages.DraftedSession(
                known=r.known,
                prefilling=r.prefilling,
                token_ids=r.token_ids,
                proposals=[common_pb2.SparseDistribution(token_ids=ids, probs=probs) for ids, probs in r.proposals],
                confidences=r.confidences,
                context_log_prob=r.context_log_prob,
                context_tokens=r.context_tokens,
            )
            for r in results
        ]
        return messages.DraftResponse(sessions=drafted, compute_ms=stats.compute_ms, queue_ms=stats.queue_ms)


def main(argv: list[str] | None = None) -> int:
    args = router_server.parser("python -m specfleet.colocated").parse_args(argv)
    if args.ray:
        raise SystemExit("specfleet.colocated: the verifier runs in this process; --ray reaches actors (run `specfleet router --ray`)")
    setup_logging("router")
    cfg = config_mod.load(args.config) if args.config else config_mod.default_config(config_mod.REPO / ".cache")
    config_flag = ["--config", args.config] if args.config else []
    services = [(verifier_server.SPEC, config_flag)]
    services += [(drafter_server.SPEC, [*config_flag, "--name", svc.name]) for svc in cli.colocated_drafters(cfg)]
    started = []
    for spec, flags in services:
        spec_args = service_shell.parser(spec).parse_args(flags)
        try:
            started.append((spec, spec_args, service_shell.start(spec, spec_args)))
        except (config_mod.ConfigError, security.InsecureBinding, OSError, *spec.errors) as err:
            log.error("%s cannot start: %s", spec.command, err)
            return 1
    try:
        run(serve(cfg, args, started))
    except router_server.STARTUP_ERRORS as err:
        log.error("router cannot start: %s", err)
        return 2
    return 0


async def serve(cfg: config_mod.Config, args, started: list[tuple]) -> None:
    """The services' servers (the verifier's first), then the router over their cores, until the router stops; then
    the services' servers. started: (spec, its parsed flags, `service_shell.Started`) a service."""
    stop_services = asyncio.Event()
    servers, cores = [], []
    for spec, spec_args, service in started:
        server = asyncio.create_task(
            service_shell.serve_core(
                spec, service.section.name, service.core, spec_args.host, service.port, service.sec, service.metrics_sock, stop=stop_services
            )
        )
        address = f"{spec_args.host}:{service.port}"
        listening = asyncio.create_task(wait_until_serving(address, cfg.router.startup_timeout_s, security=service.sec))
        await asyncio.wait({server, listening}, return_when=asyncio.FIRST_COMPLETED)
        if server.done():  # it could not start (its port taken, say): its error, not a wait that runs out
            listening.cancel()
            server.result()
            raise OSError(f"the {service.section.name} server stopped before it served {address}")
        listening.result()
        servers.append(server)
        cores.append((service, address))
    (verifier, verifier_address), joined = cores[0], cores[1:]
    drafters = {s.section.config.name: InProcessDrafter(s.section.config.name, RecordDrafter(s.core), address) for s, address in joined}
    try:
        await router_server.run(
            cfg,
            args.host or cfg.router.host,
            args.port if args.port is not None else cfg.router.port,
            config_path=args.config,
            api_key=args.api_key,
            verifiers=[InProcessVerifier(RecordVerifier(verifier.core), verifier_address)],
            drafters=drafters,
        )
    finally:
        stop_services.set()
        await asyncio.gather(*servers, return_exceptions=True)


if __name__ == "__main__":
    sys.exit(main())
