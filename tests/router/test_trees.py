"""A request's draft tree (router/trees.py): lockstep positions fused, chains from other services merged in from the
root, siblings in routing order, and each drafter scored on what it was drafted from."""

from __future__ import annotations

import types

from router.messages import DraftedSession
from router.request import SessionMirror
from router.rounds import RequestPlan
from router.trees import DraftTree, lockstep, request_tree
from specfleet.v1 import common_pb2


def point(token: int):
    return common_pb2.SparseDistribution(token_ids=[token], probs=[1.0])


def sampled(token: int, other: int):
    return common_pb2.SparseDistribution(token_ids=[token, other], probs=[0.6, 0.4])


def chain(tokens: list[int], proposal=point, confidences: list[float] | None = None) -> DraftedSession:
    return DraftedSession(
        known=True,
        token_ids=tokens,
        proposals=[proposal(t) if proposal is point else proposal(t, t + 100) for t in tokens],
        confidences=confidences or [1.0] * len(tokens),
    )


def test_chains_from_other_services_share_identical_point_masses_and_branch_where_they_differ():
    tree = DraftTree()
    tree.add_chain("a", chain([1, 2, 3, 4]))
    tree.add_chain("b", chain([1, 2, 5]))
    tree.add_chain("c", chain([6, 7]))
    assert tree.tokens == [1, 2, 3, 4, 5, 6, 7]
    assert tree.parents == [-1, 0, 1, 2, 1, -1, 5]
    assert tree.owners == [["a", "b"], ["a", "b"], ["a"], ["a"], ["b"], ["c"], ["c"]]
    assert tree.main == [0, 1, 2, 3]  # the first chain's, the lead's
    # The verifier tries siblings in node order: the root's children in routing order, whatever tokens were drawn.
    assert tree.children(-1) == [0, 5] and tree.children(1) == [2, 4]


def test_sampled_proposals_stay_separate_siblings():
    """Two draws of one token from different distributions are two candidates, each verified with its own."""
    tree = DraftTree()
    tree.add_chain("a", chain([1, 2], sampled))
    tree.add_chain("b", chain([1, 2], sampled))
    tree.add_chain("c", chain([1]))
    assert tree.parents == [-1, 0, -1, 2, -1]
    assert [len(p.token_ids) for p in tree.proposals] == [2, 2, 2, 2, 1]


def test_a_chain_from_another_service_joins_a_lockstep_tree_at_the_root_after_it():
    replies = {"a": chain([1, 2], confidences=[0.9, 0.9]), "b": chain([3, 2], confidences=[0.5, 0.95])}
    tree = DraftTree()
    for position in range(2):
        tree.fuse_position(["a", "b"], replies, position)
    tree.add_chain("c", chain([3, 9, 9]))
    # a leads position 0, b position 1 (more confident there: one node, as both proposed 2 with point masses).
    assert tree.tokens[:3] == [1, 3, 2] and tree.parents[:3] == [-1, -1, 0] and tree.main == [0, 2]
    # c's 3 is the same point mass as b's sibling: shared, and c's chain goes on below it.
    assert tree.owners[1] == ["b", "c"] and tree.tokens[3:] == [9, 9] and tree.parents[3:] == [1, 3]


def test_a_chain_is_scored_along_itself_and_a_lockstep_member_along_the_main_branch():
    replies = {"a": chain([1, 2, 3]), "b": chain([1, 4])}
    tree = DraftTree()
    for position in range(3):
        tree.fuse_position(["a", "b"], {**replies, "b": chain([1, 4], confidences=[1.0, 0.1])}, position)
    tree.add_chain("c", chain([5, 6, 7]))
    # The target took c's branch whole, then its own token: a and b missed at position 0; c hit 3 of 3.
    c_nodes = [i for i, owners in enumerate(tree.owners) if owners == ["c"]]
    outcomes = tree.outcomes(c_nodes, [5, 6, 7, 8])
    assert outcomes == {"a": (0, 1), "b": (0, 1), "c": (3, 0)}
    # Along the main branch: a hit 2 and missed its third; b hit 1 and missed its second (4, not 2); c missed at once.
    assert tree.outcomes([0, 1], [1, 2, 9]) == {"a": (2, 1), "b": (1, 1), "c": (0, 1)}


def test_a_drafter_that_proposed_nothing_missed():
    """An n-gram drafter without a match proposes nothing: scored as a miss, in a chain or in lockstep, so routing
    ranks it by every round it was asked in, not only those it proposed in."""
    state = types.SimpleNamespace(tokens=[0], drafter_mirrors={d: SessionMirror() for d in ("a", "n", "m")})
    replies = {"a": chain([1, 2]), "n": chain([]), "m": chain([])}
    tree = request_tree(RequestPlan(state, ["a", "n", "m"], [2, 2, 2], lockstep=["a", "n"]), replies)
    assert tree.tokens == [1, 2]
    assert tree.outcomes([0, 1], [1, 2, 3]) == {"a": (2, 0), "n": (0, 1), "m": (0, 1)}


def test_drafters_on_the_lead_s_service_draft_in_lockstep_and_the_others_apart():
    one, two = object(), object()
    services = {"a": one, "b": two, "c": one, "d": two}
    assert lockstep(["a", "b", "c", "d"], services) == ["a", "c"]
    assert lockstep(["b", "a"], services) == []  # alone on its service: every drafter drafts a chain
    assert lockstep([], services) == []


def test_a_request_s_tree_puts_siblings_in_routing_order_whatever_their_drawn_tokens():
    """The verifier tries siblings in node order; an order chosen by the drawn tokens (their confidence, say) would
    bias which candidate comes first, and the output with it (verifier_service/verification.py, obligation 1)."""
    replies = {
        "c": chain([7, 8], confidences=[0.1, 0.1]),
        "a": chain([1, 2], confidences=[0.9, 0.9]),
        "b": chain([3, 4], confidences=[0.5, 0.5]),
    }
    state = types.SimpleNamespace(tokens=[0], drafter_mirrors={d: SessionMirror() for d in replies})
    alone = request_tree(RequestPlan(state, ["c", "a", "b"], [2, 2, 2]), replies)
    assert [alone.tokens[i] for i in alone.children(-1)] == [7, 1, 3] and alone.main == [0, 1]
    # The lead's service hosts b too: a and b in lockstep (their tree first), c's chain after.
    together = request_tree(RequestPlan(state, ["a", "b", "c"], [2, 2, 2], lockstep=["a", "b"]), replies)
    assert [together.tokens[i] for i in together.children(-1)] == [1, 3, 7]
    assert state.drafter_mirrors["b"].held == [0, 1, 2]  # b continued from the lead tokens
