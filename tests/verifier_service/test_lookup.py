"""verifier_service/verifier.py's lookup in plain passes (`lookup_tokens`): a plain pass drafts a chain from the
session's own context (specfleet/engine/ngram.py) and verifies it in the same pass.

Greedy and raced sessions decode exactly the tokens plain passes give, more of them a pass where the text repeats; a
sampled session's tokens are distributed as the target's (the proposal carries the distribution its token was drawn
from), with a control that claims another distribution and is caught; chains stay within the model's context; the
chains are the verifier's, never reported as the client's tree; a session that does not ask for lookup, or a call of
one pass, gets none."""

from __future__ import annotations

import math
import pathlib

import pytest
import torch

from specfleet.engine import SessionStore, load_model
from specfleet.sampling import SamplingParams
from specfleet.tokenizer import load_tokenizer
from verifier_service.lookup import PassChains
from verifier_service import verifier as verifier_mod
from verifier_service.validation import validate_item
from verifier_service.verifier import Verifier, VerifyItem

DEMO = pathlib.Path(__file__).resolve().parents[2] / "models" / "demo" / "target"
# Texts the demo target continues by repeating them, some of their 3-token suffixes with it.
REPEATING = ["-A-A-A-A-A-A-A-A", ".It C-\n.It C-\n.It C-\n.It C-", "0.0.0.0.0.0.0.0.", "no, no, no, no, no, no, no"]


@pytest.fixture(scope="module")
def demo():
    return load_model("target", str(DEMO), prefix_caching=True)


def _tokens(text: str) -> list[int]:
    return load_tokenizer(DEMO).encode(text, add_special_tokens=False)


def _verifier(loaded, eager: bool = True) -> Verifier:
    """A verifier of `loaded`; eager: its lookup proposes every chain it finds, whatever this machine's rows cost
    (`LookupPolicy.needed`), so that these tests see the same chains on every machine."""
    loaded.eos_token_id = -1  # no session stops at end of sequence here
    verifier = Verifier(loaded, SessionStore(1 << 30, 1000))
    if eager:
        verifier.lookup.for_pass = lambda sessions: PassChains(verifier.lookup, sessions, needed=0.0)
        verifier.lookup.pays = lambda sessions, rows, expected: True
    return verifier


def _decode(loaded, prompts: list[list[int]], params: list[SamplingParams], steps: int, lookup: int, tag: str, verifier=None):
    """Each prompt's first token in a call of its own, then a call of `steps` plain steps, all sessions together."""
    verifier = verifier or _verifier(loaded)
    first = verifier.verify_batch([VerifyItem(f"{tag}{i}", 0, p, s, lookup_tokens=lookup) for i, (p, s) in enumerate(zip(prompts, params))])
    assert all(r.lookup_proposed == 0 for r in first), "a call of one step has no room for a chain"
    items = [
        VerifyItem(f"{tag}{i}", len(p) + 1, [], s, logprobs=True, plain_steps=steps, lookup_tokens=lookup)
        for i, (p, s) in enumerate(zip(prompts, params))
    ]
    return [f.token_ids for f in first], verifier.verify_batch(items)


def test_greedy_and_raced_sessions_decode_the_tokens_of_plain_passes_and_more_of_them_a_pass(demo):
    prompts = [_tokens(text) for text in REPEATING]
    params = [
        SamplingParams(),
        SamplingParams(0.8, seed=5, drafter_invariant=True),
        SamplingParams(),
        SamplingParams(1.0, seed=9, drafter_invariant=True),
    ]
    steps = 24
    first_plain, plain = _decode(demo, prompts, params, steps * 5, 0, "p")  # the most a call of 24 lookup passes emits
    first_looked, looked = _decode(demo, prompts, params, steps, 4, "l")
    assert first_looked == first_plain
    for a, b in zip(looked, plain):
        assert a.token_ids == b.token_ids[: len(a.token_ids)]
        assert a.logprobs == pytest.approx(b.logprobs[: len(a.logprobs)], abs=1e-4)
    assert all(r.lookup_proposed == 0 and r.steps == steps * 5 for r in plain), "no lookup where the session does not ask"
    assert all(r.accepted_nodes == [] for r in looked), "the chains are the verifier's, not a tree of the client's"
    assert sum(r.lookup_accepted for r in looked) >= steps and all(r.lookup_accepted <= r.lookup_proposed for r in looked)
    # The plain steps' passes, each a token and what its chain added.
    assert [(r.steps, len(r.token_ids)) for r in looked] == [(steps, steps + r.lookup_accepted) for r in looked]


def test_a_chain_stays_within_the_model_s_context(demo):
    """A session near the end of the model's context: its chains shorten and its passes stop there, its tokens still
    the plain passes'."""
    prompt = _tokens(REPEATING[1])
    context = len(prompt) + 16
    short = load_model("target", str(DEMO), max_model_len=context)
    _, (plain,) = _decode(short, [prompt], [SamplingParams()], 15, 0, "p")
    _, (looked,) = _decode(short, [prompt], [SamplingParams()], 15, 8, "l")
    assert len(plain.token_ids) == 15 and looked.lookup_accepted > 0
    assert looked.token_ids == plain.token_ids[: len(looked.token_ids)]
    assert len(prompt) + 1 + len(looked.token_ids) <= context


def test_a_call_emits_no_more_tokens_than_the_client_keeps(demo):
    """`max_tokens`: a request's last round, its chains and passes stop at what it still keeps (its tokens the plain
    passes' as ever); without it, passes bound the call alone."""
    prompt = _tokens(REPEATING[1])
    first, (plain,) = _decode(demo, [prompt], [SamplingParams()], 40, 0, "p")
    for keeps in (2, 3, 10):
        verifier = _verifier(demo)
        verifier.verify_batch([VerifyItem("k", 0, prompt, SamplingParams())])
        item = VerifyItem("k", len(prompt) + 1, [], SamplingParams(), plain_steps=8, lookup_tokens=4, max_tokens=keeps)
        (kept,) = verifier.verify_batch([item])
        assert kept.token_ids == plain.token_ids[:keeps] and kept.lookup_accepted > 0 and kept.steps < keeps, keeps
    _, (uncapped,) = _decode(demo, [prompt], [SamplingParams()], 8, 4, "u")
    assert len(uncapped.token_ids) > 10 and uncapped.steps == 8


def test_a_sampled_session_s_tokens_are_distributed_as_the_target_s(demo, monkeypatch):
    """The first token a lookup pass emits, over many seeds, against the target's distribution at that position; the
    control proposes the same token but claims it was drawn from a flatter distribution, which verification then
    accepts too often: the same check catches it."""
    context = _tokens(REPEATING[1])
    verifier = _verifier(demo)
    (probe,) = verifier.verify_batch([VerifyItem("probe", 0, context, SamplingParams(1.0, seed=1), logprobs=True, top_logprobs=5)])
    target = dict(zip(probe.top_token_ids, (math.exp(lp) for lp in probe.top_logprobs)))
    n = 600

    def first_tokens(tag: str) -> tuple[dict[int, float], int]:
        items = [VerifyItem(f"{tag}{seed}", 0, context, SamplingParams(1.0, seed=seed), plain_steps=2, lookup_tokens=1) for seed in range(n)]
        results = [r for start in range(0, n, 150) for r in verifier.verify_batch(items[start : start + 150])]
        assert all(r.lookup_proposed >= 1 for r in results), "the context's suffix occurred before: every session looks up"
        counts = torch.bincount(torch.tensor([r.token_ids[0] for r in results]), minlength=max(target) + 1)
        return {t: float(counts[t]) / n for t in target}, sum(r.lookup_accepted for r in results)

    def far(freq: dict[int, float]) -> float:
        """The largest gap between a token's frequency and its probability, in binomial standard deviations."""
        return max(abs(freq[t] - p) / math.sqrt(p * (1 - p) / n) for t, p in target.items())

    freq, accepted = first_tokens("s")
    assert accepted > n // 4, "the chains are accepted often here, so the check tests them"
    assert far(freq) < 5, (freq, target)

    real = verifier_mod.lookup_chain

    def flatter(tokens, most, sampling, *args):
        chain, proposals, confidences = real(tokens, most, sampling, *args)
        return chain, [([t, (t + 1) % 300], [0.5, 0.5]) for t in chain], confidences

    monkeypatch.setattr(verifier_mod, "lookup_chain", flatter)
    control, _ = first_tokens("c")
    assert far(control) > 8, (control, target)


@pytest.mark.parametrize("value", [-1, 64])
def test_lookup_tokens_out_of_bounds_are_refused_naming_the_field(value):
    with pytest.raises(ValueError, match="lookup_tokens must be between 0 and 63"):
        validate_item(VerifyItem("s", 0, [1, 2, 3], SamplingParams(), lookup_tokens=value), vocab_size=300, max_context=64)


def test_chains_go_only_as_far_as_their_tokens_pay_for_their_rows(demo):
    """Where this verifier's passes show that a row costs as much as a plain pass's token, no chain is likely enough to
    pay and none is proposed; where rows cost nothing every chain found is; verdicts teach the policy how likely
    tokens of each confidence are, and every pass teaches it what rows cost."""
    prompt = _tokens(REPEATING[1])
    dear = _verifier(demo, eager=False)
    for rows in (1, 2, 3, 4, 5) * 4:
        dear.lookup.observe_pass(1, rows, 1.0 * rows)  # no fixed cost: a row costs a whole one-token pass
    dear.lookup.observe_pass = lambda sessions, rows, ms, accepted=0: None  # this machine's own passes would say otherwise
    assert dear.lookup.needed(1) == pytest.approx(0.9)
    _, (result,) = _decode(demo, [prompt], [SamplingParams()], 8, 4, "dear", verifier=dear)
    assert result.lookup_proposed == 0 and result.steps == 8

    cheap = _verifier(demo, eager=False)
    for rows in (1, 2, 3, 4, 5) * 4:
        cheap.lookup.observe_pass(1, rows, 2.0)  # rows cost nothing
    assert cheap.lookup.needed(1) == 0.0
    before = [list(band) for band in cheap.lookup.acceptance.counts]
    _, (result,) = _decode(demo, [prompt], [SamplingParams()], 8, 4, "cheap", verifier=cheap)
    assert result.lookup_proposed > 0 and result.lookup_accepted > 0
    assert cheap.lookup.acceptance.counts != before, "verdicts on the chains taught the policy"
    learning = _verifier(demo, eager=False)
    _decode(demo, [prompt], [SamplingParams()], 8, 4, "learning", verifier=learning)
    plain = sum(cost.sums[0] for cost in learning.lookup.plain.values())
    chained = sum(len(cost.passes) for cost in learning.lookup.chained.values())
    assert plain >= 2 and plain + chained > 8, "every pass taught it what rows cost"
