"""What rounds deliver, measured: the check that adaptive speculation's plan pays (router/speculation.py).

Tokens committed per request per millisecond of round wall time, for rounds that speculated (the plan routed them:
drafting, probing, or every request at k = 0) and for rounds the check sent to plain decoding, per load; speculating
loses only when plain decoding is ahead beyond the measurements' noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


# A way of decoding is judged from this many rounds at least: one has no spread to judge by.
MIN_ROUNDS = 2
# Speculating loses when plain decoding's goodput exceeds its by this many standard errors of the difference.
LOSES_BY_SE = 2.0
# Speculating's rounds at a load drafted lately while a drafting round weighs at least this much among them (older ones
# weigh `forget` times less per newer speculating round): about one in the last 23 at 0.97.
DRAFTED_LATELY = 0.5


@dataclass
class _Rounds:
    """Decayed sums over the rounds of one kind at one load: each older round weighs `forget` times less per newer
    one. Enough to give tokens per request per millisecond, the ratio of the sums, and its standard error."""

    rounds: int = 0
    weight: float = 0.0
    weight_sq: float = 0.0  # sum of squared weights: the effective count is weight^2 / weight_sq
    tokens: float = 0.0  # tokens committed per request
    ms: float = 0.0
    tokens_sq: float = 0.0
    ms_sq: float = 0.0
    tokens_ms: float = 0.0

    def add(self, forget: float, tokens: float, ms: float) -> None:
        self.rounds += 1
        self.weight = self.weight * forget + 1
        self.weight_sq = self.weight_sq * forget * forget + 1
        self.tokens = self.tokens * forget + tokens
        self.ms = self.ms * forget + ms
        self.tokens_sq = self.tokens_sq * forget + tokens * tokens
        self.ms_sq = self.ms_sq * forget + ms * ms
        self.tokens_ms = self.tokens_ms * forget + tokens * ms

    @property
    def goodput(self) -> float:
        return self.tokens / self.ms

    @property
    def count(self) -> float:
        """The effective number of rounds measured."""
        return self.weight * self.weight / self.weight_sq

    def variance(self) -> float:
        """The goodput's variance (the delta method for a ratio of means): rounds that commit 1 to k + 1 tokens
        a request make drafting's far larger than plain decoding's. Infinite below MIN_ROUNDS rounds."""
        if self.rounds < MIN_ROUNDS:
            return math.inf
        n = self.count
        w, ratio = self.weight, self.goodput
        mean_ms = self.ms / w
        var_tokens = self.tokens_sq / w - (self.tokens / w) ** 2
        var_ms = self.ms_sq / w - mean_ms**2
        cov = self.tokens_ms / w - (self.tokens / w) * mean_ms
        spread = max(0.0, var_tokens - 2 * ratio * cov + ratio * ratio * var_ms) * n / (n - 1)
        return spread / (mean_ms * mean_ms * n)


class MeasuredGoodput:
    """What rounds deliver, per load: tokens committed per request per millisecond of round
    wall time, for rounds that speculated and for rounds decoded plainly, unrouted.

    The load is the number of requests running in the router, grouped by powers of two (1, 2-3,
    4-7, 8-15, ...): passes over more sessions take longer, so speculating and plain decoding are
    compared at comparable loads only, and every lane's rounds at one load share one decision.
    Each estimate is a ratio of decayed sums (`_Rounds`: an older round weighs `forget` times less
    per newer one, about 65 rounds in effect at 0.97), so no single slow round decides: served
    rounds' goodputs spread by a third or more (a lane's round waits for the other lane's pass,
    new prompts prefill in some), and over fewer rounds the difference a loss makes stays within
    its noise (docs/benchmarks/measured-fallback.md). Speculating
    loses only when plain decoding is ahead by LOSES_BY_SE standard errors: a round that drafts
    commits 1 to k + 1 tokens a request, and at one client a few unlucky rounds in a row would
    otherwise send every request to plain decoding for `remeasure_every` rounds although drafting
    pays on average (docs/benchmarks/measured-fallback.md)."""

    def __init__(self, forget: float = 0.97):
        self.forget = forget
        self._rounds: dict[tuple[int, bool], _Rounds] = {}  # (load, speculated) -> the rounds measured
        self._since: dict[tuple[int, bool], int] = {}  # (load, speculated) -> rounds at that load since one of that way was measured
        self._drafting: dict[int, float] = {}  # load -> decayed count of speculating rounds in which some request drafted

    @staticmethod
    def load(running: int) -> int:
        return running.bit_length()

    def observe(self, running: int, sessions: int, tokens: int, wall_ms: float, speculated: bool, clean: bool = True, drafted: bool = False) -> None:
        """A round at `running` requests (drafted: some request of it drafted or probed)."""
        if sessions <= 0 or tokens <= 0 or wall_ms <= 0:
            return  # nothing committed (a failed call, no live verifier): a fault, not what a way of decoding costs
        load = self.load(running)
        if speculated:
            self._drafting[load] = self._drafting.get(load, 0.0) * self.forget + drafted
        for kind in (False, True):
            self._since[load, kind] = self._since.get((load, kind), 0) + 1
        if not clean:
            return  # it ran beside rounds of the other way, or caught its drafters up after them: it measures neither cleanly
        self._rounds.setdefault((load, speculated), _Rounds()).add(self.forget, tokens / sessions, wall_ms)
        self._since[load, speculated] = 0

    def goodput(self, running: int, speculated: bool) -> float | None:
        """Tokens per request per millisecond of rounds at this load that speculated (or not); None until measured."""
        rounds = self._rounds.get((self.load(running), speculated))
        return rounds.goodput if rounds else None

    def speculating_loses(self, running: int) -> bool:
        """Whether plain decoding is measured ahead of speculating at this load, beyond the measurements' noise."""
        return self._ahead(running, speculated=False)

    def speculating_wins(self, running: int) -> bool:
        """Whether speculating is measured ahead of plain decoding at this load, beyond the measurements' noise."""
        return self._ahead(running, speculated=True)

    def _ahead(self, running: int, speculated: bool) -> bool:
        """Whether this way (speculating or not) is measured ahead of the other at this load by LOSES_BY_SE standard
        errors of the difference; False until both are measured."""
        mine, other = self._rounds.get((self.load(running), speculated)), self._rounds.get((self.load(running), not speculated))
        if mine is None or other is None:
            return False
        return mine.goodput - other.goodput > LOSES_BY_SE * math.sqrt(mine.variance() + other.variance())

    def drafted_lately(self, running: int) -> bool:
        """Whether speculating's recent rounds at this load drafted (or probed) at all (`DRAFTED_LATELY`): where none
        did, they were plain rounds that the plan routed, and their lead over plain decoding is noise."""
        return self._drafting.get(self.load(running), 0.0) >= DRAFTED_LATELY

    def rounds_measured(self, running: int, speculated: bool) -> int:
        """Rounds at this load that speculated (or not) and were measured."""
        rounds = self._rounds.get((self.load(running), speculated))
        return rounds.rounds if rounds else 0

    def rounds_since(self, running: int, speculated: bool) -> int:
        """Rounds at this load since one that speculated (or not) was measured."""
        return self._since.get((self.load(running), speculated), 0)
