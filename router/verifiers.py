"""The verifier replicas: which one holds each request's sessions, and moving requests off a dead one.

Every replica hosts the same target (checked at start-up), so any of them can verify any request
once it holds the request's tokens; the router holds those tokens anyway (a request's state), so
moving a request costs one prefill on the new replica and never changes its output: nothing is
committed from a failed call, greedy rounds are deterministic, seeded ones depend only on (seed,
position), and an unseeded round draws fresh randomness whichever replica runs it.

A request stays on its replica while it lives (its KV cache is there). A new or moved request
goes to the live replica holding the fewest tokens of running requests. A replica whose call
fails is skipped (a breaker per replica, probed with GetInfo after a short backoff) and its
requests move; while no replica is live, requests wait, each for at most `wait_s` since its
last verified round, then fail with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from router.breaker import Breaker
from router.request import RequestState
from router.transport import TransportError, VerifierTransport

log = logging.getLogger(__name__)

# A verifier restart (a supervisor's, or Kubernetes') is back within seconds: probe often.
FIRST_PROBE_S = 0.25
MAX_PROBE_S = 2.0
CHECK_EVERY_S = 2.0
# GetInfo needs no forward pass: a replica that cannot answer it in this long is hung.
PROBE_DEADLINE_S = 5.0


class VerifierPool:
    def __init__(self, replicas: list[VerifierTransport], wait_s: float, clock=time.monotonic):
        if not replicas:
            raise ValueError("at least one verifier replica")
        self.replicas = {r.address: r for r in replicas}
        self.wait_s = wait_s
        self._clock = clock
        self.breaker = Breaker(clock=clock, first_backoff_s=FIRST_PROBE_S, max_backoff_s=MAX_PROBE_S, kind="verifier replica")
        self._load: collections.Counter[str] = collections.Counter()  # replica -> tokens of the requests placed there
        self._placed: dict[str, tuple[str, int]] = {}  # session id -> (replica, tokens counted in _load)
        self.moves = 0

    @property
    def first(self) -> VerifierTransport:
        return next(iter(self.replicas.values()))

    def live(self) -> list[str]:
        return [name for name in self.replicas if self.breaker.allow(name)]

    def place(self, state: RequestState) -> str | None:
        """The replica that verifies this request's round; None while no replica is live."""
        sid = state.spec.session_id
        current = self._placed.get(sid)
        if current is not None and self.breaker.allow(current[0]):
            replica = current[0]
        else:
            live = self.live()
            if not live:
                # A request that finds no replica live waits from now on, whether or not a call of its own failed.
                if state.verifier_lost_at is None:
                    state.verifier_lost_at = self._clock()
                return None
            replica = min(live, key=lambda name: (self._load[name], name))
            if current is not None:
                self.moves += 1
                log.info("request %s moves to verifier replica %s", state.spec.request_id or sid[:8], replica)
            # A new replica holds nothing of the session yet: send all its tokens.
            state.verifier_mirror.reset()
            state.verifier_replicas.add(replica)
        self._count(sid, replica, len(state.tokens))
        return replica

    def _count(self, sid: str, replica: str, tokens: int) -> None:
        old = self._placed.get(sid)
        if old is not None:
            self._load[old[0]] -= old[1]
        self._placed[sid] = (replica, tokens)
        self._load[replica] += tokens

    def failed(self, replica: str, states: list[RequestState], err: TransportError) -> None:
        """A call to `replica` failed: skip it until a probe answers; its requests move (or wait)."""
        log.error("verifier replica %s failed (%s); its %d request(s) move to a live replica", replica, err, len(states))
        self.breaker.failed(replica)
        now = self._clock()
        for state in states:
            state.verifier_mirror.reset()
            if state.verifier_lost_at is None:
                state.verifier_lost_at = now

    def succeeded(self, states: list[RequestState]) -> None:
        for state in states:
            state.verifier_lost_at = None

    def waited_too_long(self, state: RequestState) -> bool:
        return state.verifier_lost_at is not None and self._clock() - state.verifier_lost_at > self.wait_s

    def unplaced(self, state: RequestState) -> None:
        """The request ended: it no longer counts towards its replica's load."""
        old = self._placed.pop(state.spec.session_id, None)
        if old is not None:
            self._load[old[0]] -= old[1]

    async def watch(self) -> None:
        """Health-check the replicas without waiting for traffic: a skipped one is probed when its backoff
        ends, a live one every CHECK_EVERY_S, so that the router's own health (serving while some replica
        is live) and a returning replica show up even when no request is running."""
        checked = self._clock()
        while True:
            due = [r for name, r in self.replicas.items() if self.breaker.probe_due(name)]
            if self._clock() - checked >= CHECK_EVERY_S:
                checked = self._clock()
                due += [self.replicas[name] for name in self.live()]
            await asyncio.gather(*(self._probe(replica) for replica in due))
            await asyncio.sleep(0.1)

    async def _probe(self, replica: VerifierTransport) -> None:
        was_live = self.breaker.allow(replica.address)
        try:
            await replica.info(PROBE_DEADLINE_S)
        except TransportError as err:
            if was_live:
                log.error("verifier replica %s does not answer its health check (%s)", replica.address, err)
            self.breaker.failed(replica.address)
        else:
            self.breaker.succeeded(replica.address)

    def next_probe_in(self) -> float:
        return self.breaker.next_probe_in()
