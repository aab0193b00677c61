"""The router with the verifier in its process: what `specfleet serve` starts where `verifier.colocate` is
true (the default) and it starts one verifier (`python -m specfleet.colocated`, the router's flags).

One process, two gRPC servers: the verifier's on its address, which other routers, tools and health checks
reach as ever, and the router's. The router's rounds call the verifier's core directly
(`router.transport.InProcessVerifier` over `RecordVerifier`): the same validation and batch queue, without
the two process hops of a Verify call over a socket, and in records, without protobuf. It stops as two processes would: the router drains first
(its rounds need the verifier), then the verifier's server. A crash takes both, and `specfleet serve`
restarts both.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from router import messages
from router import server as router_server
from router.transport import InProcessVerifier
from specfleet import config as config_mod
from specfleet import limits, security, service_shell
from specfleet.serving import setup_logging, wait_until_serving
from specfleet.v1 import common_pb2
from verifier_service import server as verifier_server
from verifier_service.verifier import VerifyItem

log = logging.getLogger(__name__)


class RecordVerifier:
    """The verifier's core (`verifier_service.server.VerifierCore`) in the router's records: the router's
    sessions become the verifier's items, and its results the router's, field by field, with the checks and
    the batch queue a Verify call over gRPC meets. This launcher imports both services; they import neither
    each other nor this."""

    def __init__(self, core: verifier_server.VerifierCore):
        self.core = core

    async def verify(self, sessions: list[messages.VerifySession]) -> messages.VerifyResponse:
        self.core.check_size(len(sessions), sum(limits.verify_tokens(s) for s in sessions))
        items = [
            VerifyItem(
                session_id=s.sync.session_id,
                prefix_length=s.sync.prefix_length,
                new_token_ids=list(s.sync.new_token_ids),
                sampling=s.sampling,
                tree_tokens=list(s.tree.token_ids),
                tree_parents=list(s.tree.parents),
                proposals=[(list(p.token_ids), list(p.probs)) for p in s.tree.proposals],
                logprobs=s.logprobs,
                top_logprobs=s.top_logprobs,
            )
            for s in sessions
        ]
        results, stats = await self.core.verify_items(self.core.validated(items))
        if stats is None:
            return messages.VerifyResponse(sessions=[], compute_ms=0.0, batch_size=0)
        verified = [
            messages.VerifiedSession(
                known=r.known,
                accepted_nodes=r.accepted_nodes,
                token_ids=r.token_ids,
                logprobs=r.logprobs,
                top_token_ids=r.top_token_ids,
                top_logprobs=r.top_logprobs,
            )
            for r in results
        ]
        return messages.VerifyResponse(sessions=verified, compute_ms=stats.compute_ms, batch_size=stats.batch_size, queue_ms=stats.queue_ms)

    async def release(self, session_ids: list[str]) -> None:
        await self.core.release(common_pb2.ReleaseRequest(session_ids=session_ids))

    def info(self) -> common_pb2.ModelInfo:
        return self.core.info()


def main(argv: list[str] | None = None) -> int:
    args = router_server.parser("python -m specfleet.colocated").parse_args(argv)
    if args.ray:
        raise SystemExit("specfleet.colocated: the verifier runs in this process; --ray reaches actors (run `specfleet router --ray`)")
    setup_logging("router")
    verifier_args = service_shell.parser(verifier_server.SPEC).parse_args(["--config", args.config] if args.config else [])
    try:
        started = service_shell.start(verifier_server.SPEC, verifier_args)
    except (config_mod.ConfigError, security.InsecureBinding, OSError, *verifier_server.SPEC.errors) as err:
        log.error("verifier cannot start: %s", err)
        return 1
    cfg = config_mod.load(args.config) if args.config else config_mod.default_config(config_mod.REPO / ".cache")
    try:
        asyncio.run(serve(cfg, args, verifier_args, started))
    except router_server.STARTUP_ERRORS as err:
        log.error("router cannot start: %s", err)
        return 2
    return 0


async def serve(cfg: config_mod.Config, args, verifier_args, started: service_shell.Started) -> None:
    """The verifier's server, then the router over its core, until the router stops; then the verifier's."""
    stop_verifier = asyncio.Event()
    verifier = asyncio.create_task(
        service_shell.serve_core(
            verifier_server.SPEC,
            started.section.name,
            started.core,
            verifier_args.host,
            started.port,
            started.sec,
            started.metrics_sock,
            stop=stop_verifier,
        )
    )
    address = f"{verifier_args.host}:{started.port}"
    listening = asyncio.create_task(wait_until_serving(address, cfg.router.startup_timeout_s, security=started.sec))
    await asyncio.wait({verifier, listening}, return_when=asyncio.FIRST_COMPLETED)
    if verifier.done():  # it could not start (its port taken, say): its error, not a wait that runs out
        listening.cancel()
        verifier.result()
        raise OSError(f"the verifier's server stopped before it served {address}")
    listening.result()
    try:
        await router_server.run(
            cfg,
            args.host or cfg.router.host,
            args.port if args.port is not None else cfg.router.port,
            config_path=args.config,
            api_key=args.api_key,
            verifiers=[InProcessVerifier(RecordVerifier(started.core), address)],
        )
    finally:
        stop_verifier.set()
        await verifier


if __name__ == "__main__":
    sys.exit(main())
