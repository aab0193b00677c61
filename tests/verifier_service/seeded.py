"""A seeded (drafter-invariant) session's check shared by the verifier's tests of each logit adjustment: obligation 6
says its tokens do not depend on the tree it is offered."""

from __future__ import annotations

from collections.abc import Callable

from verifier_service.verifier import Verifier, VerifyItem


def assert_emits_plain_tokens_whatever_the_tree(new_verifier: Callable[[], Verifier], prompt: list[int], sampling, steps: int = 4) -> None:
    """A session offered a chain of 3 (its plain tokens, others, or the first of them then others), on a fresh verifier
    each, emits the tokens of `steps` plain steps."""
    (plain,) = new_verifier().verify_batch([VerifyItem("s", 0, prompt, sampling, plain_steps=steps)])
    for tokens in (plain.token_ids[:3], [7, 7, 7], [plain.token_ids[0], 12, 40]):
        chain = dict(tree_tokens=tokens, tree_parents=[-1, 0, 1], proposals=[([t], [1.0]) for t in tokens])
        verifier = new_verifier()
        (first,) = verifier.verify_batch([VerifyItem("s", 0, prompt, sampling, **chain)])
        emitted = list(first.token_ids)
        while len(emitted) < steps:
            (more,) = verifier.verify_batch([VerifyItem("s", len(prompt) + len(emitted), [], sampling)])
            emitted += more.token_ids
        assert emitted[:steps] == plain.token_ids, tokens
