"""Adaptive speculation length: how many tokens each request drafts this round, down to none.

A round's cost comes from the cost model (router/cost_model.py `CostModel`).

Request i is expected to gain E_i(k_i) = 1 + a_i + a_i^2 + ... + a_i^k_i
tokens, where a_i is its predicted per-token acceptance. The plan maximises
goodput, sum_i E_i / T (SmartSpec's idea): the next draft token goes to the
request whose next token is most likely accepted (gain a_i^(k_i + 1)), as
long as that raises goodput. So k grows with acceptance and falls with load, and is 0 when drafting costs
more than it returns. The drafting term depends only on the deepest draft, so
the plan tries each depth D and, for that D, adds draft tokens in order of
gain while they raise goodput. A request planned at k = 0 still drafts one token now
and then (a probe), so its acceptance estimate can recover; every such request of a
round probes in it, so the round's draft call, its plan's routing and its wider pass
are paid once for all of them, not once per request. Probes are exploration, paid
for by the rounds around them: a probe round comes once the rounds planned since the
last one were modelled to take 1 / `probe_share` times what it is modelled to lose
(its time beyond what its tokens take at the planned round's goodput), so probing
costs at most that share of the time, whether the round it replaces is one plain
token a request or plain steps that commit 16 tokens for four requests on one core,
where a probe round commits 6-7. A probe that rides in a round that drafts anyway
costs only its rows, and comes almost every round.
A probe that the plan drafts after has paid; one after which it drafts for nobody has found
nothing, and each such probe in a row at a load halves the share probes may lose there (down to
1 / 2^MAX_FRUITLESS_PROBES of it), so exploration costs less the longer it finds nothing and its
full share returns with the first round the plan drafts in.
A probe is worth its price only where what it may find could make the plan draft: a
request probes only if the plan would draft for it at its hope, the best acceptance
its evidence leaves plausible (`could_draft`), and a round in which that plan drafts
for nobody is not routed at all (router/planning.py).

The model's prediction is then checked against what rounds deliver
(`MeasuredGoodput`, router/measured_goodput.py). The model leaves costs out (the router's own work per
round, serialisation, a drafter slower in traffic than profiled, contention),
and with them it drafted where plain decoding was faster: 0.82x the tokens/s of
speculation off at 1 client and 0.69x at 16 on an H200 with a small target,
0.85x on the 2-core CPU machine at 4 clients, with 2.4-3.0 tokens a round. So
the controller measures tokens committed per request per millisecond of round
wall time at comparable load (requests running), in the two ways a round can
go: speculating (the plan routes the round's requests and drafts, probes, or
keeps them all at k = 0; specialists score the new prompts beside it) and
plain decoding (the check sends the round to k = 0 for all, unrouted, as
cheaply as speculation off). Every cost of speculating is in its rounds:
rounds it plans at k = 0 pay for the plan, probes for their draft calls, new
prompts for their scoring. Judged by whether a round drafted, those costs
would fall on plain decoding's side or on neither, and the check would keep
speculating where it loses to speculation off (docs/benchmarks/plan-cost.md).
While speculating delivers less than plain decoding every request decodes
plainly. "Less" means beyond the
measurements' noise (two standard errors of the difference): a round that
drafts commits 1 to k + 1 tokens a request, and judged by point estimates, a
few unlucky rounds sent every request to plain decoding for `remeasure_every`
rounds, so that at one client the default drafted in about a quarter of its rounds and
served 0.82-0.87x what drafting in all of them served. Whichever way it decodes,
once every `remeasure_every` rounds at a load it decodes the other way, so both
measurements stay current and it returns to speculating when that pays again
(`remeasure_every: 0` turns the check off); while speculating keeps losing, the
remeasures grow apart (`MAX_REMEASURE_BACKOFF`), until one finds it ahead; a
load's first rounds measure plain decoding more often (`WARM_ROUNDS`).
Only rounds run among rounds of their own way are measured (the scheduler
says which: router/rounds.py `LaneKinds`). Times are passed in
(`observe_round`): the decision reads no clock.

Within a round the drafter may stop early (SpecDec++): it is told to stop once
the product of its own confidences, its estimate that every token so far is
accepted, falls below `stop_below`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from router.cost_model import CostModel
from router.drafter_choice import AcceptanceScale, DraftFill, FusionGain, expected_tokens
from router.measured_goodput import MeasuredGoodput
from specfleet.config import SpeculationConfig

# While speculating keeps losing at a load, the rounds between its remeasures double with each remeasure that finds it
# slower still, up to this many times `remeasure_every`: a remeasure costs several plain rounds (its drafters catch up
# on the whole context, and at four clients on one core the router's event loop takes several times an unrouted
# round's time), so where speculating keeps losing they come seldom (docs/benchmarks/measured-ways.md,
# docs/benchmarks/default-against-plain.md).
MAX_REMEASURE_BACKOFF = 16
# Until plain decoding has WARM_ROUNDS measured rounds at a load, it is measured WARM_SPLIT times as often as
# `remeasure_every` says: a bench pass, or a burst at a load not seen before, lasts tens of rounds, and measured once
# per `remeasure_every` rounds plain decoding would take hundreds to give the check a spread to judge by
# (docs/benchmarks/default-against-plain.md). Where speculating pays, a load's first rounds lose what their plain
# ones are slower, once.
WARM_ROUNDS, WARM_SPLIT = 8, 8
# Probes in a row at a load after which the plan drafted for nobody halve the share probes may lose there, at most this
# many times: at four clients on one core, where drafting seldom pays, a probe round with its drafters' catch-up
# commits a third of what a plain round's time does (docs/benchmarks/compare.md).
MAX_FRUITLESS_PROBES = 4


@dataclass
class SpeculationController:
    cost: CostModel
    # The router's speculation section (adaptive_speculation, stop_below_confidence), replaced whole on reload.
    settings: SpeculationConfig = field(default_factory=SpeculationConfig)
    # Below this predicted acceptance a request does not draft (but probes): costs the model
    # leaves out (network, the router's own work) outweigh so small a gain.
    min_acceptance: float = 0.1
    # The share of the modelled round time that probes may lose against the rounds they replace (module docstring).
    probe_share: float = 0.05
    # The modelled time of the rounds routed since the last probe round (`plan`, `planned_plainly`).
    since_probe_ms: float = 0.0
    # What rounds deliver with drafting and without; kept across reloads (dataclasses.replace).
    measured: MeasuredGoodput = field(default_factory=MeasuredGoodput)
    # What helpers add against what was expected of them, and how much of what it is asked for each drafter
    # proposes (router/drafter_choice.py); kept across reloads too.
    fusion_gain: FusionGain = field(default_factory=FusionGain)
    fill: DraftFill = field(default_factory=DraftFill)
    # What each drafter's leads gained against what routing predicted of them; kept across reloads too.
    acceptance_scale: AcceptanceScale = field(default_factory=AcceptanceScale)
    # Per load: remeasures in a row after which speculating still lost, and the loads whose remeasure is under way
    # (`speculates`); kept across reloads too.
    lost_in_a_row: dict[int, int] = field(default_factory=dict)
    remeasures: set[int] = field(default_factory=set)
    # Per load: probe rounds since the plan last drafted (`plan`), which shrink the probes' share (`_probe`).
    fruitless_probes: dict[int, int] = field(default_factory=dict)

    @property
    def adaptive(self) -> bool:
        return self.settings.adaptive_speculation

    @property
    def stop_below(self) -> float:
        """Drafters stop once their confidence falls below it (0: never)."""
        return self.settings.stop_below_confidence

    def observe_round(
        self,
        sessions: int,
        tokens: int,
        wall_ms: float,
        speculated: bool,
        clean: bool = True,
        running: int | None = None,
        drafted: bool = False,
    ) -> None:
        """A round of `sessions` requests committed `tokens` tokens in all and took wall_ms (measured by the
        caller), with `running` requests in the router (default: its own), for the measured check. speculated: the
        plan routed it (`RoundPlan.routed`: drafting, probing or every request at k = 0), not one the check sent to
        plain decoding. clean: it ran among rounds of its own way (router/rounds.py `LaneKinds`); only clean rounds
        count. drafted: some request drafted or probed in it."""
        self.measured.observe(running or sessions, sessions, tokens, wall_ms, speculated, clean, drafted)
        load = self.measured.load(running or sessions)
        if speculated and clean and tokens > 0 and wall_ms > 0 and load in self.remeasures:
            # A remeasure that finds speculating ahead of plain decoding in its own round brings the next ones back to
            # every `remeasure_every` rounds, so that the way back takes a few of them, not a few times the backoff.
            self.remeasures.discard(load)
            plain = self.measured.goodput(running or sessions, speculated=False)
            if plain is not None and tokens / sessions / wall_ms >= plain:
                self.lost_in_a_row.pop(load, None)
            elif self.measured.speculating_loses(running or sessions):
                self.lost_in_a_row[load] = min(self.lost_in_a_row.get(load, 0) + 1, MAX_REMEASURE_BACKOFF)

    def observe_modelled(self, modelled_ms: float | None, wall_ms: float, drafted: bool, clean: bool = True, tokens: int = 1) -> None:
        """A round the cost model expected to take modelled_ms (`RoundPlan.modelled_ms`; None: no model weighed it) took
        wall_ms and committed `tokens`. drafted: some request drafted. clean: it ran among rounds that drafted as it did,
        with no prompt scored beside it; only clean rounds that committed something teach the model."""
        if clean and modelled_ms is not None and tokens > 0:
            self.cost.observe_round(modelled_ms, wall_ms, drafted)

    def planned_plainly(self, plain_steps: list[int]) -> None:
        """A routed round the plan was not asked for (router/planning.py: no request hopeful, or none that might draft
        or probe at its best drafter): its modelled time, its requests decoding `plain_steps` tokens each, counts
        towards the next probe like a round the plan keeps at k = 0."""
        self.since_probe_ms += self._round([0] * len(plain_steps), [0.0] * len(plain_steps), False, 1, None, plain_steps)[1]

    def scoring_pays(self, running: int) -> bool:
        """Whether the specialists spend a prefill each on a new prompt at this load (the likelihood prior,
        router/routing.py): only where speculating is measured ahead of plain decoding beyond the measurements' noise.
        Scoring buys better drafting, which pays only where drafting does; until both ways are measured (a cold start),
        where they are level (rounds the plan routes but drafts in for nobody deliver what plain ones do, and a prefill
        by every specialist costs a new prompt's round several plain rounds), and while speculating is behind, the
        exemplars place the prompt; so they do where speculating's recent rounds drafted for nobody (`drafted_lately`):
        those were plain rounds the plan routed, ahead of plain decoding's by chance. With the measured check off
        (`remeasure_every: 0`) or speculation not adaptive, every prompt is scored."""
        if not self.adaptive or self.settings.remeasure_every == 0:
            return True
        return self.measured.speculating_wins(running) and self.measured.drafted_lately(running)

    def speculates(self, running: int) -> bool:
        """Whether a round, with this many requests running, speculates (True: routed, drafting as planned) or decodes
        plainly, k = 0 for all and unrouted."""
        every = self.settings.remeasure_every
        if every == 0:
            return True  # the measured check is off: draft as the cost model plans
        if self.measured.speculating_loses(running):
            # Measured slower than plain decoding: decode plainly, speculating now and then to see whether it pays again,
            # the longer apart the more remeasures in a row found it slower still (each costs its rounds).
            load = self.measured.load(running)
            backoff = min(2 ** self.lost_in_a_row.get(load, 0), MAX_REMEASURE_BACKOFF)
            due = self.measured.rounds_since(running, speculated=True) >= every * backoff
            if due:
                self.remeasures.add(load)
            return due
        # Speculating pays, or is not measured yet: draft as planned, decoding plainly now and then to keep measuring that,
        # more often while plain decoding has few measured rounds at this load.
        if self.measured.rounds_measured(running, speculated=False) < WARM_ROUNDS:
            every = max(1, every // WARM_SPLIT)
        return self.measured.rounds_since(running, speculated=False) < every

    def plan(
        self,
        acceptance: list[float],
        max_draft_tokens: list[int],
        overlap: bool = False,
        running: int | None = None,
        models: int = 1,
        fill: list[float] | None = None,
        plain_steps: list[int] | None = None,
        hopeful: list[bool] | None = None,
        catch_up: list[float] | None = None,
        remaining: list[int] | None = None,
    ) -> list[int]:
        """Draft lengths (num_draft_tokens) for one round's requests, from each one's acceptance a_i and
        max_draft_tokens.

        overlap: another group's verification runs while this group drafts (pipelined lanes
        with work in more than one), so a round lasts max(draft, verify), not their sum.
        running: requests running in the router, all lanes (default: this round's).
        models: the most distinct draft models any one drafter service runs this round.
        fill: per request, the tree rows its drafter fills per position asked (router/drafter_choice.py `DraftFill`;
        default 1: a draft model proposes every position).
        plain_steps: per request, the tokens it decodes in the round if nobody drafts (router/rounds.py
        `plain_steps`; default 1): drafting must beat that round's goodput, not one token a request's.
        hopeful: per request, whether the plan could draft for it at the best acceptance its evidence leaves
        plausible (`could_draft`); a request left at k = 0 probes only if so (default: every request may probe).
        catch_up: per request, what the draft call spends feeding its drafter the tokens it lacks, should it draft
        (`CostModel.draft_catch_up_ms`; default none). A probe pays for it: a request that decoded plainly for a
        while lacks its whole context, and a probe is one round's exploration. Drafting pays for the share of it that
        the round's tokens are of the tokens the request may still produce (`remaining`, per request; default: none
        of it): a catch-up buys the drafts of the rounds after, and there are few of those near a request's end,
        where drafting a token or two of a plain round's last steps took a whole context's catch-up on one core.
        The round's modelled time counts all of it.
        """
        if not self.adaptive:
            return list(max_draft_tokens)
        n = len(max_draft_tokens)
        if n and not self.speculates(running or n):
            return [0] * n  # plain decoding for everyone: drafting measured slower (module docstring)
        args = (acceptance, overlap, models, fill, plain_steps, catch_up)
        shares = _catch_up_shares(catch_up, max_draft_tokens, remaining)
        ks = self._best_ks(acceptance, max_draft_tokens, overlap, models, fill, plain_steps, shares)
        planned, load, drafts = self._round(ks, *args), self.measured.load(running or n), any(ks)
        if drafts:
            self.fruitless_probes.pop(load, None)  # what the probes before it looked for
        if (probe := self._probe(ks, planned, max_draft_tokens, hopeful, args, load)) is not None:
            (ks, planned), self.since_probe_ms = probe, 0.0
            if not drafts:
                self.fruitless_probes[load] = min(self.fruitless_probes.get(load, 0) + 1, MAX_FRUITLESS_PROBES)
        self.since_probe_ms += planned[1]
        return ks

    def might_draft(
        self,
        acceptance: list[float],
        max_draft_tokens: list[int],
        overlap: bool = False,
        models: int = 1,
        fill: list[float] | None = None,
        plain_steps: list[int] | None = None,
        hopeful: list[bool] | None = None,
        catch_up: list[float] | None = None,
        remaining: list[int] | None = None,
        running: int | None = None,
    ) -> bool:
        """Whether `plan`, asked now with these arguments, would draft or probe for any request; pure (no probe clock
        moves). Routing by goodput asks it at each request's best drafter before it ranks drafters (router/planning.py)."""
        args = (acceptance, overlap, models, fill, plain_steps, catch_up)
        shares = _catch_up_shares(catch_up, max_draft_tokens, remaining)
        ks = self._best_ks(acceptance, max_draft_tokens, overlap, models, fill, plain_steps, shares)
        load = self.measured.load(running or len(max_draft_tokens))
        return any(ks) or self._probe(ks, self._round(ks, *args), max_draft_tokens, hopeful, args, load) is not None

    def _probe(
        self, ks: list[int], planned: tuple[float, float], max_draft_tokens: list[int], hopeful: list[bool] | None, args: tuple, load: int
    ) -> tuple[list[int], tuple[float, float]] | None:
        """The planned `ks` (expected to commit and take `planned`: `_round`) with every hopeful request at k = 0
        probing one token, and what that round is expected to commit and take, if the rounds since the last probe have
        paid for what it loses at the share probes have at this `load` (module docstring); None if no probe is due."""
        hopeful = hopeful or [True] * len(ks)
        probing = [1 if k == 0 and bound > 0 and hope else k for k, bound, hope in zip(ks, max_draft_tokens, hopeful)]
        if probing == ks:
            return None
        (tokens, planned_ms), probe = planned, self._round(probing, *args)
        probe_tokens, probe_ms = probe
        share = self.probe_share / 2 ** self.fruitless_probes.get(load, 0)
        if probe_ms - probe_tokens * planned_ms / tokens > share * self.since_probe_ms:
            return None
        return probing, probe

    def could_draft(
        self,
        hopes: list[float],
        max_draft_tokens: list[int],
        overlap: bool = False,
        models: int = 1,
        fill: list[float] | None = None,
        plain_steps: list[int] | None = None,
    ) -> list[bool]:
        """Per request, whether the plan would draft for it were each request's acceptance its hope (the best its
        evidence leaves plausible: router/drafter_choice.py `upper_acceptance`), at the cheapest drafting the round could
        have (`models`, `fill`). The plan weighs the same requests with acceptances no higher, so where this drafts
        for nobody it drafts for nobody and no probe can change that; pure (no probe clock moves)."""
        return [k > 0 for k in self._best_ks(hopes, max_draft_tokens, overlap, models, fill, plain_steps)]

    def _best_ks(
        self,
        acceptance: list[float],
        max_draft_tokens: list[int],
        overlap: bool,
        models: int,
        fill: list[float] | None,
        plain_steps: list[int] | None,
        catch_up: list[float] | None = None,
    ) -> list[int]:
        """The draft lengths that maximise the round's expected goodput (`plan`'s arguments), k = 0 for all where
        nothing beats the plain round; catch_up: per request, the share of its drafter's catch-up the round pays for
        should it draft for it (`_catch_up_shares`)."""
        n = len(max_draft_tokens)
        plain_ms = self.cost.round_ms([0] * n)  # one pass: what a round that drafts never beats (`drafting_round_ms`)
        tokens, ms = self._round([0] * n, acceptance, overlap, models, fill, plain_steps)
        best_goodput, ks = tokens / ms if n else 0.0, [0] * n
        eligible = [i for i in range(n) if acceptance[i] >= self.min_acceptance]
        # A verification's time is linear in the rows drafted: its plain pass, then per row.
        per_row, cost = self.cost.per_verified_token_ms(), self.cost
        # Every position a request may draft, most likely accepted first (ties: the earlier request): a request's
        # positions come in order (its gain a^j falls with j), so each depth's greedy below walks this one list.
        positions = [(acceptance[i] ** j, i, j) for i in eligible for j in range(1, max_draft_tokens[i] + 1)]
        positions.sort(key=lambda position: (-position[0], position[1]))
        # The drafting term depends on the deepest draft only, so fix the depth D first;
        # for a given D, adding a draft token with gain g pays iff it raises sum E / T.
        for depth in range(1, max(max_draft_tokens, default=0) + 1):
            trial, expected, drafted, caught = [0] * n, float(n), 0.0, 0.0
            drafting = cost.draft_ms(depth, models)

            def round_ms(drafted: float, caught: float) -> float:
                # Pipelined, one group drafts while another is verified: the slower side sets the pace.
                return cost.drafting_round_ms(plain_ms + per_row * drafted, drafting + caught, plain_ms, overlap)

            now_ms = round_ms(drafted, caught)
            for gain, i, j in positions:
                if j > depth:
                    continue  # deeper than this depth's draft call
                rows = fill[i] if fill else 1.0  # the tree rows this position is expected to add
                catching = caught + (catch_up[i] if catch_up and trial[i] == 0 else 0.0)
                next_ms = round_ms(drafted + rows, catching)
                if (expected + gain) / next_ms <= expected / now_ms:
                    break
                trial[i] = j
                expected += gain
                drafted += rows
                caught = catching
                now_ms = next_ms
            if max(trial, default=0) < depth:
                continue  # this depth is not used; a shallower one covers the plan
            goodput = expected / now_ms
            if goodput > best_goodput:
                best_goodput, ks = goodput, trial
        return ks

    def _round(
        self,
        ks: list[int],
        acceptance: list[float],
        overlap: bool,
        models: int,
        fill: list[float] | None,
        plain_steps: list[int] | None,
        catch_up: list[float] | None = None,
    ) -> tuple[float, float]:
        """The tokens a round drafting `ks` is expected to commit, and its modelled time (`plan`'s arguments): with no
        draft at all, its requests' plain steps."""
        n, cost = len(ks), self.cost
        plain_ms = cost.round_ms([0] * n)
        if max(ks, default=0) == 0:
            tokens, beyond_ms = cost.plain_round(plain_steps or [1] * n)
            return tokens, plain_ms + beyond_ms
        rows = sum(k * (fill[i] if fill else 1.0) for i, k in enumerate(ks))
        drafting = cost.draft_ms(max(ks), models) + sum(c for c, k in zip(catch_up or [], ks) if k > 0)
        ms = cost.drafting_round_ms(plain_ms + cost.per_verified_token_ms() * rows, drafting, plain_ms, overlap)
        return sum(expected_tokens(a, k) for a, k in zip(acceptance, ks)), ms


def _catch_up_shares(catch_up: list[float] | None, max_draft_tokens: list[int], remaining: list[int] | None) -> list[float] | None:
    """Per request, the share of its drafter's catch-up a round that drafts for it pays for: what the round may commit
    of it (its draft and the target's token) over the tokens it may still produce (`SpeculationController.plan`)."""
    if not catch_up or not remaining:
        return None
    return [c * min(1.0, (k + 1) / max(1, r)) for c, k, r in zip(catch_up, max_draft_tokens, remaining)]
