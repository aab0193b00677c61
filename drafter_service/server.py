"""The drafter's gRPC service: specfleet.v1.Drafter over one or more `DraftModel`s, with dynamic batching.

`DrafterCore` (the requests in proto messages), its servicer and `SPEC`, what `specfleet.service_shell`
runs as `specfleet drafter` and as the Ray actor (`drafter_service.actor`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc

from specfleet import config as config_mod
from specfleet import limits as limits_mod
from specfleet import placement, service_shell
from specfleet.metrics import PassTelemetry
from specfleet.engine import SessionStore, configure_torch, load_model, ray_ranks
from specfleet.sampling import SamplingParams
from specfleet.service_shell import CoreServicer, InvalidArgument, Section, ServiceSpec
from specfleet.batching import BatchQueue, BatchStats, housekeeping_every
from specfleet.v1 import common_pb2, drafter_pb2, drafter_pb2_grpc
from drafter_service.drafter import DraftItem, DraftModel, DraftResult, draft_batch, stack_draft_models
from drafter_service.ngram import NgramModel, load_source

log = logging.getLogger(__name__)


def session_item(s, sampling: SamplingParams) -> tuple[str, DraftItem]:
    """A DraftSession as (model name, the drafter's item): the contract's message or the router's record, whose fields
    have the same names (router/messages.py); sampling: its parameters, already read."""
    return s.model, DraftItem(
        s.sync.session_id,
        s.sync.prefix_length,
        list(s.sync.new_token_ids),
        s.num_draft_tokens,
        sampling,
        s.stop_below_confidence,
        s.score_context,
        s.lockstep_group,
        s.sync.cache_salt,
    )


# A call of model-free drafters only drafts on the calling thread up to this many draft positions (16 sessions of
# k = 4: a few milliseconds of lookups at contexts of thousands of tokens), so the event loop is never held long.
IN_PLACE_POSITIONS = 64


class IncompatibleModels(ValueError):
    """The draft models of one service cannot serve together (different tokenizers)."""


class DrafterCore:
    """The drafter service's logic in proto messages, shared by the gRPC servicer and the Ray actor."""

    def __init__(
        self, models: dict[str, DraftModel | NgramModel], batcher: BatchQueue, telemetry: PassTelemetry, limits: limits_mod.CallLimits | None = None
    ):
        self.models = models
        self.telemetry = telemetry
        self.batcher = batcher
        self.limits = limits or limits_mod.CallLimits()

    def items(self, request: drafter_pb2.DraftRequest) -> list[tuple[str, DraftItem]]:
        """Validate a request and convert it to (model name, item) pairs; raises InvalidArgument naming the problem,
        or CallTooLarge for a call over this service's per-call limits (checked here, before any forward pass)."""
        # Counted on the message, before anything is converted: a huge call costs no more than its parse.
        self.check_size(len(request.sessions), sum(limits_mod.draft_tokens(s) for s in request.sessions))
        return self.validated([session_item(s, SamplingParams.from_proto(s.sampling)) for s in request.sessions])

    def check_size(self, sessions: int, tokens: int) -> None:
        """Raise CallTooLarge for a call over this service's per-call limits."""
        limits_mod.check_sessions(sessions, self.limits)
        limits_mod.check_tokens(tokens, self.limits)

    def validated(self, items: list[tuple[str, DraftItem]]) -> list[tuple[str, DraftItem]]:
        """The (model name, item) pairs, each checked against its model; raises InvalidArgument naming the first problem."""
        seen = set()
        for model, item in items:
            problem = self._problem(model, item, seen)
            if problem:
                raise InvalidArgument(problem)
            seen.add((model, item.session_id))
        return items

    def _problem(self, model: str, item: DraftItem, seen: set) -> str | None:
        sid = item.session_id
        if not sid:
            return "sync.session_id is required"
        if model not in self.models:
            return f"session {sid}: unknown draft model {model!r}; this server hosts {sorted(self.models)}"
        if (model, sid) in seen:
            return f"session {sid} appears twice for model {model!r} in one call"
        if not 0 <= item.num_draft_tokens <= 64:
            return f"session {sid}: num_draft_tokens must be in [0, 64], got {item.num_draft_tokens}"
        if item.prefix_length < 0 or (item.prefix_length == 0 and not item.new_token_ids):
            return f"session {sid}: a new session needs at least one token (sync.prefix_length = 0)"
        loaded = self.models[model].loaded
        if any(not 0 <= t < loaded.vocab_size for t in item.new_token_ids):
            return f"session {sid}: sync.new_token_ids has ids outside the vocabulary [0, {loaded.vocab_size})"
        if item.prefix_length + len(item.new_token_ids) + item.num_draft_tokens > loaded.max_context:
            return f"session {sid}: context plus drafts exceeds the draft model's {loaded.max_context} positions"
        if item.sampling.problem(loaded.vocab_size):
            return f"session {sid}: {item.sampling.problem(loaded.vocab_size)}"
        if not 0 <= item.stop_below_confidence <= 1:
            return f"session {sid}: stop_below_confidence must be in [0, 1], got {item.stop_below_confidence}"
        return None

    async def draft_items(self, items: list[tuple[str, DraftItem]]) -> tuple[list[DraftResult], BatchStats | None]:
        """Validated (model name, item) pairs (`items`, `validated`) through the batch queue, or in place where no
        item's drafter runs a model (`_in_place`)."""
        if not items:
            return [], None
        done = self._in_place(items)
        return done if done is not None else await self.batcher.submit(items)

    def _in_place(self, items: list[tuple[str, DraftItem]]) -> tuple[list[DraftResult], BatchStats] | None:
        """A call whose drafters all run no model (n-gram lookups), of at most IN_PLACE_POSITIONS draft positions,
        drafted on the calling thread, as the model thread would: handing it to that thread and back costs more than
        the lookups (docs/benchmarks/ngram.md). None (the queue takes it, in turn) for any other call, or while a
        batch holds one of its drafters' sessions."""
        names = sorted({name for name, _ in items})
        if sum(item.num_draft_tokens for _, item in items) > IN_PLACE_POSITIONS or not all(isinstance(self.models[n], NgramModel) for n in names):
            return None
        with contextlib.ExitStack() as held:
            for name in names:
                lock = self.models[name].store.lock
                if not lock.acquire(blocking=False):
                    return None
                held.callback(lock.release)
            started = time.perf_counter()
            results = self.batcher.process(items)
            return results, BatchStats(compute_ms=(time.perf_counter() - started) * 1e3, batch_size=len(items))

    async def draft(self, request: drafter_pb2.DraftRequest) -> drafter_pb2.DraftResponse:
        results, stats = await self.draft_items(self.items(request))
        if stats is None:
            return drafter_pb2.DraftResponse()
        return drafter_pb2.DraftResponse(
            sessions=[
                drafter_pb2.DraftedSession(
                    session_id=r.session_id,
                    status=common_pb2.SESSION_PREFILLING if r.prefilling else common_pb2.SESSION_OK if r.known else common_pb2.SESSION_UNKNOWN,
                    token_ids=r.token_ids,
                    proposals=[common_pb2.SparseDistribution(token_ids=ids, probs=probs) for ids, probs in r.proposals],
                    confidences=r.confidences,
                    context_log_prob=r.context_log_prob,
                    context_tokens=r.context_tokens,
                )
                for r in results
            ],
            compute_ms=stats.compute_ms,
            queue_ms=stats.queue_ms,
        )

    async def release(self, request: common_pb2.ReleaseRequest) -> common_pb2.ReleaseResponse:
        ids, keep, models = list(request.session_ids), request.keep_tokens, list(self.models.values())
        # Each store's lock is held by the model thread for a whole batch: off the event loop, in one hop for every
        # model (a hop each cost a service of nine models most of the event loop's time its releases took).
        released = await asyncio.to_thread(lambda: sum(model.store.release(ids, keep) for model in models))
        return common_pb2.ReleaseResponse(released=released)

    def info(self) -> drafter_pb2.DrafterInfo:
        reply = drafter_pb2.DrafterInfo(models=[m.loaded.info() for m in self.models.values()])
        for info in reply.models:
            placement.describe(info)
        return reply

    async def stats(self) -> drafter_pb2.DrafterServiceStats:
        def held() -> list[str]:
            ids: set[str] = set()
            for model in self.models.values():
                with model.store.lock:  # held by the model thread for a whole batch: read between batches
                    ids.update(model.store._sessions)
            return sorted(ids)

        return drafter_pb2.DrafterServiceStats(session_ids=await asyncio.to_thread(held))

    def close(self) -> None:
        self.batcher.close()
        self.batcher.join(10.0)  # its pass done before a split model's other ranks stop
        for loaded in self.loaded_models():
            loaded.close()

    def loaded_models(self) -> list:
        """The models it runs (`LoadedModel`): each draft model's checkpoint (n-gram drafters have none)."""
        return [model.loaded for model in self.models.values() if isinstance(model, DraftModel)]


def load_core(svc: config_mod.DrafterServiceConfig, threads: int | None = None) -> DrafterCore:
    """Load a drafter service's draft models and build its batch queue, as the config says."""
    configure_torch(threads or svc.threads)
    device = config_mod.resolve_device(svc.device, f"drafters[{svc.name}].device")
    start_ranks = ray_ranks.starter()  # a split model's ranks: Ray actors where this service is one
    models = {}
    for m in svc.models:
        store = SessionStore(
            max_cache_bytes=int(svc.max_cache_mb * 2**20), max_sessions=svc.max_sessions, idle_s=svc.session_idle_s, namespace=m.name.encode()
        )
        if m.kind == "ngram":
            models[m.name] = NgramModel(load_source(m.name, m.path), store, m.ngram_max, m.ngram_min, m.ngram_matches)
            continue
        loaded = load_model(m.name, m.path, device=device, use_token_map=True, start_ranks=start_ranks, **svc.model_options())
        models[m.name] = DraftModel(loaded, store, svc.proposal_top_k)
    fingerprints = {m.loaded.fingerprint for m in models.values()}
    if len(fingerprints) > 1:
        raise IncompatibleModels(f"drafter service {svc.name}: its draft models use different tokenizers; they cannot serve one target")
    if svc.stack_models:
        for stack in stack_draft_models({name: m for name, m in models.items() if isinstance(m, DraftModel)}):
            log.info("drafter service %s: %s draft in one pass a step (same shape, stacked)", svc.name, ", ".join(m.name for m in stack.members))
            stack.prepare()
    for m in models.values():
        if isinstance(m, DraftModel) and m.stack is None:
            m.loaded.prepare(m.store.max_cache_bytes, m.store.max_sessions)
        if isinstance(m, DraftModel):
            m.loaded.pool.add_budget(m.store.max_cache_bytes)  # a stack's pool: its members' budgets together
    pools = list({id(m.loaded.pool): m.loaded.pool for m in models.values() if isinstance(m, DraftModel)}.values())
    telemetry = PassTelemetry("drafter", lambda: [m.store for m in models.values()], {"drafter_service": svc.name}, pools=lambda: pools)
    batcher = BatchQueue(
        f"drafter-{svc.name}",
        telemetry.timed(lambda tagged: draft_batch(models, tagged, svc.max_prefill_tokens)),
        svc.max_batch_size,
        svc.max_wait_ms / 1e3,
        housekeeping=lambda: [m.store.expire_idle() for m in models.values()],
        housekeeping_every_s=housekeeping_every(svc.session_idle_s),
    )
    return DrafterCore(models, batcher, telemetry, limits_mod.drafter_limits(svc.max_call_sessions, svc.max_call_tokens, f"drafters[{svc.name}]"))


class DrafterServicer(CoreServicer, drafter_pb2_grpc.DrafterServicer):
    """specfleet.v1.Drafter over a `DrafterCore`: the shell's RPCs, and Draft."""

    async def Draft(self, request: drafter_pb2.DraftRequest, context: grpc.aio.ServicerContext):
        return await self.answer(self.core.draft(request), context)


def _section(cfg: config_mod.Config, name: str | None) -> Section:
    """The drafter service named `name` (default: the first)."""
    if not cfg.drafters:
        raise config_mod.ConfigError("the config has no drafters section")
    svc = cfg.drafter_service(name) if name else cfg.drafters[0]
    default_metrics = config_mod.DEFAULT_METRICS_PORTS["drafter"] + cfg.drafters.index(svc)
    return Section(svc, f"drafter {svc.name}", f"drafters[{svc.name}]", default_metrics)


SPEC = ServiceSpec(
    command="drafter",
    description="Serve one or more draft models.",
    config_key="drafters[NAME]",
    select=_section,
    load_core=load_core,
    servicer=DrafterServicer,
    add_servicer=drafter_pb2_grpc.add_DrafterServicer_to_server,
    descriptor=drafter_pb2.DESCRIPTOR.services_by_name["Drafter"],
    name_help="which drafter service of the config to run (default: the first)",
    errors=(IncompatibleModels,),
)


def main(argv: list[str] | None = None) -> int:
    return service_shell.main(SPEC, argv)
