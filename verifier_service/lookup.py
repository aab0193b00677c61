"""How far the verifier's lookup chains go (verifier.py `Verifier._looked_up`): as far as they pay for their rows.

A chain's token adds a row to the pass whatever becomes of it, and saves a session a token's share of a plain pass
where it is accepted along with every token before it. So the j-th token is worth its row where

    P(tokens 1..j accepted) * T(B) / B  >=  c,

T(B) the time of a plain pass of the pass's B sessions and c what one more row adds to it. Both come from this
verifier's own passes of about B sessions (one bucket per power of two of sessions: a row's cost is not one number
from one session to many): T from a line through (rows, milliseconds) of its recent plain passes (`PassCost`), a pass
with chains from a line through its last passes with chains, each as a multiple of T when it ran (`RelativeCost`).
Chains may rest for hundreds of passes while the machine speeds up or slows down, and a pass's first run of a tree
shape carries one-time costs: milliseconds measured then and compared with a plain pass measured now would keep the
lookup off for good, where the multiple, with those first runs left out, holds. Chains turned down rest the bucket's
lookup, and a pass with chains after the rest explores whether they still lose: what it measured (its accepted
tokens' share of a plain pass against what it added to one) doubles the next rest where it lost and restores it
where it paid, as the router's probes back off. What every pass with chains measured that way also sums to the
bucket's gain: where the lines say chains pay and the passes that ran them lost, the passes win and chains rest
(lines through noisy passes can stay a little optimistic for long, at the few-tokens-a-pass gains of a CPU batch).
On a GPU a row costs next to
nothing and chains go as far as the lookup finds them; on a CPU a row of a small model costs a fifth of a one-token
pass, and a batch of many sessions is computing, not reading weights, so only chains likely to be accepted go on.

P is a product of each token's chance, learned from what verification did with earlier tokens of the same
confidence (the n-gram's count of the position's most frequent continuation / (total + 1), known before the token is
drawn: `specfleet.engine.ngram.lookup_chain`): `Acceptance` keeps, per confidence band, how often a token whose
predecessors were all accepted was accepted too.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# Confidence bands' lower edges: one earlier occurrence gives 1/2, two agreeing 2/3, three 3/4, more above.
BANDS = (0.0, 0.55, 0.7, 0.8)
# Weight of a band's prior (its own confidence) in tokens: a few verdicts move it.
PRIOR_TOKENS = 2.0
# Each new verdict or pass weighs this much against the ones before, so both follow the load and the text.
FORGET = 0.99
# Passes with chains a bucket of sessions needs before their cost is weighed (its first ones carry one-time costs
# of the tree's shapes). A pass whose chains were turned down rests the bucket's lookup for this many passes (not
# even looking up: the scan costs too), after which chains are proposed once all the same, so that what they cost
# stays measured as the load and the machine change.
TRUSTED_PASSES = 8
EXPLORE_EVERY = 32
# An exploring pass whose chains cost more than their accepted tokens saved (what it measured, not what the lines
# said) doubles the bucket's rest, at most this many times; one that paid restores it. Where the lines are right,
# explorations are the turned-down chains that lose: at four sessions of the demo target on one core they lost about
# 0.4 ms each, half of all passes with chains (docs/benchmarks/lookup.md).
MAX_EXPLORE_BACKOFF = 4
# Passes with chains a bucket's line is fitted to, and the multiple of their median time beyond which a pass is left
# out: a tree shape's first pass (allocations, kernel selection) runs several times a later one's.
CHAINED_WINDOW = 32
ONE_TIME_COSTS = 2.0
# The chance a chain needs, at most: high-confidence tokens go on being proposed however dear rows look, so that the
# estimates keep seeing verdicts (a threshold of 1 would stop every chain and every measurement with it).
MOST_NEEDED = 0.9


def _band(confidence: float) -> int:
    return max(i for i, edge in enumerate(BANDS) if confidence >= edge)


@dataclass
class Acceptance:
    """Per confidence band: (accepted, tried) tokens whose predecessors in their chain were all accepted; and per
    band of a chain's first position, its chains' (accepted tokens, proposed tokens, chains)."""

    counts: list[list[float]] = field(default_factory=lambda: [[max(edge, 0.5) * PRIOR_TOKENS, PRIOR_TOKENS] for edge in BANDS])
    # Prior: a chain of one token, accepted as often as the band's own prior says.
    chains: list[list[float]] = field(default_factory=lambda: [[max(edge, 0.5) * PRIOR_TOKENS, PRIOR_TOKENS, PRIOR_TOKENS] for edge in BANDS])

    def chance(self, confidence: float) -> float:
        accepted, tried = self.counts[_band(confidence)]
        return accepted / tried

    def chain(self, first: float) -> tuple[float, float]:
        """(tokens accepted, tokens proposed) a chain whose first position has this confidence brings, on average:
        the first position's confidence is known before any of the chain is drawn, so judging a pass by it cannot
        favour some drawn tokens over others."""
        accepted, proposed, chains = self.chains[_band(first)]
        return accepted / chains, proposed / chains

    def observe(self, confidences: list[float], accepted: int) -> None:
        """A chain of these confidences of which the first `accepted` tokens were accepted: each of those a hit, the
        one after them (if any) a miss; the rest were never tried."""
        for j, confidence in enumerate(confidences[: accepted + 1]):
            band = self.counts[_band(confidence)]
            band[0] = band[0] * FORGET + (1.0 if j < accepted else 0.0)
            band[1] = band[1] * FORGET + 1.0
        if confidences:
            chains = self.chains[_band(confidences[0])]
            chains[:] = [chains[0] * FORGET + accepted, chains[1] * FORGET + len(confidences), chains[2] * FORGET + 1.0]


@dataclass
class PassCost:
    """A line through (rows, ms) of recent passes, exponentially weighted: sums of 1, x, y, xx, xy."""

    sums: list[float] = field(default_factory=lambda: [0.0] * 5)

    def observe(self, rows: int, ms: float) -> None:
        self.sums = [s * FORGET + v for s, v in zip(self.sums, (1.0, rows, ms, rows * rows, rows * ms))]

    def line(self) -> tuple[float, float]:
        """(ms at zero rows, ms a row); a row costs nothing until the passes have had different numbers of rows."""
        return _line(*self.sums)


def _line(n: float, x: float, y: float, xx: float, xy: float) -> tuple[float, float]:
    """(y at x = 0, slope >= 0) of the least-squares line with these sums of 1, x, y, xx and xy over its points; flat
    where their x do not differ."""
    spread = n * xx - x * x
    if n < 2 or spread < 1e-6 * max(n * xx, 1e-12):
        return (y / n if n else 0.0), 0.0
    per_row = max(0.0, (n * xy - x * y) / spread)
    return max(0.0, (y - per_row * x) / n), per_row


@dataclass
class RelativeCost:
    """A bucket's last `CHAINED_WINDOW` passes with chains as (rows, ms / a plain pass's ms when it ran)."""

    passes: deque = field(default_factory=lambda: deque(maxlen=CHAINED_WINDOW))
    # The fit, kept until the next pass: every pass asks for it several times and a fit costs tens of microseconds.
    _line: tuple[float, float] | None = None
    _fitted: bool = False

    def observe(self, rows: int, multiple: float) -> None:
        self.passes.append((rows, multiple))
        self._fitted = False

    def line(self) -> tuple[float, float] | None:
        """(multiple at zero rows, multiple a row) through the window less passes beyond `ONE_TIME_COSTS` times its
        median; None while fewer than `TRUSTED_PASSES` remain."""
        if not self._fitted:
            self._line, self._fitted = self._fit(), True
        return self._line

    def _fit(self) -> tuple[float, float] | None:
        if len(self.passes) < TRUSTED_PASSES:
            return None
        bound = ONE_TIME_COSTS * statistics.median(m for _, m in self.passes)
        kept = [p for p in self.passes if p[1] <= bound]
        if len(kept) < TRUSTED_PASSES:
            return None
        x, y = sum(r for r, _ in kept), sum(m for _, m in kept)
        return _line(len(kept), x, y, sum(r * r for r, _ in kept), sum(r * m for r, m in kept))


@dataclass
class PassChains:
    """One pass's lookup: the chance a token needs (`LookupPolicy.needed`), and whether chains pay in it at all."""

    policy: LookupPolicy
    sessions: int
    needed: float
    _chance: float = 1.0

    def pays(self, first_confidences: list[float]) -> bool:
        """Whether chains pay for what they add to the pass (their rows, and a pass with a tree's own cost beyond a
        plain one's), judged by each session's first position alone, whose token is worth its row: its confidence is
        known before anything is drawn, so the judgement cannot favour some drawn tokens over others
        (specfleet/engine/ngram.py `lookup_chain`). A chain is expected to bring what chains of its first band did."""
        acceptance = self.policy.acceptance
        chains = [acceptance.chain(c) for c in first_confidences if acceptance.chance(c) >= self.needed]
        return self.policy.pays(self.sessions, round(sum(rows for _, rows in chains)), sum(tokens for tokens, _ in chains))

    def worth(self, confidence: float, first: bool) -> bool:
        """`specfleet.engine.ngram.lookup_chain`'s test of a chain's next position, of this confidence: whether the
        chance that it and the chain's tokens before it are accepted is enough."""
        self._chance = (1.0 if first else self._chance) * self.policy.acceptance.chance(confidence)
        return self._chance >= self.needed


@dataclass
class ForcedAcceptance:
    """How often the target keeps a guide's forced-text drafts (`Verifier._forced`), by depth in the chain: decayed
    counts of chains that reached depth d and of those whose first d + 1 tokens were accepted. Forced text is the
    grammar's, but its tokenization is the tokenizer's: a target that spells it otherwise rejects the rest."""

    tried: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)

    def chance(self, depth: int) -> float:
        """The chance that a chain's first depth + 1 tokens are accepted (one token of prior, accepted)."""
        tried, kept = (self.tried[depth], self.kept[depth]) if depth < len(self.tried) else (0.0, 0.0)
        return (kept + 1) / (tried + 1)

    def observe(self, proposed: int, accepted: int) -> None:
        while len(self.tried) < proposed:
            self.tried.append(0.0)
            self.kept.append(0.0)
        for depth in range(proposed):
            self.tried[depth] = self.tried[depth] * FORGET + 1
            self.kept[depth] = self.kept[depth] * FORGET + (depth < accepted)

    def worth(self, length: int, needed: float) -> int:
        """How many of a chain of `length` forced tokens to draft: as deep as each is likely enough to be accepted
        to pay for its row (`needed`: LookupPolicy.needed)."""
        depth = 0
        while depth < length and self.chance(depth) >= needed:
            depth += 1
        return depth


@dataclass
class LookupPolicy:
    acceptance: Acceptance = field(default_factory=Acceptance)
    forced: ForcedAcceptance = field(default_factory=ForcedAcceptance)
    # Per power of two of sessions in a pass (`int.bit_length`): its plain passes' cost and its passes' with chains.
    plain: dict[int, PassCost] = field(default_factory=dict)
    chained: dict[int, RelativeCost] = field(default_factory=dict)
    resting: dict[int, int] = field(default_factory=dict)  # per bucket: passes its lookup still rests (`pays`)
    backoff: dict[int, int] = field(default_factory=dict)  # per bucket: explorations in a row that lost (`observe_pass`)
    exploring: set = field(default_factory=set)  # buckets whose next pass with chains is an exploration
    gain: dict[int, float] = field(default_factory=dict)  # per bucket: ms its passes with chains saved, net, decayed

    def gained(self, sessions: int) -> float:
        """The ms the bucket's recent passes with chains saved over plain passes, net of what they added."""
        return self.gain.get(sessions.bit_length(), 0.0)

    def observe_pass(self, sessions: int, rows: int, ms: float, accepted: int | None = None) -> None:
        """A pass of this many sessions and rows took `ms`, and its lookup chains had `accepted` tokens accepted (None:
        its trees were not the lookup's)."""
        key = sessions.bit_length()
        if rows == sessions:
            self.plain.setdefault(key, PassCost()).observe(rows, ms)
            return
        plain_ms = self._plain_ms(sessions)
        if plain_ms <= 0:  # a pass with chains before any plain one has nothing to be a multiple of
            return
        self.chained.setdefault(key, RelativeCost()).observe(rows, ms / plain_ms)
        if accepted is None:
            return
        net = accepted * plain_ms / sessions - (ms - plain_ms)
        self.gain[key] = self.gain.get(key, 0.0) * FORGET + net
        if key in self.exploring:
            self.exploring.discard(key)
            lost = self.backoff.get(key, 0) + 1
            self.backoff[key] = min(lost, MAX_EXPLORE_BACKOFF) if net < 0 else 0

    def _lines(self, sessions: int) -> tuple[tuple[float, float] | None, tuple[float, float] | None]:
        """The bucket's (ms at zero rows, ms a row) of plain passes and of passes with chains, the latter at
        today's plain pass; None where not measured enough."""
        key = sessions.bit_length()
        plain, chained = self.plain.get(key), self.chained.get(key)
        plain_line = plain.line() if plain and plain.sums[0] >= 2 else None
        multiple = chained.line() if chained and plain_line else None
        if multiple is None:
            return plain_line, None
        plain_ms = plain_line[0] + plain_line[1] * sessions
        return plain_line, (multiple[0] * plain_ms, multiple[1] * plain_ms)

    def _plain_ms(self, sessions: int) -> float:
        plain, _ = self._lines(sessions)
        return plain[0] + plain[1] * sessions if plain else 0.0

    def needed(self, sessions: int) -> float:
        """The chance of acceptance a chain's token needs in a pass of this many sessions: what a row adds to a pass
        with chains, against a plain pass's time a token (see the module's docstring)."""
        _, chained = self._lines(sessions)
        per_row, plain = (chained[1] if chained else 0.0), self._plain_ms(sessions)
        if per_row <= 0 or plain <= 0:
            return 0.0
        return min(MOST_NEEDED, per_row * sessions / plain)

    def pays(self, sessions: int, rows: int, expected: float) -> bool:
        """Whether `rows` chain rows with `expected` tokens accepted pay for a pass with chains over a plain one."""
        plain, chained = self._lines(sessions)
        if rows == 0 or plain is None or chained is None:
            return rows > 0  # nothing to weigh yet: chains are proposed, and teach what they cost
        plain_ms = plain[0] + plain[1] * sessions
        key = sessions.bit_length()
        added = chained[0] + chained[1] * (sessions + rows) - plain_ms
        if expected * plain_ms / sessions >= added and self.gained(sessions) >= 0:
            self.resting.pop(key, None)
            return True
        if self.resting.get(key) == 1:  # rested: explored, and what the exploration finds decides the next rest
            self.resting.pop(key)
            self.exploring.add(key)
            return True
        rest = EXPLORE_EVERY << self.backoff.get(key, 0)
        self.resting[key] = rest
        log.debug(
            "lookup rests %d passes at %d sessions: %d rows expected to save %.3f ms, add %.3f (plain %.3f ms, chained %.3f + %.4f a row; "
            "passes with chains gained %.3f ms)",
            rest,
            sessions,
            rows,
            expected * plain_ms / sessions,
            added,
            plain_ms,
            *chained,
            self.gained(sessions),
        )
        return False

    def for_pass(self, sessions: int) -> PassChains | None:
        """The pass's lookup, or None where no token could be worth its row (no confidence band's chance is enough),
        the bucket's lookup rests, or the bucket has not run the plain passes that passes with chains are measured
        against (its first three), so that no session looks anything up."""
        key = sessions.bit_length()
        if self._plain_ms(sessions) <= 0:
            return None
        if self.resting.get(key, 0) > 1:
            self.resting[key] -= 1
            return None
        needed = self.needed(sessions)
        if all(self.acceptance.chance(edge) < needed for edge in BANDS):
            return None
        return PassChains(self, sessions, needed)
