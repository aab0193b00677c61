"""Which proposal leads when cooperating drafters draft in lockstep.

At each position every cooperating drafter proposes a token; all of them
continue from the lead proposal's token, and the router makes the lead's node
the main branch of the request's token tree. The drafter service (which
feeds the lead token) and the router (which builds the tree) must agree on
the lead, so the rule lives here, once: the most confident proposal, the
first in routing order on ties. Routing order is fixed before drafting, so
the choice never depends on the order in which tokens were drawn.
"""

from __future__ import annotations


def lead(confidences: list[float]) -> int:
    """Index of the leading proposal among the cooperating drafters' proposals, in routing order."""
    best = 0
    for i, confidence in enumerate(confidences):
        if confidence > confidences[best]:
            best = i
    return best
