"""The router's front door: validation, admission, streaming and cancellation of generation requests, for any transport.

    front_door = FrontDoor(scheduler, tokenizer, limits, eos_token_id, target)
    async for event in front_door.generate(GenerationParams(prompt="def f(n):", max_tokens=32)):
        ...  # router.api.Delta, then router.api.Finished; a failure raises router.api.GenerationError

`validate` checks every field of a `GenerationParams` (the messages name the
field); `FrontDoor.submit` queues the request in the scheduler and returns its
`Generation`: its events, its whole output once finished (`complete`), and
`cancel`, which the scheduler honours at the request's next round (its sessions
are released everywhere). The gRPC servicer (router/grpc_api.py) and the
OpenAI-compatible HTTP API (router/openai_api.py) are thin adapters over this
module: neither knows of the other, and nothing here knows of either.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import secrets
import struct
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
    TokenLogprob,
    TokenLogprobs,
    Usage,
    invalid,
)
from router.request import Limits, RequestSpec, RequestState
from router.scheduler import Overloaded, Scheduler
from specfleet.sampling import SamplingParams

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 16
MAX_LABEL_CHARS = 128
MAX_TOP_LOGPROBS = 20
# The verifier and drafters take top_k as an int32 and a seed as a uint64.
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**64 - 1

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


def _float32(x: float) -> float:
    """x as the float32 the verifier and drafters are sent (an overflow is infinite): what the router checks is what they get."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def validate(params: GenerationParams, tokenizer, limits: Limits) -> RequestSpec:
    """The request `params` asks for, checked against `limits`; a GenerationError (INVALID_ARGUMENT) names the first bad field."""
    for name, value, longest in (("request_id", params.request_id, MAX_LABEL_CHARS), ("domain", params.domain, MAX_LABEL_CHARS)):
        # Labels end up in logs and metrics: no control characters (a newline would forge a log line).
        if len(value) > longest or not value.isprintable():
            raise invalid(name, f"at most {longest} printable characters, got {len(value)} characters")
    prompt_ids = _prompt_ids(params, tokenizer, limits)
    max_tokens = _max_tokens(params, len(prompt_ids), limits)
    sampling = _sampling(params)
    if len(params.stop) > MAX_STOP_STRINGS or any(not s for s in params.stop):
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} non-empty strings")
    spec_opts = params.speculation
    if not 0 <= spec_opts.max_draft_tokens <= limits.requests.max_draft_tokens:
        raise invalid("speculation.max_draft_tokens", f"must be between 0 and {limits.requests.max_draft_tokens}, got {spec_opts.max_draft_tokens}")
    if not 0 <= params.top_logprobs <= MAX_TOP_LOGPROBS:
        raise invalid("top_logprobs", f"must be between 0 and {MAX_TOP_LOGPROBS}, got {params.top_logprobs}")
    if params.top_logprobs and not params.logprobs:
        raise invalid("top_logprobs", "needs logprobs set")
    return RequestSpec(
        request_id=params.request_id or uuid.uuid4().hex,
        session_id=secrets.token_hex(16),
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        sampling=sampling,
        stop=list(params.stop),
        stop_at_eos=params.stop_at_eos,
        max_draft_tokens=0 if spec_opts.disabled else (spec_opts.max_draft_tokens or limits.requests.num_draft_tokens),
        domain=params.domain,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
    )


def _prompt_ids(params: GenerationParams, tokenizer, limits: Limits) -> list[int]:
    if params.prompt and params.prompt_token_ids:
        raise invalid("prompt", "set either prompt or prompt_token_ids, not both")
    if params.prompt_token_ids:
        prompt_ids = list(params.prompt_token_ids)
        bad = [t for t in prompt_ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise invalid("prompt_token_ids", f"ids outside the vocabulary [0, {limits.vocab_size}): {bad[:5]}")
    else:
        if not params.prompt:
            raise invalid("prompt", "must not be empty (or set prompt_token_ids)")
        if len(params.prompt) > limits.max_prompt_chars:
            raise invalid("prompt", f"{len(params.prompt)} characters cannot fit the model's context of {limits.max_context} tokens; shorten it")
        prompt_ids = tokenizer.encode(params.prompt, add_special_tokens=False)
        if not prompt_ids:
            raise invalid("prompt", "encodes to no tokens")
    if len(prompt_ids) >= limits.max_context:
        raise invalid("prompt", f"{len(prompt_ids)} tokens leaves no room in the model's context of {limits.max_context} tokens; shorten it")
    return prompt_ids


def _max_tokens(params: GenerationParams, prompt_tokens: int, limits: Limits) -> int:
    max_tokens = params.max_tokens if params.max_tokens is not None else limits.requests.default_max_tokens
    if not 1 <= max_tokens <= limits.requests.max_tokens_limit:
        raise invalid("max_tokens", f"must be between 1 and {limits.requests.max_tokens_limit}, got {max_tokens}")
    room = limits.max_context - prompt_tokens
    if max_tokens > room:
        if params.max_tokens is not None:
            # Generation would stop at the context's end with less than was asked: say so now.
            raise invalid(
                "max_tokens",
                f"{max_tokens} new tokens after a prompt of {prompt_tokens} exceed the model's context of "
                f"{limits.max_context} tokens; ask for at most {room}",
            )
        max_tokens = room  # the server's default, not the client's request: fit it to the context
    return max_tokens


def _sampling(params: GenerationParams) -> SamplingParams:
    temperature, top_p = _float32(params.temperature), _float32(params.top_p)
    if not math.isfinite(temperature) or temperature < 0:
        raise invalid("temperature", f"must be >= 0 (0 is greedy), got {temperature}")
    if not (0 < top_p <= 1):
        raise invalid("top_p", f"must be in (0, 1], got {top_p}")
    if params.top_k < 0:
        raise invalid("top_k", f"must be >= 0 (0 disables it), got {params.top_k}")
    if params.top_k > MAX_TOP_K:
        raise invalid("top_k", f"must be at most {MAX_TOP_K}, got {params.top_k}")
    if params.seed is not None and not 0 <= params.seed <= MAX_SEED:
        raise invalid("seed", f"must be between 0 and 2**64 - 1, got {params.seed}")
    # A client's seed must fix the output whatever is drafted, batched or learned: such a request
    # samples by the seeded exponential race (verification.py, obligation 6). Without one,
    # rejection sampling accepts more drafts.
    seeded = params.seed is not None
    seed = params.seed if seeded else secrets.randbits(63)
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=params.top_k, seed=seed, drafter_invariant=seeded)


class Generation:
    """One admitted request: its events, its whole output once finished, and a way to stop it."""

    def __init__(self, state: RequestState):
        self.state = state

    @property
    def request_id(self) -> str:
        return self.state.spec.request_id

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
            logprobs = _typed_logprobs(update.logprobs)
            if not update.final:
                yield Delta(update.text, list(update.token_ids), logprobs)
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
            yield Finished(update.text, list(update.token_ids), logprobs, state.finish_reason, self.usage(), self.speculation())
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
            logprobs=_typed_logprobs(state.logprobs),
        )

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.state.spec.prompt_ids), completion_tokens=len(self.state.output_ids))

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


def _typed_logprobs(entries: list) -> list[TokenLogprobs]:
    """The round machinery's per-token log-probabilities (router/verifying.py) as router.api types."""
    return [TokenLogprobs(e.token_id, e.logprob, [TokenLogprob(t.token_id, t.logprob) for t in e.top]) for e in entries]


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
        self.draining = False
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    def check_open(self) -> None:
        """GenerationError (SHUTTING_DOWN) once the router has begun to drain."""
        if self.draining:
            raise GenerationError(ErrorKind.SHUTTING_DOWN, SHUTTING_DOWN)

    def _validate(self, params: GenerationParams) -> tuple[RequestSpec, str]:
        """The validated request and its prompt text (the routing classifier reads it)."""
        spec = validate(params, self.tokenizer, self.limits)
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
