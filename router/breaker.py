"""Which services to call this round: a circuit breaker per drafter service (and per verifier replica).

A drafter that fails or misses its deadline costs its requests only that round's
drafts. Called again every round while it is dead or hung, it would cost every
round a deadline's wait (a stopped process answers nothing until the deadline
passes), and the retry would resend whole contexts, which get the long deadline
of a prefill. So after a failure the service is skipped (open): its requests
decode without drafts. After 0.5 s, and twice as long after each failed probe
(at most 8 s), one probe asks the service for its info with a short deadline;
when it answers, the breaker closes and the next round calls it again.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 8.0


class Breaker:
    def __init__(
        self, clock=time.monotonic, first_backoff_s: float = FIRST_BACKOFF_S, max_backoff_s: float = MAX_BACKOFF_S, kind: str = "drafter service"
    ):
        self._clock = clock
        self._first_backoff_s = first_backoff_s
        self._max_backoff_s = max_backoff_s
        self._kind = kind
        self._probe_at: dict[str, float] = {}  # open services: when to probe next
        self._backoff: dict[str, float] = {}
        self._probing: set[str] = set()

    def allow(self, service: str) -> bool:
        """Whether rounds call this service (the breaker is closed)."""
        return service not in self._probe_at

    def probe_due(self, service: str) -> bool:
        """True once per backoff period of an open service: the caller probes it and reports back."""
        if service not in self._probe_at or service in self._probing or self._clock() < self._probe_at[service]:
            return False
        self._probing.add(service)
        return True

    def failed(self, service: str) -> None:
        """A call or a probe failed: skip the service for the next backoff."""
        if service in self._probe_at and service not in self._probing:
            return  # a call sent before the breaker opened (another lane's): the same outage, no longer wait
        self._probing.discard(service)
        backoff = min(self._max_backoff_s, self._backoff.get(service, self._first_backoff_s / 2) * 2)
        self._backoff[service] = backoff
        self._probe_at[service] = self._clock() + backoff
        log.warning("%s %s: skipped, probed again in %.1fs", self._kind, service, backoff)

    def succeeded(self, service: str) -> None:
        """A probe was answered: rounds call the service again."""
        self._probing.discard(service)
        self._backoff.pop(service, None)
        if self._probe_at.pop(service, None) is not None:
            log.info("%s %s answers again", self._kind, service)

    def next_probe_in(self) -> float:
        """Seconds until the next probe of an open service is due (0 when one is; inf when none is open)."""
        waiting = [at for service, at in self._probe_at.items() if service not in self._probing]
        return max(0.0, min(waiting) - self._clock()) if waiting else float("inf")

    @property
    def open(self) -> list[str]:
        """Services being skipped now."""
        return sorted(self._probe_at)
