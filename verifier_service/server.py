"""The verifier's gRPC service: specfleet.v1.Verifier over `Verifier.verify_batch`, with dynamic batching.

`VerifierCore` (the requests in proto messages), its servicer and `SPEC`, what `specfleet.service_shell`
runs as `specfleet verifier` and as the Ray actor (`verifier_service.actor`)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from specfleet import config as config_mod
from specfleet import limits as limits_mod
from specfleet import placement, service_shell
from specfleet.metrics import PassTelemetry
from specfleet.engine import SessionStore, configure_torch, load_model, ray_ranks
from specfleet.sampling import SamplingParams
from specfleet.guides import GuideError
from specfleet.service_shell import CoreServicer, InvalidArgument, Section, ServiceSpec
from specfleet.batching import BatchQueue, BatchStats, housekeeping_every
from specfleet.v1 import common_pb2, verifier_pb2, verifier_pb2_grpc
from verifier_service.validation import validate_item
from verifier_service.verifier import Verifier, VerifyItem, VerifyResult, passes

log = logging.getLogger(__name__)


def session_item(s, sampling: SamplingParams) -> VerifyItem:
    """A VerifySession as the verifier's item: the contract's message or the router's record, whose fields have the
    same names (router/messages.py); sampling: its parameters, already read."""
    return VerifyItem(
        session_id=s.sync.session_id,
        prefix_length=s.sync.prefix_length,
        new_token_ids=list(s.sync.new_token_ids),
        sampling=sampling,
        tree_tokens=list(s.tree.token_ids),
        tree_parents=list(s.tree.parents),
        proposals=[(list(p.token_ids), list(p.probs)) for p in s.tree.proposals],
        logprobs=s.logprobs,
        top_logprobs=s.top_logprobs,
        prompt_logprobs=s.prompt_top_logprobs if s.prompt_logprobs else None,
        plain_steps=s.plain_steps or 1,
        lookup_tokens=s.lookup_tokens,
        max_tokens=s.max_tokens,
        cache_salt=s.sync.cache_salt,
    )


def prompt_message(prompt) -> verifier_pb2.PromptLogprobs | None:
    """A result's prompt log-probabilities (`specfleet.engine.prompt_logprobs.PromptLogprobs`) as the contract's message."""
    if prompt is None:
        return None
    return verifier_pb2.PromptLogprobs(
        logprobs=prompt.logprobs, ranks=prompt.ranks, top_token_ids=prompt.top_token_ids, top_logprobs=prompt.top_logprobs
    )


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
        self.check_size(len(request.sessions), sum(limits_mod.verify_tokens(s) for s in request.sessions))
        return self.validated([session_item(s, SamplingParams.from_proto(s.sampling)) for s in request.sessions])

    def check_size(self, sessions: int, tokens: int) -> None:
        """Raise CallTooLarge for a call over this verifier's per-call limits."""
        limits_mod.check_sessions(sessions, self.limits)
        limits_mod.check_tokens(tokens, self.limits)

    def validated(self, items: list[VerifyItem]) -> list[VerifyItem]:
        """The items, each checked against the model (ids in its vocabulary, context within its positions, a
        tree whose parents precede their children); raises InvalidArgument naming the first problem."""
        loaded = self.verifier.loaded
        seen = set()
        for item in items:
            try:
                if not item.session_id:
                    raise ValueError("sync.session_id is required")
                if item.session_id in seen:
                    raise ValueError(f"session {item.session_id} appears twice in one call")
                validate_item(item, loaded.vocab_size, loaded.max_context)
                if item.sampling.guide is not None:
                    try:
                        loaded.guides.compile(item.sampling.guide)
                    except GuideError as err:
                        raise ValueError(f"session {item.session_id}: {err}") from None
            except ValueError as err:
                raise InvalidArgument(str(err)) from None
            seen.add(item.session_id)
        return items

    async def verify_items(self, items: list[VerifyItem]) -> tuple[list[VerifyResult], BatchStats | None]:
        """Validated items (`items`, `validated`) through the batch queue, merged with other calls' into passes."""
        if not items:
            return [], None
        return await self.batcher.submit(items)

    async def verify(self, request: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
        results, stats = await self.verify_items(self.items(request))
        if stats is None:
            return verifier_pb2.VerifyResponse()
        return verifier_pb2.VerifyResponse(
            sessions=[
                verifier_pb2.VerifiedSession(
                    session_id=r.session_id,
                    status=common_pb2.SESSION_PREFILLING if r.prefilling else common_pb2.SESSION_OK if r.known else common_pb2.SESSION_UNKNOWN,
                    accepted_nodes=r.accepted_nodes,
                    token_ids=r.token_ids,
                    logprobs=r.logprobs,
                    top_token_ids=r.top_token_ids,
                    top_logprobs=r.top_logprobs,
                    lookup_proposed=r.lookup_proposed,
                    lookup_accepted=r.lookup_accepted,
                    prompt_logprobs=prompt_message(r.prompt),
                    cached_tokens=r.cached_tokens,
                )
                for r in results
            ],
            compute_ms=stats.compute_ms,
            batch_size=stats.batch_size,
            queue_ms=stats.queue_ms,
            passes=stats.passes,
            shared_ms=stats.shared_ms,
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
        self.batcher.join(10.0)  # its pass done before the model's other ranks stop
        self.verifier.loaded.close()

    def loaded_models(self) -> list:
        """The models it runs (`LoadedModel`): the target."""
        return [self.verifier.loaded]


def load_core(vcfg: config_mod.VerifierConfig, model: str | None = None, threads: int | None = None) -> VerifierCore:
    """Load the target model and build the verifier with its batch queue, as the config says."""
    configure_torch(threads or vcfg.threads)
    device = config_mod.resolve_device(vcfg.device, "verifier.device")
    loaded = load_model(
        "target",
        model or vcfg.model,
        device=device,
        cuda_graph_sizes=vcfg.cuda_graph_sizes,
        start_ranks=ray_ranks.starter(),  # a split target's ranks: Ray actors where this verifier is one
        **vcfg.model_options(),
    )
    store = SessionStore(max_cache_bytes=int(vcfg.max_cache_mb * 2**20), max_sessions=vcfg.max_sessions, idle_s=vcfg.session_idle_s)
    loaded.prepare(store.max_cache_bytes, store.max_sessions)
    loaded.pool.add_budget(store.max_cache_bytes)
    verifier = Verifier(loaded, store, vcfg.max_prefill_tokens)
    telemetry = PassTelemetry("verifier", lambda: [store], pools=lambda: [loaded.pool])
    batcher = BatchQueue(
        "verifier",
        telemetry.timed(verifier.verify_batch),
        vcfg.max_batch_size,
        vcfg.max_wait_ms / 1e3,
        housekeeping=store.expire_idle,
        housekeeping_every_s=housekeeping_every(vcfg.session_idle_s),
        passes=passes,
    )
    verifier.waiting, verifier.join_running, verifier.answer = batcher.waiting, batcher.join_running, batcher.answer
    verifier.max_batch_items = vcfg.max_batch_size
    return VerifierCore(
        verifier,
        batcher,
        telemetry,
        limits_mod.CallLimits(vcfg.max_call_sessions, limits_mod.call_tokens(vcfg.max_call_tokens, loaded.max_context), "verifier"),
    )


class VerifierServicer(CoreServicer, verifier_pb2_grpc.VerifierServicer):
    """specfleet.v1.Verifier over a `VerifierCore`: the shell's RPCs, and Verify."""

    async def Verify(self, request: verifier_pb2.VerifyRequest, context: grpc.aio.ServicerContext):
        return await self.answer(self.core.verify(request), context)


def _section(cfg: config_mod.Config, name: str | None) -> Section:
    return Section(cfg.verifier, "verifier", "verifier", config_mod.DEFAULT_METRICS_PORTS["verifier"])


SPEC = ServiceSpec(
    command="verifier",
    description="Serve the target model for batched verification.",
    config_key="verifier",
    select=_section,
    load_core=load_core,
    servicer=VerifierServicer,
    add_servicer=verifier_pb2_grpc.add_VerifierServicer_to_server,
    descriptor=verifier_pb2.DESCRIPTOR.services_by_name["Verifier"],
    flags=(("--model", "target model directory (overrides the config)"),),
)


def main(argv: list[str] | None = None) -> int:
    return service_shell.main(SPEC, argv)
