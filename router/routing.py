"""Expertise routing: which drafters draft for a request.

`DrafterRouter` is the policy. Per request and round it draws a Thompson sample of each drafter's acceptance from
the posterior of the request's domain (router/domains.py places a new prompt; router/expertise.py holds what was
learned) plus what this request has shown so far (a request whose acceptance drops moves on by itself), and takes
the best; it adds cooperating drafters for fusion when even the best is not confidently good.

Policies for comparison: `fixed` (one drafter for everything), `random`, `oracle` (the drafter whose speciality is
the request's declared domain), `expertise` (the above).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


from router.domains import DomainClassifier, best_label, sure_label
from router.drafter_choice import upper_acceptance
from router.expertise import Evidence, ExpertiseStore
from router.lead_tally import LeadTally
from specfleet.config import ROUTING_POLICIES, RoutingConfig


POLICIES = ROUTING_POLICIES


# Domains requests may name beyond the drafters' specialities (`DrafterRouter.admits`).
MAX_EXTRA_DOMAINS = 64


@dataclass
class DrafterProfile:
    name: str
    specialities: list[str] = field(default_factory=list)
    # Runs no model (kind ngram): its proposals cost its service no step, so it adds no model to a round.
    model_free: bool = False


@dataclass
class RoutingTuning:
    """The routing's constants, not deployment keys (the deployment's routing keys are
    specfleet.config.RoutingConfig, the router's section the DrafterRouter takes whole)."""

    # Pseudo-counts: the prior for a drafter in its own speciality and elsewhere.
    prior_specialist: tuple[float, float] = (4.0, 1.0)
    prior_other: tuple[float, float] = (1.0, 1.0)
    # The domain's shared evidence counts as at most shared_evidence_cap draft tokens (hits and
    # misses), a prior for each request; each of the request's own tokens counts request_weight
    # times. Their ratio sets how fast a request whose acceptance drops overturns the domain's
    # choice: 16 of its own tokens weigh as much as all of the domain's evidence. Their scale sets
    # how narrow the posteriors get, hence how much the router keeps exploring: the bundled
    # family's specialists beat its general drafter by 0.06-0.17 per-token acceptance, which
    # posteriors of 32 tokens (about 0.08 wide) do not separate, so the router would keep trying
    # the wrong drafter in up to a third of the rounds; at 256 it settles on the specialist within
    # a few dozen requests per domain, and still explores a little, so it notices drift.
    # scripts/routing_convergence.py and docs/benchmarks/routing-convergence.md have the numbers.
    request_weight: float = 16.0
    shared_evidence_cap: float = 256.0


@dataclass
class RequestRouting:
    """What the router knows about one request."""

    domain: str
    evidence: dict[str, Evidence] = field(default_factory=dict)
    # Set while the domain waits for the specialists to score the prompt; the exemplar
    # classifier then runs only if no specialist could (it costs the router real CPU).
    needs_scores: bool = False
    # False once a round decoded the request plainly before any round routed it (the measured check's plain
    # decoding), or its first routed round only remeasured speculating: the exemplars alone place its prompt.
    # Scored then, the prompts that arrived while every round decoded plainly would all be scored in the round
    # that speculates again.
    scorable: bool = True
    prompt: str = ""

    @property
    def unplaced(self) -> bool:
        """Waiting for the exemplars to place it (`DrafterRouter.place`), not for the specialists' scores: it is not
        scorable, and the plan places it in the first round that might draft for it (router/planning.py)."""
        return self.needs_scores and not self.scorable

    @property
    def awaits_scores(self) -> bool:
        """Its prompt is to be scored by the specialists (in the first round that routes it)."""
        return self.needs_scores and self.scorable


class DrafterRouter:
    def __init__(
        self,
        config: RoutingConfig,
        drafters: list[DrafterProfile],
        classifier: DomainClassifier,
        store: ExpertiseStore,
        seed: int = 0,
        tuning: RoutingTuning | None = None,
    ):
        if config.routing_policy not in POLICIES:
            raise ValueError(f"routing policy must be one of {POLICIES}, got {config.routing_policy!r}")
        self.config = config  # the router's routing section, replaced whole on reload
        self.tuning = tuning or RoutingTuning()
        self.drafters = {d.name: d for d in drafters}
        # The drafters that run no model: a round's distinct models leave them out.
        self.model_free = frozenset(d.name for d in drafters if d.model_free)
        self.domains = {domain for d in drafters for domain in d.specialities}
        self.extra_domains: set[str] = set()  # named by requests (`admits`), at most MAX_EXTRA_DOMAINS
        self.classifier = classifier
        self.store = store
        self.rng = random.Random(seed)
        # Which drafter the round plans led each domain with (router/lead_tally.py): whether scoring a prompt pays.
        self.leads = LeadTally()
        self._anywhere: tuple[int, dict[str, tuple[float, float]]] | None = None  # (store version, posteriors)

    def admits(self, domain: str) -> bool:
        """Whether a request may name this domain (GenerateRequest.domain): a drafter's speciality, or one of the
        first MAX_EXTRA_DOMAINS others named. Each domain is a label on the router's metrics and a field per drafter
        in the shared Redis hash, so clients must not add them without bound; past the budget a request's domain
        comes from its prompt, as if it named none."""
        if domain in self.domains or domain in self.extra_domains:
            return True
        if len(self.extra_domains) >= MAX_EXTRA_DOMAINS:
            return False
        self.extra_domains.add(domain)
        return True

    def pairs(self) -> list[tuple[str, str]]:
        """Every (domain, drafter) whose evidence the router uses: what it shares with other routers. The domain ""
        is that of requests nothing classifies (drafters without specialities)."""
        return [(domain, drafter) for domain in sorted(self.domains | self.extra_domains | {""}) for drafter in self.drafters]

    def start(self, prompt: str, domain_hint: str = "", drafts: bool = True) -> RequestRouting:
        """What routing knows of a new request. One that never drafts (speculation off) needs no drafter: no
        specialist scores its prompt and no classifier reads it; its domain is the one it names, if any."""
        hint = domain_hint if self.config.use_domain_hint and domain_hint and self.admits(domain_hint) else ""
        if hint or not drafts:
            return RequestRouting(domain=hint)
        if self.config.routing_policy == "expertise" and self.config.domain_prior == "likelihood" and self.scorers():
            return RequestRouting(domain="", needs_scores=True, prompt=prompt)
        return RequestRouting(domain=self.classifier.classify(prompt))

    def scorers(self) -> list[str]:
        """The drafters that score new prompts: those that declare specialities."""
        return [name for name, profile in self.drafters.items() if profile.specialities]

    def place(self, routing: RequestRouting) -> None:
        """Before a request's prompt is scored: where the exemplars place it clearly (or it is not `scorable`, or
        recent rounds led every domain with the same drafter: `LeadTally`), their label is its domain and no
        specialist spends a prefill on it. In the request's first round that routes, not
        at submission, so that a call of many prompts costs the event loop one classification per request admitted,
        not all of them at once."""
        margin, settles = self.config.exemplar_margin, not routing.scorable or not self.leads.domain_matters()
        if margin <= 0 and not settles:
            return  # the specialists score it: no classification to spend
        scores = self.classifier.scores(routing.prompt)  # once: the sure label and the best guess read the same
        sure = sure_label(scores, margin) if margin > 0 else ""
        if sure or settles:
            # Clearly placed, or the exemplars' best guess, however close: scoring may not run, or cannot change the
            # request's lead.
            routing.domain, routing.needs_scores, routing.prompt = sure or best_label(scores), False, ""

    def assign_domain(self, routing: RequestRouting, scores: dict[str, float]) -> None:
        """scores: drafter -> its mean log-probability of the prompt. The best specialist's speciality wins;
        with no scores (drafters unreachable) the exemplar classifier decides."""
        routing.needs_scores = False
        if scores:
            best = max(scores, key=scores.get)
            routing.domain = self.drafters[best].specialities[0]
        else:
            routing.domain = self.classifier.classify(routing.prompt)
        routing.prompt = ""

    def _prior(self, drafter: str, domain: str) -> tuple[float, float]:
        specialist = domain in self.drafters[drafter].specialities
        return self.tuning.prior_specialist if specialist else self.tuning.prior_other

    def posterior(self, routing: RequestRouting, drafter: str) -> tuple[float, float]:
        shared = self.store.get(routing.domain, drafter)
        return self._posterior(routing, drafter, shared.accepted, shared.rejected)

    def _posterior(self, routing: RequestRouting, drafter: str, shared_a: float, shared_r: float) -> tuple[float, float]:
        """The prior, the domain's shared evidence (capped) and the request's own (weighted), summed."""
        prior_a, prior_r = self._prior(drafter, routing.domain)
        scale = min(1.0, self.tuning.shared_evidence_cap / max(1e-9, shared_a + shared_r))
        mine = routing.evidence.get(drafter)
        mine_a, mine_r = (mine.accepted, mine.rejected) if mine is not None else (0.0, 0.0)
        w = self.tuning.request_weight
        return prior_a + scale * shared_a + w * mine_a, prior_r + scale * shared_r + w * mine_r

    def mean(self, routing: RequestRouting, drafter: str) -> float:
        """The drafter's expected per-token acceptance for this request."""
        a, r = self.posterior(routing, drafter)
        return a / (a + r)

    def posteriors(self, routing: RequestRouting) -> dict[str, tuple[float, float]]:
        """Every drafter's posterior for this request, the store read once: what `choose` samples from, for a caller
        that also needs every drafter's mean (a round planned by goodput) to compute them once."""
        shared = self.store.counts(routing.domain, self.drafters)
        return {d: self._posterior(routing, d, a, r) for d, (a, r) in zip(self.drafters, shared)}

    def posteriors_anywhere(self) -> dict[str, tuple[float, float]]:
        """For a request not placed in a domain yet (and so with no evidence of its own), each drafter's posterior in
        the domain where its hope (`upper_acceptance`) is highest: its hope is at most that wherever the exemplars place
        it. The plan weighs an unplaced request's hope by these before spending a classification on its prompt. Kept
        until the store's evidence moves."""
        if self._anywhere is None or self._anywhere[0] != self.store.version:
            version, best = self.store.version, {}
            for domain in sorted(self.domains | {""}):
                routing = RequestRouting(domain=domain)
                for drafter, (a, r) in zip(self.drafters, self.store.counts(domain, self.drafters)):
                    posterior = self._posterior(routing, drafter, a, r)
                    if drafter not in best or upper_acceptance(*posterior) > upper_acceptance(*best[drafter]):
                        best[drafter] = posterior
            self._anywhere = (version, best)
        return self._anywhere[1]

    def choose(self, routing: RequestRouting, candidates: bool = False, posteriors: dict | None = None) -> list[str]:
        """The drafters for this round, best first. Expertise routing adds cooperating drafters (up to fusion_width
        in all) while the best is not confidently good (`fusion_below`); with `candidates`, always, as drafters the
        round may add where the cost model says they pay (router/drafter_choice.py `cooperate`). posteriors: this
        request's `posteriors`, where the caller has them."""
        if not self.drafters:
            return []
        policy = self.config.routing_policy
        if policy == "fixed":
            chosen = [self.config.default_drafter or next(iter(self.drafters))]
        elif policy == "random":
            chosen = [self.rng.choice(sorted(self.drafters))]
        elif policy == "oracle":
            experts = [d for d, p in self.drafters.items() if routing.domain in p.specialities]
            chosen = [experts[0] if experts else (self.config.default_drafter or next(iter(self.drafters)))]
        else:
            posteriors = posteriors or self.posteriors(routing)
            samples = {d: self.rng.betavariate(a, r) for d, (a, r) in posteriors.items()}
            ranked = sorted(samples, key=samples.get, reverse=True)
            best_mean = max(a / (a + r) for a, r in posteriors.values())
            width = 1 if best_mean >= self.config.fusion_below and not candidates else self.config.fusion_width
            chosen = ranked[: max(1, width)]
        return chosen

    def observe(self, routing: RequestRouting, outcomes: dict[str, tuple[int, int]]) -> None:
        """outcomes: drafter -> (accepted, rejected) draft tokens this round."""
        for drafter, (accepted, rejected) in outcomes.items():
            mine = routing.evidence.setdefault(drafter, Evidence())
            mine.accepted += accepted
            mine.rejected += rejected
            if self.config.routing_policy == "expertise":
                self.store.add(routing.domain, drafter, accepted, rejected)
