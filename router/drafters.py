"""A drafter service's replicas: which one drafts for each request, and moving off a dead one.

Replicas of a service host the same draft models (checked at start-up). A request's drafter
sessions stay on one replica while it lives (their KV caches are there; cooperating drafters
draft in lockstep inside one process); a new request goes to the replica drafting for the fewest
requests. When the scheduler's breaker skips a replica (router/breaker.py), its requests move to
a live one, which prefills their contexts on the next call; while none is live they decode
without drafts, which costs speed, never output.
"""

from __future__ import annotations

import collections

from router.transport import DrafterTransport


class DrafterService:
    def __init__(self, name: str, replicas: list[DrafterTransport]):
        if not replicas:
            raise ValueError(f"drafter service {name}: at least one replica")
        self.name = name
        self.replicas = replicas
        self._by_name = {r.name: r for r in replicas}
        self._placed: dict[str, str] = {}  # session id -> replica name
        self._requests: collections.Counter[str] = collections.Counter()
        self.placement = None  # the ModelInfo of its first model, where it runs (specfleet/placement.py)

    @property
    def address(self) -> str:
        return ", ".join(r.address for r in self.replicas)

    def pick(self, session_id: str, live) -> tuple[DrafterTransport, bool]:
        """The replica drafting for this request this round, and whether it just moved there (the new
        replica holds none of its sessions). live(name): whether the breaker lets rounds call it."""
        current = self._placed.get(session_id)
        if current is not None and live(current):
            return self._by_name[current], False
        candidates = [r for r in self.replicas if live(r.name)]
        if not candidates:
            # None is live: stay put; the caller skips it (and probes it) until it answers.
            return self._by_name[current] if current is not None else self.replicas[0], False
        chosen = min(candidates, key=lambda r: (self._requests[r.name], r.name))
        if current is not None:
            self._requests[current] -= 1
        self._placed[session_id] = chosen.name
        self._requests[chosen.name] += 1
        return chosen, current is not None

    def unplaced(self, session_id: str) -> None:
        current = self._placed.pop(session_id, None)
        if current is not None:
            self._requests[current] -= 1
