"""What a round costs, modelled: verification and drafting calls, profiled at start-up and followed online.

A round of n requests costs, by a cost model profiled at start-up and
followed online from the servers' reported compute times and the calls' wall
times,
    T(k) = verify_call + verify_scale * (verify_base + verify_per_session * n
                                         + verify_per_token * sum_i (f_i k_i + 1))
           + [any k_i > 0] * (draft_call + draft_base + draft_per_token * max_i k_i)
where f_i is the share of the positions it is asked for that request i's drafter
fills (router/drafter_choice.py `DraftFill`: 1 for a draft model, less for the
n-gram drafter, which proposes only where a suffix repeats), and the *_call
terms are what a call costs beyond the servers' compute (network,
serialisation, queueing): a round that drafts pays for one more call. What the
router does between its calls (routing, planning, merging trees, scoring
proposals) is no call's: each round's wall time is compared with what the model
expected of it, and each round that drafts also carries `drafting_extra`, what
rounds that draft take beyond the model against what plain rounds take beyond
it (`CostModel.observe_round`), a round-level term that is added to (or, measured
below zero, taken off) the whole drafting round, never making it cheaper than the
plain round of the same requests (`CostModel.drafting_round_ms`).
A verification pass pays per session (attention over its context, its share
of the bookkeeping) apart from per token fed. Folded into one per-token term
fitted through live passes, where tokens grow with sessions, a draft token
cost 0.6-0.9 ms on the demo target at 16 sessions a pass against the 0.35 ms
it adds, and k fell too far under load.
"""

from __future__ import annotations

from dataclasses import dataclass

from specfleet.config import SpeculationConfig

# How fast each plain round pulls the measured cost of drafting rounds toward plain rounds', against a drafting round's
# own pull (`CostModel.observe_round`).
STALE_PULL = 0.1

# The configured starting point's one default (specfleet/config/router.py), not a copy of it.
_CONFIGURED = SpeculationConfig()
# Until a draft call that caught sessions up is measured, a token of catch-up is taken to cost this share of a draft
# step: the tokens go through the model together, as a prefill, not one step each.
CATCH_UP_SHARE = 0.125
# A draft call whose sessions lacked this many tokens in all (beyond each one's last committed token) measures the
# catch-up's cost, not the steps': fewer ride in the call's base (`observe_draft`).
CATCH_UP_TOKENS = 16


class LinearFit:
    """y = base + slope * x by least squares over recent observations (older ones weigh less by
    `forget` per observation). Until the observed x spread apart, the slope keeps its prior and
    only the base follows the data."""

    def __init__(self, base: float, slope: float, forget: float):
        self.base, self.slope, self.forget = base, slope, forget
        self._sums = [0.0] * 5  # weight, x, y, xx, xy

    def observe(self, x: float, y: float) -> None:
        w, sx, sy, sxx, sxy = (v * self.forget for v in self._sums)
        self._sums = [w + 1, sx + x, sy + y, sxx + x * x, sxy + x * y]
        w, sx, sy, sxx, sxy = self._sums
        var = sxx * w - sx * sx
        if var > 1e-6 * w * w:  # enough spread in x to separate the two terms
            self.slope = max(0.0, (sxy * w - sx * sy) / var)
        # A slope the data cannot afford (it would make the base negative) is cut down to the mean.
        self.slope = min(self.slope, sy / sx) if sx > 0 else self.slope
        self.base = max(0.0, (sy - self.slope * sx) / w)


@dataclass
class CostModel:
    """Milliseconds. Starts from a guess (drafter ~1/8 of the target), then follows measurements.

    Verification: `fit_verify` sets base, per-session and per-token costs by least squares
    over passes timed at start-up at several batch sizes and depths (in online traffic the
    two are nearly proportional, so they cannot be told apart there); online, `verify_scale`
    follows the ratio of measured to modelled time (this machine's speed drifts, shared or
    contended).

    Drafting: a call's time is fitted online as base + per_token * depth * models by least
    squares over recent calls (`LinearFit`), where models is the number of distinct draft
    models in the call: a stacked step runs each one's layers in turn, so each costs its own
    step at every position. Its base (catching the sessions up on the few tokens committed
    since their last call, the call's own overhead) must not be charged per token: divided by
    a small depth it would make drafting look dear, the plan would draft less, and the next
    estimate would look dearer still. A session that decoded plainly for a while, or drafts for
    the first time, lacks its whole context: the call first feeds it that, at
    `draft_catch_up_per_token` a token (learned from the calls that do), which a probe pays
    for (`draft_catch_up_ms`, router/speculation.py): one that first catches four drafter
    sessions up on 100 tokens each costs a round several plain steps' time.
    """

    verify_base: float = _CONFIGURED.verify_base_ms
    verify_per_session: float = _CONFIGURED.verify_per_session_ms
    verify_per_token: float = _CONFIGURED.verify_per_token_ms
    draft_per_token: float = _CONFIGURED.draft_per_token_ms
    draft_base: float = _CONFIGURED.draft_base_ms
    verify_call: float = 1.0  # per call, beyond compute
    draft_call: float = 1.0
    verify_scale: float = 1.0  # measured over modelled verification compute, followed online
    # The same for the passes beyond the first of a call that decodes plain steps, followed apart: each such pass also
    # samples, commits and looks its sessions' contexts up, so one scale for both misjudges either, plain rounds then
    # look slower than modelled by more than drafting rounds do, and drafting looks cheap beside them
    # (`drafting_extra` below zero; docs/benchmarks/compare.md).
    steps_scale: float = 1.0
    # What a round that drafts takes beyond the model's prediction, against what a plain round takes beyond its own
    # (`observe_round`): the router's planning, scoring and merging, the drafter's replies waited for, contention.
    drafting_extra: float = 0.0
    # A draft call's time per token a session lacked (beyond its last committed token): None takes CATCH_UP_SHARE of
    # draft_per_token until such a call is measured (`observe_draft`).
    draft_catch_up_per_token: float | None = None
    forget: float = 0.97
    pinned: bool = _CONFIGURED.pin_cost_model  # keep the configured numbers

    @classmethod
    def configured(cls, settings: SpeculationConfig) -> CostModel:
        """The starting point the router's speculation section gives (router.verify_base_ms, ...)."""
        return cls(
            verify_base=settings.verify_base_ms,
            verify_per_session=settings.verify_per_session_ms,
            verify_per_token=settings.verify_per_token_ms,
            draft_per_token=settings.draft_per_token_ms,
            draft_base=settings.draft_base_ms,
            pinned=settings.pin_cost_model,
        )

    def __post_init__(self) -> None:
        self._draft = LinearFit(self.draft_base, self.draft_per_token, self.forget)
        if self.draft_catch_up_per_token is None:
            self.draft_catch_up_per_token = CATCH_UP_SHARE * self.draft_per_token
        self._caught = [0.0, 0.0]  # decayed sums over catch-up calls: tokens caught up, their ms beyond the steps
        # Per power of two of sessions a call: decayed sums over plain passes that asked for the verifier's lookup
        # (passes of a session, tokens the lookup proposed, tokens the target accepted of them): `observe_lookup`.
        self._looked_up: dict[int, list[float]] = {}
        self._residual: dict[bool, float] = {}  # drafted -> moving average of wall minus modelled round time

    def _verify_compute_ms(self, sessions: int, tokens: int) -> float:
        return self.verify_base + self.verify_per_session * sessions + self.verify_per_token * tokens

    def verify_ms(self, sessions: int, tokens: int) -> float:
        """One verification call over `sessions` sessions that feeds `tokens` tokens in all."""
        return self.verify_call + self.verify_scale * self._verify_compute_ms(sessions, tokens)

    def per_verified_token_ms(self) -> float:
        """What each token fed adds to a verification call (`verify_ms` is linear in its tokens)."""
        return self.verify_scale * self.verify_per_token

    def plain_steps_ms(self, steps: list[int]) -> float:
        """What the passes beyond the first add to a verify call whose plain sessions decode `steps` tokens each: the
        sessions that still decode take the next pass together, in the same call."""
        extra = [sum(1 for s in steps if s > j) for j in range(1, max(steps, default=1))]
        return sum(self.steps_scale * self._verify_compute_ms(m, m) for m in extra)

    def lookup_row_ms(self) -> float:
        """What a token the verifier's lookup proposes adds to a plain step's pass."""
        return self.steps_scale * self.verify_per_token

    def observe_lookup(self, sessions: int, passes: int, proposed: int, accepted: int) -> None:
        """A verify call of `sessions` sessions whose plain steps asked for the verifier's lookup (router.lookup_tokens)
        took `passes` session-passes in all, in which the lookup proposed `proposed` tokens and the target accepted
        `accepted` of them. Learned pinned or not: what the lookup finds is the traffic's, as acceptance is, not a
        cost."""
        if passes <= 0:
            return
        sums = self._looked_up.setdefault(sessions.bit_length(), [0.0, 0.0, 0.0])
        sums[:] = [v * self.forget + x for v, x in zip(sums, (passes, proposed, accepted))]

    def lookup_per_pass(self, sessions: int) -> tuple[float, float]:
        """What the verifier's lookup adds to a session's plain pass in a call of `sessions` sessions, as measured at
        about that many (`observe_lookup`): (tokens accepted, rows verified); none until measured."""
        passes, proposed, accepted = self._looked_up.get(sessions.bit_length(), (0.0, 0.0, 0.0))
        return (accepted / passes, proposed / passes) if passes > 0 else (0.0, 0.0)

    def plain_round(self, steps: list[int]) -> tuple[float, float]:
        """What a round whose requests decode `steps` tokens each plainly is expected to commit, and to take beyond its
        first pass: each step a token, and the lookup's tokens and rows in the steps of requests that decode several
        (router/verifying.py asks for lookup only there). Counted one token a pass, a plain round on text that repeats
        looks slower than it is, and the plan drafts where plain steps are faster."""
        gained, rows = self.lookup_per_pass(len(steps))
        looking = sum(s for s in steps if s > 1)
        return sum(steps) + gained * looking, self.plain_steps_ms(steps) + self.lookup_row_ms() * rows * looking

    def fit_verify(self, passes: list[tuple[int, int, float]]) -> None:
        """Base, per-session and per-token cost from timed passes (sessions, tokens, ms) by least
        squares. A term the passes cannot separate (singular), or make negative, is dropped and
        the others refitted; if nothing fits, the configured numbers stay."""
        if self.pinned or not passes:
            return
        terms = [0, 1, 2]  # base, per session, per token
        while terms:
            rows = [[(1.0, float(n), float(t))[j] for j in terms] for n, t, _ in passes]
            coef = _least_squares(rows, [ms for _, _, ms in passes])
            if coef is None:
                terms.remove(1 if 1 in terms else terms[-1])
            elif min(coef) < 0:
                terms.pop(coef.index(min(coef)))
            else:
                fitted = dict.fromkeys((0, 1, 2), 0.0) | dict(zip(terms, coef))
                self.verify_base, self.verify_per_session, self.verify_per_token = fitted[0], fitted[1], fitted[2]
                self.verify_scale = 1.0
                return

    def draft_ms(self, depth: int, models: int = 1) -> float:
        """One draft call `depth` tokens deep with `models` distinct draft models (none when nothing is drafted; a
        call whose drafters run no model, such as the n-gram drafter, costs its base alone)."""
        return self.draft_steps_ms(depth * models) if depth > 0 else 0.0

    def draft_steps_ms(self, steps: int) -> float:
        """One draft call that runs `steps` model steps in all (each distinct model's step at each of its positions)."""
        return self.draft_call + self.draft_base + self.draft_per_token * steps

    def drafting_round_ms(self, verifying: float, drafting: float, plain: float, overlap: bool = False) -> float:
        """A round that drafts: its verification and its draft call (overlapped, `plan`'s overlap: the slower side
        sets the pace) and what rounds that draft were measured to take beyond both (`drafting_extra`). The extra
        belongs to the round, as `observe_round` measures it, not to the draft call: measured below zero (the
        model's verification of drafted rows dearer than they are, a draft call partly hidden) it takes its share
        off the whole round. Never less than `plain`, the plain round of the same requests: more rows do not
        verify faster."""
        modelled = max(verifying, drafting) if overlap else verifying + drafting
        return max(plain, modelled + self.drafting_extra)

    def round_ms(self, ks: list[int]) -> float:
        if not ks:
            return 0.0
        plain = self.verify_ms(len(ks), len(ks))
        if max(ks) == 0:
            return plain
        return self.drafting_round_ms(self.verify_ms(len(ks), sum(k + 1 for k in ks)), self.draft_ms(max(ks)), plain)

    def observe_calls(self, draft_overhead_ms: float | None = None, verify_overhead_ms: float | None = None) -> None:
        """What a call cost beyond the server's compute (wall minus compute), as moving averages."""
        if self.pinned:
            return
        rate = (1 - self.forget) * 5
        if draft_overhead_ms is not None:
            self.draft_call += rate * (max(0.0, draft_overhead_ms) - self.draft_call)
        if verify_overhead_ms is not None:
            self.verify_call += rate * (max(0.0, verify_overhead_ms) - self.verify_call)

    def observe_round(self, modelled_ms: float, wall_ms: float, drafted: bool) -> None:
        """A round the model expected to take modelled_ms (`RoundPlan.modelled_ms`) took wall_ms. The model's calls
        leave out the router's own work between them, which a round that drafts has more of (routing, planning,
        merging trees, scoring proposals), so its drafting term takes the difference between what drafting rounds
        and plain rounds take beyond their predictions: moving averages of each, measured separately."""
        if self.pinned or wall_ms <= 0:
            return
        # A round stalled by something else on the machine (a collection, another process) says little about
        # rounds of its kind: one counts at most its modelled time beyond it, and the averages span dozens of rounds.
        residual = min(wall_ms - modelled_ms, modelled_ms)
        old = self._residual.get(drafted)
        self._residual[drafted] = residual if old is None else old + (1 - self.forget) * (residual - old)
        if not drafted and True in self._residual:
            # While the extra keeps every request decoding plainly, no round that drafts among its own kind measures it
            # again (a probe follows plain rounds and catches its drafters up), so plain rounds wear it down, a tenth
            # as fast as rounds that draft move it: drafting is tried again, and measured anew where it is.
            drafting, plain, pull = self._residual[True], self._residual[False], (1 - self.forget) * STALE_PULL
            self._residual[True] = drafting + pull * (plain - drafting)
        if len(self._residual) == 2:
            self.drafting_extra = self._residual[True] - self._residual[False]

    def observe_verify(self, sessions: int, tokens: int, compute_ms: float, passes: int = 1, rows: int = 0) -> None:
        """A verification call over `sessions` sessions whose first pass fed `tokens` tokens (prompts prefilled
        included: router/verifying.py `fed_tokens`) took compute_ms in `passes` forward passes (more than one where
        its sessions decoded plain steps: each further pass one token a session, and the `rows` the verifier's lookup
        proposed in them all). A call of one pass moves `verify_scale`; the passes beyond the first of the others, what
        the first is modelled to take taken off, move `steps_scale`."""
        first = self._verify_compute_ms(sessions, tokens)
        if self.pinned or sessions <= 0 or first <= 0:
            return
        rate = 1 - self.forget
        if passes <= 1:
            self.verify_scale += rate * (compute_ms / first - self.verify_scale)
            return
        rest = (passes - 1) * self._verify_compute_ms(sessions, sessions) + self.verify_per_token * rows
        if rest > 0:
            beyond = max(0.0, compute_ms - self.verify_scale * first)
            self.steps_scale += rate * (beyond / rest - self.steps_scale)

    def draft_catch_up_ms(self, tokens: int) -> float:
        """What a draft call spends feeding a session `tokens` tokens it lacked beyond its last committed one."""
        return self.draft_catch_up_per_token * tokens if tokens > 0 else 0.0

    def observe_draft(self, depth: int, compute_ms: float, models: int = 1, caught_up: int = 0) -> None:
        """One draft call `depth` tokens deep with `models` distinct draft models took compute_ms, its sessions first
        fed `caught_up` tokens in all that they lacked beyond their last committed ones. A call that caught up
        CATCH_UP_TOKENS or more measures the catch-up's cost per token (its time beyond the steps'); the others, the
        steps' (a few tokens ride in the call's base)."""
        if self.pinned or depth == 0:
            return
        if caught_up >= CATCH_UP_TOKENS:
            beyond = max(0.0, compute_ms - self.draft_base - self.draft_per_token * depth * models)
            tokens, ms = (v * self.forget for v in self._caught)
            self._caught = [tokens + caught_up, ms + beyond]
            self.draft_catch_up_per_token = self._caught[1] / self._caught[0]
            return
        self._draft.observe(depth * models, compute_ms)
        self.draft_base, self.draft_per_token = self._draft.base, self._draft.slope


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """The coefficients minimising sum (row . c - y)^2 (normal equations, Gaussian elimination);
    None when the rows do not determine them."""
    m = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(m)] + [sum(r[i] * y for r, y in zip(rows, ys))] for i in range(m)]
    for col in range(m):
        pivot = max(range(col, m), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) < 1e-9 * max(1.0, abs(a[col][col])):
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(m):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    return [a[i][m] / a[i][i] for i in range(m)]
