"""The router's front door: validation, admission, streaming and cancellation of generation requests, for any transport.

    front_door = FrontDoor(scheduler, tokenizer, limits, eos_token_id, target)
    async for event in front_door.generate(GenerationParams(prompt="def f(n):", max_tokens=32)):
        ...  # router.api.Delta, then router.api.Finished; a failure raises router.api.GenerationError

`validate` (router/validation.py) checks every field of a `GenerationParams` (the
messages name the field); `FrontDoor.submit` queues the request in the scheduler and returns its
`Generation`: its events, its whole output once finished (`complete`), and
`cancel`, which the scheduler honours at the request's next round (its sessions
are released everywhere). The gRPC servicer (router/grpc_api.py) and the
OpenAI-compatible HTTP API (router/openai_api.py) are thin adapters over this
module: neither knows of the other, and nothing here knows of either.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator

from router.api import (
    Completion,
    Delta,
    DrafterStats,
    ErrorKind,
    Finished,
    GenerationError,
    GenerationParams,
    SpeculationStats,
    Usage,
)
from router.request import Limits, RequestSpec, RequestState
from router.scheduler import Overloaded, Scheduler
from router.validation import validate
from specfleet.guides import GuideCompiler

log = logging.getLogger(__name__)

SHUTTING_DOWN = "the server is shutting down: it finishes the requests in flight and takes no new ones; retry on another replica"

# What a request that failed in the scheduler ends with (RequestState.error: a gRPC status code and a message), by the code's name.
_FAILURES = {
    "INVALID_ARGUMENT": ErrorKind.INVALID_ARGUMENT,
    "RESOURCE_EXHAUSTED": ErrorKind.OVERLOADED,
    "UNAVAILABLE": ErrorKind.UNAVAILABLE,
    "DEADLINE_EXCEEDED": ErrorKind.DEADLINE_EXCEEDED,
}


# Each kind's gRPC status name: the label of specfleet:request_failure_total, whichever transport the request came by.
_STATUS_NAMES = {kind: name for name, kind in _FAILURES.items()} | {ErrorKind.SHUTTING_DOWN: "UNAVAILABLE", ErrorKind.INTERNAL: "INTERNAL"}


class Generation:
    """One admitted request: its events, its whole output once finished, and a way to stop it."""

    def __init__(self, state: RequestState):
        self.state = state

    @property
    def request_id(self) -> str:
        return self.state.spec.request_id

    @property
    def prompt_ids(self) -> list[int]:
        return self.state.spec.prompt_ids

    async def events(self) -> AsyncIterator[Delta | Finished]:
        """Delta events as rounds commit output, then one Finished; a request that fails raises GenerationError.
        A consumer that stops reading does not stop the request: `cancel` does (FrontDoor.generate and
        `interleave` call it)."""
        state = self.state
        while True:
            update = await state.updates.get()
            if isinstance(update, tuple):  # (gRPC status code, message): the scheduler's failure
                code, message = update
                raise GenerationError(_FAILURES.get(getattr(code, "name", ""), ErrorKind.INTERNAL), message)
            logprobs = update.logprobs
            if not update.final:
                yield Delta(update.text, list(update.token_ids), logprobs, update.prompt_logprobs)
                continue
            log.info(
                "request %s finished (%s): %d tokens in %d rounds, %d/%d drafts accepted, %.0f ms",
                state.spec.request_id,
                state.finish_reason,
                len(state.output_ids),
                state.rounds,
                state.accepted_tokens,
                state.draft_tokens,
                (time.monotonic() - state.admitted_at) * 1e3,
            )
            yield Finished(
                update.text, list(update.token_ids), logprobs, update.prompt_logprobs, state.finish_reason, self.usage(), self.speculation()
            )
            return

    async def complete(self) -> Completion:
        """The whole output, once the request has finished; raises GenerationError if it fails."""
        async for _ in self.events():
            pass
        return self.completion()

    def completion(self) -> Completion:
        """The output so far (all of it once Finished came)."""
        state = self.state
        return Completion(
            request_id=state.spec.request_id,
            text=state.text,
            token_ids=list(state.output_ids),
            finish_reason=state.finish_reason,
            usage=self.usage(),
            speculation=self.speculation(),
            logprobs=list(state.logprobs),
            prompt_logprobs=state.prompt_logprobs,
        )

    def usage(self) -> Usage:
        return Usage(len(self.state.spec.prompt_ids), len(self.state.output_ids), min(self.state.cached_tokens, len(self.state.spec.prompt_ids)))

    def speculation(self) -> SpeculationStats:
        state = self.state
        return SpeculationStats(
            rounds=state.rounds,
            draft_tokens=state.draft_tokens,
            accepted_tokens=state.accepted_tokens,
            drafters=[DrafterStats(name, c.rounds, c.draft_tokens, c.accepted_tokens) for name, c in sorted(state.per_drafter.items())],
            domain=state.routing.domain if state.routing else "",
            draft_wall_ms=state.timing_ms["draft_wall"],
            draft_compute_ms=state.timing_ms["draft_compute"],
            verify_wall_ms=state.timing_ms["verify_wall"],
            verify_compute_ms=state.timing_ms["verify_compute"],
            draft_queue_ms=state.timing_ms["draft_queue"],
            verify_queue_ms=state.timing_ms["verify_queue"],
            router_ms=state.timing_ms["router"],
        )

    def cancel(self, why: str) -> None:
        """Stop the request unless it has ended: the scheduler drops it at its next round and releases its sessions."""
        state = self.state
        if state.published_final or state.cancelled:
            return
        log.info("request %s cancelled: %s", state.spec.request_id, why)
        state.cancelled = True


class FrontDoor:
    """Where every generation request enters the router, whatever its transport.

    target: the verifier's description of the target model (path, max_context, ...). `limits`
    may be replaced whole (a config reload); `draining` is set when the router stops."""

    def __init__(self, scheduler: Scheduler, tokenizer, limits: Limits, eos_token_id: int, target=None):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.limits = limits
        self.eos_token_id = eos_token_id
        self.target = target
        # Structured output's grammars for the target's tokenizer: a request's guide is compiled once on admission.
        # None where the verifier cannot compile guides (no xgrammar there): guided requests are refused.
        guided = target is None or target.structured_output
        self.guides = GuideCompiler(tokenizer, limits.vocab_size, eos_token_id) if guided else None
        self.draining = False
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    def check_open(self) -> None:
        """GenerationError (SHUTTING_DOWN) once the router has begun to drain."""
        if self.draining:
            raise GenerationError(ErrorKind.SHUTTING_DOWN, SHUTTING_DOWN)

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int]:
        """text's token ids as a prompt is encoded (`GenerationParams.add_special_tokens`), on the tokenizer's thread."""
        encode = functools.partial(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, encode)

    async def detokenize(self, ids: list[int]) -> str:
        """ids' text, special tokens included, on the tokenizer's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, lambda: self.tokenizer.decode(ids, skip_special_tokens=False))

    def _validate(self, params: GenerationParams) -> tuple[RequestSpec, str]:
        """The validated request and its prompt text (the routing classifier reads it)."""
        spec = validate(params, self.tokenizer, self.limits, self.guides)
        return spec, params.prompt or self.tokenizer.decode(spec.prompt_ids)

    def refused(self, code: str) -> None:
        """A request refused before it ran: a failure the metrics count too, under its gRPC status name (a transport's
        own refusals, such as HTTP's unknown model, count here as the front door's do)."""
        telemetry = self.scheduler.context.telemetry
        if telemetry is not None:
            telemetry.failed.labels(code=code).inc()

    async def submit(self, params: GenerationParams, deadline: float | None = None, via: str = "", client: str = "") -> Generation:
        """Validate `params` and queue the request; raises GenerationError (INVALID_ARGUMENT, OVERLOADED, SHUTTING_DOWN).

        deadline: time.monotonic() by which the client wants the answer (DEADLINE_EXCEEDED after it);
        via: the transport, for the log; client: who sent it, the transport's name for its connection (admission
        takes turns between clients; a request is its own client when empty). Tokenizing a long prompt takes a
        while, so it never runs on the event loop, which serves every other client (one worker: the tokenizer is
        shared)."""
        try:
            self.check_open()
            spec, prompt_text = await asyncio.get_running_loop().run_in_executor(self._tokenizing, self._validate, params)
            state = RequestState(
                spec=spec,
                tokenizer=self.tokenizer,
                eos_token_id=self.eos_token_id,
                max_context=self.limits.max_context,
                deadline=deadline,
                client=client or spec.session_id,
            )
            try:
                self.scheduler.submit(state, prompt_text, spec.domain)
            except Overloaded as err:
                raise GenerationError(ErrorKind.OVERLOADED, str(err)) from None
        except GenerationError as err:
            self.refused(_STATUS_NAMES[err.kind])
            raise
        log.info(
            "request %s (session %s, %s): %d prompt tokens, max_tokens %d, temperature %g, domain %s, max_draft_tokens %d",
            spec.request_id,
            spec.session_id,
            via or "-",
            len(spec.prompt_ids),
            spec.max_tokens,
            spec.sampling.temperature,
            state.routing.domain or "-",
            spec.max_draft_tokens,
        )
        return Generation(state)

    async def submit_all(self, params: list[GenerationParams], deadline: float | None = None, via: str = "", client: str = "") -> list[Generation]:
        """All of them or none: a refusal cancels those admitted before it, and is raised."""
        generations: list[Generation] = []
        client = client or uuid.uuid4().hex  # they take their turns at admission as one client
        try:
            for p in params:
                generations.append(await self.submit(p, deadline, via, client))
        except GenerationError:
            for admitted in generations:
                admitted.cancel("a request submitted with it was refused")
            raise
        return generations

    async def generate(self, params: GenerationParams, deadline: float | None = None, via: str = "") -> AsyncIterator[Delta | Finished]:
        """Submit `params` and stream its events; a consumer that stops early (or is cancelled) cancels the request."""
        generation = await self.submit(params, deadline, via)
        try:
            async for event in generation.events():
                yield event
        finally:
            generation.cancel("its caller stopped reading")

    async def drain(self) -> None:
        """Take no new requests, and wait until every request in flight has finished."""
        self.draining = True
        while self.scheduler.running or self.scheduler.waiting:
            await asyncio.sleep(0.05)


async def interleave(generations: list[Generation], why: str) -> AsyncIterator[tuple[int, Delta | Finished]]:
    """(index, event) from all of `generations` as they come, until each has finished; the first failure raises.

    However it ends (all finished, a failure, its consumer gone), the unfinished ones are cancelled
    with `why` (for the log): nothing is left running that nobody reads."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for event in generation.events():
                await queue.put((index, event))
        except GenerationError as err:
            await queue.put((index, err))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(generations)]
    try:
        done = 0
        while done < len(generations):
            index, event = await queue.get()
            if isinstance(event, GenerationError):
                raise event
            yield index, event
            done += isinstance(event, Finished)
    finally:
        for task in tasks:
            task.cancel()
        for generation in generations:
            generation.cancel(why)  # a finished one stays as it is
