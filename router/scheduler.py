"""The router's scheduler: one loop that advances every running request by draft-then-verify rounds.

Each round takes the running requests, asks each request's drafter for up to
k tokens (all sessions of one drafter service in one call, all services
concurrently), then sends every request's draft tree to the verifier in one
call, commits what the target accepted, and streams it out. Requests join
and leave between rounds. A drafter that fails or lost a session only costs
that round's drafts (the request decodes plainly for the round); a verifier
that lost a session is sent the full token ids next round.

Choosing the drafter (`choose_drafter`) and the draft length
(`draft_length`) are the seams where expertise routing and adaptive
speculation plug in; pipelining splits the running set into groups that are
drafted and verified alternately.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass

import grpc

from router.request import DrafterCounts, RequestState, SessionMirror
from router.transport import DrafterTransport, VerifierTransport
from specfleet.v1 import common_pb2, drafter_pb2, verifier_pb2

log = logging.getLogger(__name__)


class Overloaded(Exception):
    pass


@dataclass
class SchedulerConfig:
    max_running: int
    max_queued: int
    rpc_timeout_s: float
    default_drafter: str


@dataclass
class RouterMetrics:
    rounds: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    drafter_errors: int = 0
    session_misses: int = 0


def _sampling_proto(state: RequestState) -> common_pb2.SamplingParams:
    s = state.spec.sampling
    return common_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        verifier: VerifierTransport,
        drafters: dict[str, DrafterTransport],  # draft model name -> the service hosting it
    ):
        self.config = config
        self.verifier = verifier
        self.drafters = drafters
        self.metrics = RouterMetrics()
        self._waiting: collections.deque[RequestState] = collections.deque()
        self._running: list[RequestState] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # --- the public side -----------------------------------------------------------------------------------

    def submit(self, state: RequestState) -> None:
        if len(self._waiting) >= self.config.max_queued:
            raise Overloaded(
                f"{len(self._running)} requests running and {len(self._waiting)} queued (router.max_queued); retry later"
            )
        state.drafter = self.choose_drafter(state)
        self._waiting.append(state)
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="scheduler")

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    @property
    def load(self) -> tuple[int, int]:
        return len(self._running), len(self._waiting)

    # --- policy seams ----------------------------------------------------------------------------------------

    def choose_drafter(self, state: RequestState) -> str:
        return self.config.default_drafter

    def draft_length(self, state: RequestState) -> int:
        # Never draft past max_tokens (the verifier adds one token of its own) or the context.
        return max(0, min(state.spec.draft_tokens, state.remaining() - 1)) if state.drafter else 0

    # --- the loop ----------------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            while not self._waiting and not self._running:
                self._wake.clear()
                await self._wake.wait()
            while self._waiting and len(self._running) < self.config.max_running:
                self._running.append(self._waiting.popleft())
            try:
                await self._round(list(self._running))
            except Exception:  # a bug must not stop the router: fail this round's requests, keep serving
                log.exception("round failed")
                for state in self._running:
                    state.error = (grpc.StatusCode.INTERNAL, "internal error in the router's scheduler; see its log")
            for state in self._running:
                self._publish(state)
            finished = [s for s in self._running if s.finished]
            self._running = [s for s in self._running if not s.finished]
            if finished:
                asyncio.create_task(self._release([s.spec.request_id for s in finished], {s.drafter for s in finished}))

    async def _round(self, batch: list[RequestState]) -> None:
        now = time.monotonic()
        for state in batch:
            if state.deadline is not None and now >= state.deadline:
                state.error = (grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded; the output so far was streamed")
        batch = [s for s in batch if not s.finished]
        if not batch:
            return
        drafts = await self._draft(batch)
        await self._verify(batch, drafts)
        self.metrics.rounds += 1

    async def _draft(self, batch: list[RequestState]) -> dict[str, drafter_pb2.DraftedSession]:
        """Ask every drafter service, concurrently, for its requests' drafts."""
        by_service: dict[str, list[tuple[RequestState, drafter_pb2.DraftSession]]] = collections.defaultdict(list)
        for state in batch:
            k = self.draft_length(state)
            if k == 0:
                continue
            mirror = state.drafter_mirrors.setdefault(state.drafter, SessionMirror())
            prefix, new = mirror.diff(state.tokens)
            session = drafter_pb2.DraftSession(
                sync=common_pb2.SessionSync(session_id=state.spec.request_id, prefix_length=prefix, new_token_ids=new),
                model=state.drafter,
                num_draft_tokens=k,
                sampling=_sampling_proto(state),
            )
            by_service[self.drafters[state.drafter].name].append((state, session))

        async def call(service_name: str, entries):
            transport = self.drafters[entries[0][0].drafter]
            started = time.perf_counter()
            try:
                reply = await transport.draft(
                    drafter_pb2.DraftRequest(sessions=[s for _, s in entries]), self.config.rpc_timeout_s
                )
            except grpc.aio.AioRpcError as err:
                # Losing a drafter costs speed, never correctness: these requests decode plainly this round.
                self.metrics.drafter_errors += 1
                log.warning("drafter %s failed (%s: %s); decoding without drafts this round", service_name, err.code().name, err.details())
                for state, _ in entries:
                    state.drafter_mirrors[state.drafter].reset()
                return {}
            wall = (time.perf_counter() - started) * 1e3
            out = {}
            for (state, _), drafted in zip(entries, reply.sessions):
                mirror = state.drafter_mirrors[state.drafter]
                state.timing_ms["draft_wall"] += wall
                state.timing_ms["draft_compute"] += reply.compute_ms
                if drafted.status != common_pb2.SESSION_OK:
                    self.metrics.session_misses += 1
                    mirror.reset()
                    continue
                mirror.held = state.tokens + list(drafted.token_ids)
                out[state.spec.request_id] = drafted
            return out

        results = await asyncio.gather(*(call(name, entries) for name, entries in by_service.items()))
        return {rid: drafted for part in results for rid, drafted in part.items()}

    async def _verify(self, batch: list[RequestState], drafts: dict[str, drafter_pb2.DraftedSession]) -> None:
        sessions = []
        for state in batch:
            prefix, new = state.verifier_mirror.diff(state.tokens)
            drafted = drafts.get(state.spec.request_id)
            tree = verifier_pb2.TokenTree()
            if drafted is not None:
                n = len(drafted.token_ids)
                tree = verifier_pb2.TokenTree(token_ids=drafted.token_ids, parents=list(range(-1, n - 1)), proposals=drafted.proposals)
            sessions.append(
                verifier_pb2.VerifySession(
                    sync=common_pb2.SessionSync(session_id=state.spec.request_id, prefix_length=prefix, new_token_ids=new),
                    tree=tree,
                    sampling=_sampling_proto(state),
                )
            )
        started = time.perf_counter()
        try:
            reply = await self.verifier.verify(verifier_pb2.VerifyRequest(sessions=sessions), self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as err:
            log.error("verifier failed (%s: %s)", err.code().name, err.details())
            for state in batch:
                state.verifier_mirror.reset()
                if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    state.error = (grpc.StatusCode.INTERNAL, f"the verifier refused the round: {err.details()}")
                else:
                    state.error = (grpc.StatusCode.UNAVAILABLE, f"the verifier is unavailable ({err.code().name}); retry")
            return
        wall = (time.perf_counter() - started) * 1e3
        for state, verified in zip(batch, reply.sessions):
            state.timing_ms["verify_wall"] += wall
            state.timing_ms["verify_compute"] += reply.compute_ms
            if verified.status != common_pb2.SESSION_OK:
                # Lost by the verifier: send everything next round. No tokens were committed.
                self.metrics.session_misses += 1
                state.verifier_mirror.reset()
                continue
            drafted = drafts.get(state.spec.request_id)
            accepted = len(verified.accepted_nodes)
            state.rounds += 1
            if drafted is not None:
                counts = state.per_drafter.setdefault(state.drafter, DrafterCounts())
                counts.rounds += 1
                counts.draft_tokens += len(drafted.token_ids)
                counts.accepted_tokens += accepted
                self.metrics.draft_tokens += len(drafted.token_ids)
                self.metrics.accepted_tokens += accepted
            state.commit(list(verified.token_ids))
            state.verifier_mirror.held = list(state.tokens)

    def _publish(self, state: RequestState) -> None:
        if state.error is not None:
            self.metrics.requests_failed += 1
            state.updates.put_nowait(state.error)
            return
        chunk = state.take_chunk()
        if chunk is not None:
            if chunk.final:
                self.metrics.requests_finished += 1
            state.updates.put_nowait(chunk)

    async def _release(self, request_ids: list[str], drafters: set[str]) -> None:
        services = {self.drafters[d].name: self.drafters[d] for d in drafters if d in self.drafters}
        calls = [self.verifier.release(request_ids)] + [t.release(request_ids) for t in services.values()]
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, Exception):
                log.debug("release failed: %s", result)
