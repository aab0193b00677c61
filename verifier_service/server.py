"""The verifier's gRPC service: specfleet.v1.Verifier over `Verifier.verify_batch`, with dynamic batching."""

from __future__ import annotations

import argparse
import asyncio
import logging

import grpc

from specfleet import config as config_mod
from specfleet import limits as limits_mod
from specfleet import metrics, placement, security
from specfleet.metrics import PassTelemetry
from specfleet.ports import listen
from specfleet.engine import SessionStore, configure_torch, load_model
from specfleet.sampling import SamplingParams
from specfleet.serving import BatchQueue, serve, setup_logging
from specfleet.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_service.verifier import Verifier, VerifyItem, validate_item

log = logging.getLogger(__name__)


class InvalidArgument(ValueError):
    """A request the verifier refuses: INVALID_ARGUMENT over gRPC, raised as is to a Ray caller."""


class VerifierCore:
    """The verifier service's logic in proto messages, shared by the gRPC servicer and the Ray actor."""

    def __init__(self, verifier: Verifier, batcher: BatchQueue, telemetry: PassTelemetry, limits: limits_mod.CallLimits | None = None):
        self.verifier = verifier
        self.batcher = batcher
        self.telemetry = telemetry
        self.limits = limits or limits_mod.CallLimits()

    def items(self, request: verifier_pb2.VerifyRequest) -> list[VerifyItem]:
        """Validate a request and convert it; raises InvalidArgument naming the problem, or CallTooLarge
        for a call over this verifier's per-call limits (checked here, before any forward pass)."""
        # Counted on the message, before anything is converted: a huge call costs no more than its parse.
        limits_mod.check_sessions(len(request.sessions), self.limits)
        limits_mod.check_tokens(sum(limits_mod.verify_tokens(s) for s in request.sessions), self.limits)
        loaded = self.verifier.loaded
        items = []
        seen = set()
        for s in request.sessions:
            item = VerifyItem(
                session_id=s.sync.session_id,
                prefix_length=s.sync.prefix_length,
                new_token_ids=list(s.sync.new_token_ids),
                sampling=SamplingParams.from_proto(s.sampling),
                tree_tokens=list(s.tree.token_ids),
                tree_parents=list(s.tree.parents),
                proposals=[(list(p.token_ids), list(p.probs)) for p in s.tree.proposals],
                logprobs=s.logprobs,
                top_logprobs=s.top_logprobs,
            )
            try:
                if not item.session_id:
                    raise ValueError("sync.session_id is required")
                if item.session_id in seen:
                    raise ValueError(f"session {item.session_id} appears twice in one call")
                validate_item(item, loaded.vocab_size, loaded.max_context)
            except ValueError as err:
                raise InvalidArgument(str(err)) from None
            seen.add(item.session_id)
            items.append(item)
        return items

    async def verify(self, request: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
        items = self.items(request)
        if not items:
            return verifier_pb2.VerifyResponse()
        results, stats = await self.batcher.submit(items)
        return verifier_pb2.VerifyResponse(
            sessions=[
                verifier_pb2.VerifiedSession(
                    session_id=r.session_id,
                    status=common_pb2.SESSION_OK if r.known else common_pb2.SESSION_UNKNOWN,
                    accepted_nodes=r.accepted_nodes,
                    token_ids=r.token_ids,
                    logprobs=r.logprobs,
                    top_token_ids=r.top_token_ids,
                    top_logprobs=r.top_logprobs,
                )
                for r in results
            ],
            compute_ms=stats.compute_ms,
            batch_size=stats.batch_size,
        )

    async def release(self, request: common_pb2.ReleaseRequest) -> common_pb2.ReleaseResponse:
        store = self.verifier.store
        released = await asyncio.to_thread(store.release, list(request.session_ids), request.keep_tokens)
        return common_pb2.ReleaseResponse(released=released)

    def info(self) -> common_pb2.ModelInfo:
        info = self.verifier.loaded.info()
        placement.describe(info)
        return info

    async def stats(self) -> verifier_pb2.VerifierServiceStats:
        store = self.verifier.store

        def held() -> list[str]:
            with store.lock:  # held by the model thread for a whole batch: read between batches
                return sorted(store._sessions)

        return verifier_pb2.VerifierServiceStats(session_ids=await asyncio.to_thread(held))

    def close(self) -> None:
        self.batcher.close()


def load_core(vcfg: config_mod.VerifierConfig, model: str | None = None, threads: int | None = None) -> VerifierCore:
    """Load the target model and build the verifier with its batch queue, as the config says."""
    configure_torch(threads or vcfg.threads)
    device = config_mod.resolve_device(vcfg.device, "verifier.device")
    loaded = load_model("target", model or vcfg.model, dtype=vcfg.dtype, device=device, attention=vcfg.attention,
                        cuda_graph_sizes=vcfg.cuda_graph_sizes)
    store = SessionStore(max_cache_bytes=int(vcfg.max_cache_mb * 2**20), max_sessions=vcfg.max_sessions)
    loaded.prepare(store.max_cache_bytes, store.max_sessions)
    verifier = Verifier(loaded, store)
    telemetry = PassTelemetry("verifier", lambda: [store])
    batcher = BatchQueue("verifier", telemetry.timed(verifier.verify_batch), vcfg.max_batch_size, vcfg.max_wait_ms / 1e3)
    return VerifierCore(verifier, batcher, telemetry, limits_mod.CallLimits(vcfg.max_call_sessions, vcfg.max_call_tokens, "verifier"))


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, core: VerifierCore):
        self.core = core

    async def Verify(self, request: verifier_pb2.VerifyRequest, context: grpc.aio.ServicerContext):
        try:
            return await self.core.verify(request)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specfleet verifier", description="Serve the target model for batched verification.")
    parser.add_argument("--config", help="deployment YAML (default: bundled demo models)")
    parser.add_argument("--model", help="target model directory (overrides the config)")
    parser.add_argument("--host", default="127.0.0.1", help="listen address (default: loopback; 0.0.0.0 needs security.token_file or mutual TLS)")
    parser.add_argument("--port", type=int, help="port (default: the port of verifier.address, or of the replica's address with --replica)")
    parser.add_argument("--replica", type=int, default=0, help="serve as replica N: 0 is verifier.address, N the Nth of verifier.replicas")
    parser.add_argument("--threads", type=int, help="torch threads (default: verifier.threads)")
    args = parser.parse_args(argv)
    setup_logging("verifier")
    cfg = config_mod.load(args.config) if args.config else config_mod.default_config(config_mod.REPO / ".cache")
    vcfg = cfg.verifier
    try:
        sec = security.load(cfg.security)
        sec.check_binding("verifier", args.host, internal=True)
        core = load_core(vcfg, model=args.model, threads=args.threads)
    except (config_mod.ConfigError, security.InsecureBinding) as err:
        raise SystemExit(f"specfleet verifier: {err}") from None
    servicer = VerifierServicer(core)

    def register(server):
        verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
        return [verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name]

    try:
        replica_port, metrics_port = config_mod.replica_ports(vcfg, args.replica, "verifier --replica")
    except config_mod.ConfigError as err:
        raise SystemExit(f"specfleet verifier: {err}") from None
    port = args.port if args.port is not None else replica_port
    metrics_sock = listen(args.host, metrics_port, config_mod.DEFAULT_METRICS_PORTS["verifier"], "verifier metrics", "verifier.metrics_port")

    async def run():
        async with metrics.exported(metrics_sock, core.telemetry.registry, **sec.metrics_options()):
            await serve(
                "verifier", args.host, port, register, on_stop=core.close,
                credentials=sec.server_credentials(), interceptors=sec.server_interceptors(),
            )

    asyncio.run(run())
    return 0
