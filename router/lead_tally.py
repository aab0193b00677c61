"""Whether scoring a new prompt by the specialists can pay: which drafter led each domain's recent drafting rounds.

A prompt is scored (every specialist prefills it and the best names its domain) so that the round plan can lead
its request with the drafter best for that domain. Where the plans of recent rounds led every domain with the same
drafter (the n-gram drafter, say, on a machine where a model's draft step costs more than the tokens it adds), the
domain does not change the lead, so a prompt's scoring buys nothing and costs a prefill per specialist
(docs/benchmarks/cheap-drafting.md): the exemplars place it instead.
Once a domain's lead differs from another's, prompts are scored again.
"""

from __future__ import annotations

import collections

# A domain's lead is known once this many of its drafting rounds were seen: a request's first rounds (a few dozen
# at k = 4) decide it, not a single round.
MIN_ROUNDS = 8
# Each round of a domain weighs older rounds of that domain down by this: about a hundred rounds in effect, so
# a domain whose lead changes (new traffic, a drafter that got better) shows it within a few requests.
FORGET = 0.99


class LeadTally:
    """Decayed counts, per domain, of the drafter that led its drafting rounds as the round plan chose it."""

    def __init__(self, min_rounds: int = MIN_ROUNDS, forget: float = FORGET):
        self.min_rounds = min_rounds
        self.forget = forget
        self._counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._rounds: collections.Counter[str] = collections.Counter()  # per domain, every round observed

    def observe(self, domain: str, lead: str) -> None:
        """One request's drafting round in `domain` led by `lead`."""
        counts = self._counts[domain]
        for drafter in counts:
            counts[drafter] *= self.forget
        counts[lead] += 1.0
        self._rounds[domain] += 1

    def leads(self) -> dict[str, str]:
        """Each domain's most frequent recent lead, for the domains with at least min_rounds rounds."""
        return {
            domain: max(sorted(counts), key=counts.get)
            for domain, counts in self._counts.items()
            if domain and self._rounds[domain] >= self.min_rounds
        }

    def domain_matters(self) -> bool:
        """Whether a prompt's domain can change its lead: not once two domains or more are known and every known
        domain is led by the same drafter (before that, scoring is how the domains' leads are learned)."""
        known = self.leads()
        return len(known) < 2 or len(set(known.values())) > 1
