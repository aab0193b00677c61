"""A request's draft tree for one round: built from drafters' replies, sent to the verifier, scored after.

One drafter gives a chain. Cooperating drafters on the lead's service draft in
lockstep (one call): at each position every member proposes, the most confident
proposal (`specfleet.fusion.lead`, the same rule the drafter service follows)
continues the main branch and the rest become its siblings. Cooperating drafters
on other services each draft a chain from the request's context; the tree takes
each chain from the root, sharing a node where the chain's token is an identical
point mass already there, and branching off where it differs. Siblings come in
routing order, never in the order of the drawn tokens, which the verification
proof needs (verifier_service/verification.py: each node's token is drawn from
the distribution it carries, given the node's path, independently of other
drafters' draws). Every node carries the distribution its token was drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from router.messages import DraftedSession, TokenTree
from specfleet.fusion import lead

if TYPE_CHECKING:
    from router.rounds import RequestPlan


@dataclass
class DraftTree:
    """Node order: every parent before its children."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    proposals: list = field(default_factory=list)  # as the drafters' replies carried them (router/messages.py)
    owners: list[list[str]] = field(default_factory=list)  # drafters that proposed each node
    # Per drafter, its proposal at each position of the main branch (scored after verification).
    proposed: dict[str, list[int]] = field(default_factory=dict)
    main: list[int] = field(default_factory=list)  # node index of the main branch at each position
    chains: set[str] = field(default_factory=set)  # drafters that drafted a chain of their own (not in lockstep)

    def add(self, token: int, parent: int, proposal, owner: str) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.proposals.append(proposal)
        self.owners.append([owner])
        return len(self.tokens) - 1

    def add_chain(self, drafter: str, drafted: DraftedSession) -> None:
        """One drafter's chain, drafted from the request's context: the main branch in an empty tree, else merged
        in from the root. A node is shared only where both proposals are the same point mass: then both drafters
        chose that token deterministically and the node's distribution is each one's."""
        parent, first = -1, not self.tokens
        for token, proposal in zip(drafted.token_ids, drafted.proposals):
            parent = self._node(self.children(parent), token, parent, proposal, drafter)
            if first:
                self.main.append(parent)
        self.proposed[drafter] = list(drafted.token_ids)
        self.chains.add(drafter)

    def children(self, parent: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == parent]

    def _node(self, candidates: list[int], token: int, parent: int, proposal, drafter: str) -> int:
        """The node for the drafter's proposal under parent: a candidate holding the same point mass, which it then
        shares, else a new node. Identical point masses are one proposal; sampled duplicates stay separate siblings."""
        if _point_mass(proposal):
            for i in candidates:
                if self.tokens[i] == token and _point_mass(self.proposals[i]):
                    self.owners[i].append(drafter)
                    return i
        return self.add(token, parent, proposal, drafter)

    def fuse_position(self, members_in_routing_order: list[str], replies: dict[str, DraftedSession], position: int) -> None:
        """Add one position's lockstep proposals: siblings in routing order, the lead's node continues the main branch."""
        members = [(d, replies[d]) for d in members_in_routing_order if d in replies and len(replies[d].token_ids) > position]
        if not members:
            return
        parent = self.main[-1] if self.main else -1
        leader = lead([drafted.confidences[position] for _, drafted in members])
        member_nodes = []
        for drafter, drafted in members:  # a fixed order, never the drawn tokens' order
            token, proposal = drafted.token_ids[position], drafted.proposals[position]
            self.proposed.setdefault(drafter, []).append(token)
            member_nodes.append(self._node(member_nodes, token, parent, proposal, drafter))
        self.main.append(member_nodes[leader])

    def token_tree(self) -> TokenTree:
        """What a Verify call carries of the tree."""
        return TokenTree(token_ids=self.tokens, parents=self.parents, proposals=self.proposals)

    def outcomes(self, accepted_nodes: list[int], emitted: list[int]) -> dict[str, tuple[int, int]]:
        """Per drafter, (hits, missed): how many of its proposals the target emitted in a row, and whether it
        then missed one (the routing evidence); a drafter that proposed nothing missed.

        A chain's position j was drafted given its own tokens before j, which are emitted[:j] while it hits, so a
        chain is scored along itself. A lockstep member's position j was drafted given the main branch's tokens
        before j; that holds while the accepted path follows the main branch, so it is scored there, up to its
        first miss."""
        comparable = 0
        while comparable < len(self.main) and comparable < len(emitted):
            comparable += 1
            if comparable > len(accepted_nodes) or accepted_nodes[comparable - 1] != self.main[comparable - 1]:
                break
        outcomes = {}
        for drafter, proposals in self.proposed.items():
            if not proposals:
                # Asked to draft, it proposed nothing (an n-gram drafter without a match): the round gained no more
                # from it than from a wrong first token, and routing must not rank it by the rounds it proposed in.
                outcomes[drafter] = (0, 1)
                continue
            scored = min(len(emitted) if drafter in self.chains else comparable, len(proposals))
            hits = 0
            while hits < scored and proposals[hits] == emitted[hits]:
                hits += 1
            outcomes[drafter] = (hits, 1 if hits < scored else 0)
        return outcomes


def _point_mass(proposal) -> bool:
    return len(proposal.token_ids) == 1


def request_tree(request: RequestPlan, replies: dict[str, DraftedSession]) -> DraftTree:
    """A request's tree from its drafters' replies: the lockstep positions fused, then every other drafter's
    chain merged in, in routing order (the order the verifier tries siblings in, fixed before drafting)."""
    tree = DraftTree()
    state = request.state
    if request.lockstep:
        for position in range(request.k):
            tree.fuse_position(request.lockstep, replies, position)
        # Each lockstep session continued from the lead tokens, the main branch, for as many positions as it drafted.
        for drafter in request.lockstep:
            if drafter in replies:
                tree.proposed.setdefault(drafter, [])  # a member that proposed nothing is scored too (a miss)
                drafted = [tree.tokens[i] for i in tree.main[: len(replies[drafter].token_ids)]]
                state.drafter_mirrors[drafter].held = state.tokens + drafted
    for drafter in request.drafters:
        if drafter in replies and drafter not in request.lockstep:
            tree.add_chain(drafter, replies[drafter])
    return tree


def lockstep(drafters: list[str], services: dict) -> list[str]:
    """The drafters that draft in lockstep with the lead, in its service's call: those its service hosts, if two or more."""
    together = [d for d in drafters if services[d] is services[drafters[0]]] if drafters else []
    return together if len(together) > 1 else []
