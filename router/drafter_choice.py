"""Who drafts for each request of a round, beyond routing's ranking: the round's expected goodput decides.

Routing (router/routing.py) ranks each request's drafters by their sampled acceptance. Two decisions weigh that
against what the round costs (router/cost_model.py `CostModel`), each by the round's expected goodput, tokens
committed per millisecond:

- `consolidate` moves requests onto fewer distinct draft models: a drafter service runs each distinct model's
  layers in turn at every position of a stacked step, so every model a round adds costs a step per position.
- `cooperate` gives a request helpers, drafters after its lead whose proposals join its tree (fusion): a helper
  on the lead's service drafts in lockstep (siblings of the main branch), one on another service drafts a chain
  of its own, concurrently. A helper pays where the tokens it is expected to add (`fused_tokens`) outweigh the
  verifier's extra tree rows and, where it adds a model to its service's step, that step at every position.

`fused_tokens` assumes drafters err independently, which overstates what a helper adds where drafters miss the
same hard tokens: `FusionGain` measures what helpers add in the rounds that had them against what was expected,
and `cooperate` scales its expectation by that. Routing's acceptance overstates what the leads it favours gain (they
lead where their posteriors are high): `AcceptanceScale` measures each drafter's leads against it, and every
decision here and in the plan weighs the acceptance scaled by that.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Iterable


def most_models(chosen: list[list[str]], services: dict, free: frozenset[str] = frozenset()) -> int:
    """The most distinct draft models any one drafter service runs for these requests' drafters (`free`: drafters
    that run no model, such as the n-gram drafter, which cost no step)."""
    per_service: dict[int, set[str]] = collections.defaultdict(set)
    for drafters in chosen:
        for drafter in drafters:
            if drafter not in free:
                per_service[id(services[drafter])].add(drafter)
    return max((len(models) for models in per_service.values()), default=0)


def fill_rate(fill) -> Callable[[str], float]:
    """Each drafter's rows per position asked, by `fill` (a `DraftFill`); without one, a full row at every position."""
    return fill.rate if fill is not None else (lambda drafter: 1.0)


# A drafter's hope is its posterior mean acceptance plus this many standard deviations (`upper_acceptance`).
HOPE_SD = 2.0


def upper_acceptance(accepted: float, rejected: float) -> float:
    """The best per-token acceptance a drafter's Beta(accepted, rejected) posterior leaves plausible: its mean plus
    HOPE_SD standard deviations, below 1. Wide where the evidence is thin (a new request, a drafter seldom tried),
    near the mean where it is thick, so probing stops where no outcome it could plausibly find would make drafting pay."""
    n = accepted + rejected
    mean = accepted / n
    return min(AcceptanceScale.MOST, mean + HOPE_SD * math.sqrt(mean * (1 - mean) / (n + 1)))


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a round commits for a request drafting k tokens, each accepted with probability `acceptance`."""
    return sum(acceptance**i for i in range(k + 1))


def consolidate(
    chosen: list[list[str]],
    means: list[dict[str, float]],
    bounds: list[int],
    services: dict,
    cost,
    usable: Iterable[str] = (),
    free: frozenset[str] = frozenset(),
    fill=None,
) -> list[list[str]]:
    """Fewer distinct draft models in the round, where that raises its expected goodput.

    A drafter service runs each distinct model's layers in turn at every position of a stacked step, so each model
    a round adds costs a step per position (`CostModel.draft_ms`), while a request moved to the best of the models
    that stay loses only the difference in expected tokens (`means`: each drafter's expected acceptance for the
    request). Models leave one at a time, the one whose leaving raises goodput most, while one does. A model of
    `usable` that no request leads with may also take every request at once: four requests routed to four
    specialists can be served better by the general drafter alone than by any three of them. Requests whose
    drafters cooperate (fusion) keep theirs, and so do the models they use."""
    chosen = [list(drafters) for drafters in chosen]
    depth, n = max(bounds, default=0), len(chosen)
    # A plan weighs dozens of trials, later passes many of the same, so what they share is kept: each drafter's
    # share of its positions filled (DraftFill) and service (None: model-free), its expected tokens per request as
    # asked for, the drafting term per count of distinct models, and each assignment's goodput.
    rate = fill_rate(fill)
    rates = {d: rate(d) for d in set().union(*means)}
    service_of: dict[str, int | None] = {}
    table: list[dict[str, float]] = [{} for _ in chosen]
    draft_ms: dict[int, float] = {}
    weighed: dict[tuple, float] = {}
    plain = cost.verify_ms(n, n)  # the same requests decoded plainly: no round that drafts is modelled below it

    def goodput(assignment: list[list[str]]) -> float:
        key = tuple(map(tuple, assignment))
        if key not in weighed:
            weighed[key] = _goodput(assignment)
        return weighed[key]

    def _goodput(assignment: list[list[str]]) -> float:
        tokens, rows, per_service = 0.0, 0.0, {}
        for i, ds in enumerate(assignment):
            if not ds:
                tokens += 1.0
                continue
            lead = ds[0]
            known = table[i].get(lead)
            if known is None:
                known = table[i][lead] = expected_tokens(means[i][lead], bounds[i])
            tokens += known
            rows += bounds[i] * rates[lead]
            for d in ds:
                if d not in service_of:
                    service_of[d] = None if d in free else id(services[d])
                if service_of[d] is not None:
                    per_service.setdefault(service_of[d], set()).add(d)
        models = max(map(len, per_service.values()), default=0)
        if models not in draft_ms:
            draft_ms[models] = cost.draft_ms(depth, models)
        return tokens / cost.drafting_round_ms(cost.verify_ms(n, n + rows), draft_ms[models], plain)

    fused = {d for drafters in chosen if len(drafters) > 1 for d in drafters}
    while True:
        best, best_goodput = None, goodput(chosen)
        leads = {d[0] for d in chosen if len(d) == 1}
        for model in sorted(leads - fused):
            rest = sorted(leads - {model} | fused)
            if not rest:
                continue
            trial = [[max(rest, key=means[i].get)] if d == [model] else d for i, d in enumerate(chosen)]
            trial_goodput = goodput(trial)
            if trial_goodput > best_goodput:
                best, best_goodput = trial, trial_goodput
        for model in sorted(set(usable) - leads - fused):
            trial = [[model] if len(d) == 1 else d for d in chosen]
            trial_goodput = goodput(trial)
            if trial_goodput > best_goodput:
                best, best_goodput = trial, trial_goodput
        if best is None:
            return chosen
        chosen = best


def modelled_round_ms(
    drafters: list[list[str]], depths: list[list[int]], services: dict, cost, overlap: bool, free: frozenset[str] = frozenset(), fill=None
) -> float:
    """What the cost model expects a round to take whose requests draft with `drafters` (per request, lead first;
    none: plain) to `depths`, as `cooperate` weighs it: every request's root and the rows its drafters are expected
    to fill verified in one pass, and each drafter service's step running each distinct model through the round's
    deepest lead position, a helper's model through its own depth. Without `drafting_extra` (`CostModel.observe_round`)."""
    rate = fill_rate(fill)
    rows = len(drafters) + sum(depth * rate(d) for ds, dps in zip(drafters, depths) for d, depth in zip(ds, dps))
    deepest = max((dps[0] for dps in depths if dps), default=0)
    steps: dict[int, dict[str, int]] = collections.defaultdict(dict)
    for ds, dps in zip(drafters, depths):
        for j, (d, depth) in enumerate(zip(ds, dps)):
            if d not in free:
                per_model = steps[id(services[d])]
                per_model[d] = max(per_model.get(d, 0), deepest if j == 0 else depth)
    verifying = cost.verify_ms(len(drafters), rows)
    if deepest == 0:
        return verifying
    drafting = cost.draft_steps_ms(max((sum(m.values()) for m in steps.values()), default=0))
    return max(verifying, drafting) if overlap else verifying + drafting


def fused_tokens(lead: float, k: int, helpers: list[tuple[float, int, bool]]) -> float:
    """Tokens a round commits for a request whose lead drafts k tokens, each accepted with probability `lead`,
    helped by `helpers`: (acceptance, depth, lockstep) each, drafting the first `depth` positions.

    The round commits one token more than the longest accepted path of its tree, so it commits at least i + 1
    where some path of length i is accepted. Such a path is the main branch through position i - 1 with the main
    token or a lockstep helper's sibling accepted at i, or a chain helper's own chain through i (i <= its depth).
    Drafters erring independently, 1 + sum_i [1 - (1 - lead^(i-1) (1 - (1 - lead) prod_siblings (1 - a_s)))
    prod_chains (1 - a_c^i)]. Without helpers this is `expected_tokens(lead, k)`."""
    total = 1.0
    for i in range(1, k + 1):
        sibling_misses = math.prod(1 - a for a, depth, lockstep in helpers if lockstep and depth >= i)
        on_main = lead ** (i - 1) * (1 - (1 - lead) * sibling_misses)
        chain_misses = math.prod(1 - a**i for a, depth, lockstep in helpers if not lockstep and depth >= i)
        total += 1 - (1 - on_main) * chain_misses
    return total


class FusionGain:
    """What helpers add, measured: tokens the trees of rounds with helpers committed beyond what their leads' own
    proposals would have (`observe`), against the `fused_tokens` gain expected of them, as decayed sums. Its
    `efficiency` starts at PRIOR, a guess worth PRIOR_WEIGHT expected tokens, so a few lucky rounds do not decide.
    Helpers are measured only in rounds that have them: where none pays, none is tried, and nothing is spent
    exploring (issue 27: exploration must not cost more than it finds)."""

    PRIOR = 0.5
    PRIOR_WEIGHT = 2.0

    def __init__(self, forget: float = 0.98):
        self.forget = forget
        self.expected = 0.0
        self.added = 0.0

    def observe(self, expected: float, added: float) -> None:
        self.expected = self.expected * self.forget + expected
        self.added = self.added * self.forget + added

    @property
    def efficiency(self) -> float:
        """Tokens helpers add per token `fused_tokens` expects of them."""
        return (self.PRIOR * self.PRIOR_WEIGHT + self.added) / (self.PRIOR_WEIGHT + self.expected)


class DraftFill:
    """How much of what it is asked for each drafter proposes: proposed tokens per position asked, as decayed sums
    per drafter, starting from a full draft (PRIOR_ASKED positions' worth). A draft model proposes every position;
    the n-gram drafter only where a suffix of the context occurred before, so its rounds verify fewer tree rows
    than it was asked for, and a round's plan charges it the rows it is expected to fill."""

    PRIOR_ASKED = 8.0

    def __init__(self, forget: float = 0.99):
        self.forget = forget
        self._sums: dict[str, tuple[float, float]] = {}  # drafter -> (proposed, asked)

    def observe(self, drafter: str, proposed: int, asked: int) -> None:
        old_proposed, old_asked = self._sums.get(drafter, (0.0, 0.0))
        self._sums[drafter] = (old_proposed * self.forget + proposed, old_asked * self.forget + asked)

    def rate(self, drafter: str) -> float:
        """Tokens the drafter is expected to propose per position it is asked for, in (0, 1]."""
        proposed, asked = self._sums.get(drafter, (0.0, 0.0))
        return min(1.0, (self.PRIOR_ASKED + proposed) / (self.PRIOR_ASKED + asked))


def cooperate(
    ranked: list[list[str]],
    ks: list[int],
    means: list[dict[str, float]],
    services: dict,
    cost,
    fusion_depth: int = 0,
    overlap: bool = False,
    efficiency: float = 1.0,
    free: frozenset[str] = frozenset(),
    fill=None,
) -> tuple[list[list[str]], list[float]]:
    """Helpers for the round's requests where they raise its expected goodput.

    ranked: per request its lead, then the helpers it may have, in routing order; ks: each lead's planned k (0:
    the request decodes plainly and gets no helper); means: each drafter's expected acceptance for the request.
    A helper drafts the first fusion_depth positions (0: all k). Returns per request its drafters (the lead, then
    the helpers taken, in routing order) and the tokens `fused_tokens` expects the helpers to add (unscaled).

    Greedily, while the round's goodput rises: for each drafter that is some request's next helper, the requests
    it would help, best gain per tree row first, and of those the prefix that raises goodput most (a model new to
    its service costs its step once, however many requests it helps); the best drafter's prefix is taken."""
    n = len(ranked)
    taken = [d[:1] if k > 0 and d else [] for d, k in zip(ranked, ks)]
    gains = [0.0] * n
    depth = max(ks, default=0)
    if depth == 0:
        return taken, gains
    # Per drafter service, its models' steps: a lead's model steps through the round's depth, a helper's model
    # through the deepest position it drafts for any request (router/cost_model.py `CostModel.draft_steps_ms`).
    steps: dict[int, dict[str, int]] = collections.defaultdict(dict)
    for drafters in taken:
        for drafter in drafters:
            if drafter not in free:
                steps[id(services[drafter])][drafter] = depth
    expected = [expected_tokens(means[i][d[0]], ks[i]) if d else 1.0 for i, d in enumerate(taken)]
    rate = fill_rate(fill)
    tokens = sum(expected)
    rows = sum(1 + (k * rate(d[0]) if d else 0) for d, k in zip(taken, ks))

    plain = cost.verify_ms(n, n)

    def round_ms(rows: float, busiest: int) -> float:
        return cost.drafting_round_ms(cost.verify_ms(n, rows), cost.draft_steps_ms(busiest), plain, overlap)

    def depth_of(i: int) -> int:
        return min(fusion_depth or ks[i], ks[i])

    def helped(i: int, drafters: list[str]) -> float:
        lead = services[drafters[0]]
        helpers = [(means[i][h], depth_of(i), services[h] is lead) for h in drafters[1:]]
        return fused_tokens(means[i][drafters[0]], ks[i], helpers)

    goodput = tokens / round_ms(rows, max((sum(m.values()) for m in steps.values()), default=0))
    while True:
        offers: dict[str, list[tuple[float, int, int, float]]] = collections.defaultdict(list)  # helper -> (gain, depth, i, fused)
        for i, drafters in enumerate(taken):
            following = [h for h in ranked[i][1:] if h not in drafters] if drafters else []
            if following:
                fused = helped(i, drafters + following[:1])
                gain = efficiency * (fused - expected[i])
                if gain > 0:
                    offers[following[0]].append((gain, depth_of(i), i, fused))
        best = None
        for helper, offer in sorted(offers.items()):
            home = id(services[helper])
            others = max((sum(m.values()) for key, m in steps.items() if key != home), default=0)
            mine, before = sum(steps[home].values()), steps[home].get(helper, 0)
            offer.sort(key=lambda o: o[0] / o[1], reverse=True)  # best gain per position first
            trial_tokens, trial_rows, helper_steps = tokens, rows, before
            for count, (gain, helper_depth, _, _) in enumerate(offer, start=1):
                # Its tree rows: the positions it drafts, times what it is expected to fill of them.
                trial_tokens, trial_rows = trial_tokens + gain, trial_rows + helper_depth * rate(helper)
                if helper not in free:
                    helper_steps = max(helper_steps, helper_depth)
                trial_goodput = trial_tokens / round_ms(trial_rows, max(others, mine - before + helper_steps))
                if trial_goodput > (best[0] if best else goodput):
                    best = (trial_goodput, helper, offer[:count], helper_steps, trial_tokens, trial_rows)
        if best is None:
            return taken, gains
        goodput, helper, offer, helper_steps, tokens, rows = best
        if helper not in free:
            steps[id(services[helper])][helper] = helper_steps
        for _, _, i, fused in offer:
            taken[i].append(helper)
            gains[i] += fused - expected[i]
            expected[i] = fused


class AcceptanceScale:
    """What a lead's drafts deliver against what routing predicted of them, per drafter: the factor c on its predicted
    per-token acceptance a that makes the rounds it led expected to gain what they did, sum over rounds of
    sum_{j<=k} (c a)^j = its hits there.

    Routing's posteriors are right about the evidence they hold, but a lead is chosen where its posterior is high,
    and a request's own rounds weigh 16 tokens each, so the drafter that leads is the one its last lucky rounds
    favour, and its acceptance is overestimated (the winner's curse): on text no build read, the specialists' leads
    gained 0.4-0.8 of the tokens expected of them, the n-gram drafter's and the general drafter's 0.97-1.14.
    Decayed sums per drafter (an older round weighs `forget` times less per newer one it led), and a prior worth
    PRIOR_ROUNDS rounds of acceptance 0.5 at c = 1, so a few rounds do not decide."""

    PRIOR_ROUNDS = 4.0
    LOW, HIGH = 0.25, 2.0  # c stays within these
    MOST = 0.99  # a scaled acceptance stays below 1: the plan's expected tokens stay finite

    def __init__(self, forget: float = 0.99):
        self.forget = forget
        self._sums: dict[str, tuple[float, list[float]]] = {}  # drafter -> (hits, per position j: sum of a^j)
        self._scales: dict[str, float] = {}

    def observe(self, drafter: str, acceptance: float, k: int, hits: int) -> None:
        """A round `drafter` led, drafting k positions at predicted acceptance `acceptance`, gained `hits` tokens."""
        if k <= 0:
            return
        old_hits, old_powers = self._sums.get(drafter, (0.0, []))
        powers = [p * self.forget for p in old_powers] + [0.0] * max(0, k - len(old_powers))
        for j in range(k):
            powers[j] += acceptance ** (j + 1)
        self._sums[drafter] = (old_hits * self.forget + hits, powers)
        self._scales.pop(drafter, None)

    def scale(self, drafter: str) -> float:
        """c for the drafter (1 until it has led a round): sum_j c^j P_j is increasing in c, so bisection finds it."""
        if drafter not in self._sums:
            return 1.0
        if drafter not in self._scales:
            hits, powers = self._sums[drafter]
            prior = 0.5 * self.PRIOR_ROUNDS  # rounds of one position at acceptance 0.5, gaining 0.5 each
            powers = [powers[0] + prior, *powers[1:]]
            low, high = self.LOW, self.HIGH
            for _ in range(30):
                mid = (low + high) / 2
                if sum(p * mid ** (j + 1) for j, p in enumerate(powers)) < hits + prior:
                    low = mid
                else:
                    high = mid
            self._scales[drafter] = (low + high) / 2
        return self._scales[drafter]

    def scaled(self, drafter: str, acceptance: float) -> float:
        """The drafter's acceptance as the plan weighs it: routing's, times what its leads were measured to gain."""
        return min(self.MOST, acceptance * self.scale(drafter))
