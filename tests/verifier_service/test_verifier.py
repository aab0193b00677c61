"""verifier_service/verifier.py: chunked prefill (`max_prefill_tokens`) and plain steps (`plain_steps`).

A long prompt is prefilled a budget's worth a batch and answered `prefilling` until it is whole, while a
session already decoding is verified in every batch, before or after it in the batch; each session's
tokens are the target's, as without chunks. A plain session's steps in one call are the tokens (and
log-probabilities) as many calls of one step give, greedy, raced and sampled, after a tree's pass too; they stop
at end of sequence and once another call waits, whose sessions join the last step where that call needs one pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specfleet.engine import SessionStore, load_model
from specfleet.sampling import SamplingParams
from verifier_service.validation import validate_item
from verifier_service.verifier import Verifier, VerifyItem

BUDGET = 64


def _run(path: str, budget: int, short: list[int], long: list[int]) -> tuple[list[int], list]:
    """short's first batch alone, then batches of [long, short] until long is verified: short's first
    tokens, and per later batch (short's tokens, long's tokens or None while it prefills, long's cache)."""
    verifier = Verifier(load_model("target", path), SessionStore(1 << 30, 100), max_prefill_tokens=budget)
    (first,) = verifier.verify_batch([VerifyItem("short", 0, short, SamplingParams())])
    held = {"short": len(verifier.store.get("short").token_ids), "long": 0}
    batches = []
    while True:
        items = [
            VerifyItem("long", held["long"], [] if held["long"] else long, SamplingParams()),
            VerifyItem("short", held["short"], [], SamplingParams()),
        ]
        long_result, short_result = verifier.verify_batch(items)
        assert short_result.known and not short_result.prefilling and long_result.known
        held = {sid: len(verifier.store.get(sid).token_ids) for sid in held}
        batches.append((short_result.token_ids, None if long_result.prefilling else long_result.token_ids, verifier.store.get("long").kv_len))
        if not long_result.prefilling:
            return first.token_ids, batches


def test_a_long_prompt_is_prefilled_in_chunks_while_a_decoding_session_keeps_its_pace(random_family):
    path = str(random_family["target"])
    gen = torch.Generator().manual_seed(0)
    short = torch.randint(1, 300, (10,), generator=gen).tolist()
    long = torch.randint(1, 300, (300,), generator=gen).tolist()
    first, chunked = _run(path, BUDGET, short, long)
    # 64 of long's 299 positions a batch, until the last 43 fit.
    assert [cache for _, _, cache in chunked[:-1]] == [64, 128, 192, 256]
    assert [tokens is None for _, tokens, _ in chunked] == [True] * 4 + [False]
    assert all(len(tokens) == 1 for tokens, _, _ in chunked), "short decodes a token in every batch"
    _, whole = _run(path, 0, short, long)
    assert len(whole) == 1 and chunked[-1][1] == whole[0][1], "long's first token is the target's, chunked or not"
    # And short's tokens, batch after batch, are what it decodes alone.
    alone = Verifier(load_model("target", path), SessionStore(1 << 30, 100))
    tokens: list[int] = []
    for _ in range(1 + len(chunked)):
        (result,) = alone.verify_batch([VerifyItem("short", len(short) + len(tokens) if tokens else 0, [] if tokens else short, SamplingParams())])
        tokens += result.token_ids
    assert first + [t for batch, _, _ in chunked for t in batch] == tokens


def test_a_chunked_batch_looks_each_prompt_up_in_the_prefix_cache_once(random_family):
    """The budget counts what the prefix cache leaves to compute, and the batch then prefills without looking
    again: prefix_cache_queries counts each prompt's positions once."""
    loaded = load_model("target", str(random_family["target"]), prefix_caching=True)
    verifier = Verifier(loaded, SessionStore(1 << 30, 100), max_prefill_tokens=BUDGET)
    prompt = torch.randint(1, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    verifier.verify_batch([VerifyItem("a", 0, prompt, SamplingParams())])
    assert (loaded.pool.queries, loaded.pool.hits) == (39, 0)
    verifier.verify_batch([VerifyItem("b", 0, prompt, SamplingParams())])
    assert (loaded.pool.queries, loaded.pool.hits) == (78, 32), "b finds a's two full blocks"


def test_a_salted_prompt_shares_cached_blocks_only_with_its_own_salt(random_family):
    """vLLM's cache_salt: a prompt's cached blocks serve later prompts of the same salt, never another salt's nor an
    unsalted one's, and the tokens are the target's either way."""
    loaded = load_model("target", str(random_family["target"]), prefix_caching=True)
    verifier = Verifier(loaded, SessionStore(1 << 30, 100))
    prompt = torch.randint(1, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens, hits = [], []
    for sid, salt in [("a", ""), ("b", "tenant-1"), ("c", "tenant-2"), ("d", "tenant-1"), ("e", "")]:
        before = loaded.pool.hits
        (result,) = verifier.verify_batch([VerifyItem(sid, 0, prompt, SamplingParams(), cache_salt=salt)])
        tokens.append(result.token_ids)
        hits.append(loaded.pool.hits - before)
        assert result.cached_tokens == hits[-1], "the result says what its prompt found (vLLM's cached_tokens)"
    assert hits == [0, 0, 0, 32, 32], "d finds b's blocks, e finds a's; b and c find none"
    assert all(t == tokens[0] for t in tokens)


PLAIN = [SamplingParams(), SamplingParams(0.8, seed=7, drafter_invariant=True), SamplingParams(0.8, top_p=0.9, seed=11)]


def _one_step_calls(path: str, prompts: list[list[int]], params: list[SamplingParams], steps: int) -> list[tuple[list[int], list[float]]]:
    """Each session's tokens and log-probabilities over `steps` calls of one plain step, all sessions in each call."""
    verifier = Verifier(load_model("target", path), SessionStore(1 << 30, 100))
    out = [([], []) for _ in prompts]
    for _ in range(steps):
        items = [
            VerifyItem(f"s{i}", len(prompt) + len(out[i][0]) if out[i][0] else 0, [] if out[i][0] else prompt, p, logprobs=True)
            for i, (prompt, p) in enumerate(zip(prompts, params))
        ]
        for (tokens, logprobs), result in zip(out, verifier.verify_batch(items)):
            tokens += result.token_ids
            logprobs += result.logprobs
    return out


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(1, 300, (5 + 3 * i,), generator=gen).tolist() for i in range(n)]


def test_plain_steps_in_one_call_are_the_tokens_of_as_many_calls(random_family):
    path = str(random_family["target"])
    prompts = _prompts(len(PLAIN))
    expected = _one_step_calls(path, prompts, PLAIN, 5)
    verifier = Verifier(load_model("target", path), SessionStore(1 << 30, 100))
    verifier.loaded.eos_token_id = -1  # no session stops at end of sequence here
    results = verifier.verify_batch(
        [VerifyItem(f"s{i}", 0, prompt, p, logprobs=True, plain_steps=5) for i, (prompt, p) in enumerate(zip(prompts, PLAIN))]
    )
    assert [r.token_ids for r in results] == [tokens for tokens, _ in expected]
    for result, (_, logprobs) in zip(results, expected):
        assert result.logprobs == pytest.approx(logprobs, abs=1e-4)
    assert [r.steps for r in results] == [5, 5, 5]
    # The sessions hold what they emitted: the next call goes on from there.
    assert [len(verifier.store.get(f"s{i}").token_ids) for i in range(3)] == [len(p) + 5 for p in prompts]


def test_plain_steps_stop_at_end_of_sequence_and_when_another_call_waits(random_family):
    path = str(random_family["target"])
    prompts = _prompts(2)
    expected = _one_step_calls(path, prompts, PLAIN[:2], 6)
    verifier = Verifier(load_model("target", path), SessionStore(1 << 30, 100))
    verifier.loaded.eos_token_id = expected[0][0][2]  # session 0's third token ends its sequence
    stops = iter([False, False, False, True])
    verifier.waiting = lambda: next(stops)
    results = verifier.verify_batch([VerifyItem(f"s{i}", 0, prompt, p, plain_steps=6) for i, (prompt, p) in enumerate(zip(prompts, PLAIN[:2]))])
    eos_at = expected[0][0].index(verifier.loaded.eos_token_id)
    assert results[0].token_ids == expected[0][0][: eos_at + 1]
    # Session 1 goes on alone until the fourth question between passes finds a call waiting: four passes.
    assert results[1].token_ids == expected[1][0][:4] and results[1].steps == 4


def test_a_waiting_call_of_one_pass_joins_the_running_call_s_last_step(random_family):
    """A call that needs one pass (a new prompt, a tree) waiting while plain steps run joins the step about to run
    (`Verifier._join_last`, the batch queue's `join_running`), which is the running call's last: the joined sessions' results
    are a call of their own's (a new prompt greedy, a tree sampled and raced), each answered with its rows' share of
    the pass, and the running sessions' steps are as many calls' of one step. A waiting call of several passes, or one
    holding a stepping session, does not join: the running call just ends after the pass under way."""
    path = str(random_family["target"])
    prompts = _prompts(4)
    stepping = _one_step_calls(path, prompts[:2], PLAIN[:2], 3)
    first = _one_step_calls(path, prompts[2:3], PLAIN[2:3], 1)
    tree = dict(tree_tokens=[first[0][0][0]], tree_parents=[-1], proposals=[([first[0][0][0], 7], [0.6, 0.4])])
    waiting = [
        [VerifyItem("new", 0, prompts[3], SamplingParams(), logprobs=True)],
        [VerifyItem("treed", 0, prompts[2], PLAIN[2], logprobs=True, **tree)],
    ]
    apart = Verifier(load_model("target", path), SessionStore(1 << 30, 100))
    apart.loaded.eos_token_id = -1
    expected = [apart.verify_batch(call) for call in waiting]

    together = Verifier(load_model("target", path), SessionStore(1 << 30, 100))
    together.loaded.eos_token_id = -1
    asked, answered = iter([False, True]), []
    together.waiting = lambda: next(asked)  # a call waits from the third pass on
    together.max_batch_items = 8
    refused = [[VerifyItem("s0", 9, [], SamplingParams())], [VerifyItem("long", 0, prompts[0], SamplingParams(), plain_steps=4)]]

    def join(accept, room):
        assert room == 6, "the running call's two sessions take two of the pass's eight"
        assert not any(accept(call) for call in refused), "a stepping session's call, or one of several passes, does not join"
        return [SimpleNamespace(items=call) for call in waiting if accept(call)]

    together.join_running = join
    together.answer = lambda joined, results, batch_size, share: answered.append((joined.items, results, batch_size, share))
    running = [VerifyItem(f"s{i}", 0, prompt, p, logprobs=True, plain_steps=6) for i, (prompt, p) in enumerate(zip(prompts, PLAIN[:2]))]
    results = together.verify_batch(running)
    assert [r.token_ids for r in results] == [tokens for tokens, _ in stepping] and [r.steps for r in results] == [3, 3]
    assert [items for items, _, _, _ in answered] == waiting and {size for _, _, size, _ in answered} == {4}
    # Each joined call's share of the pass is its rows' (a prompt; a prompt and its tree's node) beside the steps' two.
    rows = [len(prompts[3]), len(prompts[2]) + 1]
    assert [share for _, _, _, share in answered] == pytest.approx([r / (2 + sum(rows)) for r in rows])
    for (_, got, _, _), want in zip(answered, expected):
        assert [(r.accepted_nodes, r.token_ids) for r in got] == [(r.accepted_nodes, r.token_ids) for r in want]
        assert got[0].logprobs == pytest.approx(want[0].logprobs, abs=1e-4)
    assert len(together.store.get("new").token_ids) == len(prompts[3]) + 1, "the joined session holds what it emitted"


def test_a_tree_then_plain_steps_in_one_call_are_the_tokens_of_a_tree_call_then_one_step_calls(random_family):
    """A session may verify its tree and decode plainly after it in the same call (what a probe in a round of plain
    steps would ask): its tree's verdict and every token after it are those of the tree's own call followed by one-step calls,
    greedy, raced and sampled, beside a session without a tree, and beside a greedy session whose node is the token its
    target emits one position later (rejected in the tree's pass, it would be accepted in the next were that pass to
    verify the tree again)."""
    path = str(random_family["target"])
    prompts = _prompts(len(PLAIN) + 2)
    plain = _one_step_calls(path, prompts, PLAIN + [SamplingParams(), SamplingParams()], 2)
    # Each tree's one node: the token the target emits first (accepted where greedy), drawn from a spread-out proposal.
    trees = [dict(tree_tokens=[tokens[0]], tree_parents=[-1], proposals=[([tokens[0], 7], [0.6, 0.4])]) for tokens, _ in plain[: len(PLAIN)]]
    later = plain[-1][0][1]

    def items(steps: int) -> list[VerifyItem]:
        treed = [
            VerifyItem(f"s{i}", 0, prompt, p, logprobs=True, plain_steps=steps, **tree)
            for i, (prompt, p, tree) in enumerate(zip(prompts, PLAIN, trees))
        ]
        return treed + [
            VerifyItem("plain", 0, prompts[-2], SamplingParams(), logprobs=True, plain_steps=steps),
            VerifyItem(
                "later",
                0,
                prompts[-1],
                SamplingParams(),
                logprobs=True,
                plain_steps=steps,
                tree_tokens=[later],
                tree_parents=[-1],
                proposals=[([later], [1.0])],
            ),
        ]

    apart = Verifier(load_model("target", path), SessionStore(1 << 30, 100))
    apart.loaded.eos_token_id = -1
    expected = [(r.accepted_nodes, r.token_ids, r.logprobs) for r in apart.verify_batch(items(1))]
    for _ in range(3):
        step = [VerifyItem(item.session_id, len(apart.store.get(item.session_id).token_ids), [], item.sampling, logprobs=True) for item in items(1)]
        for (_, tokens, logprobs), result in zip(expected, apart.verify_batch(step)):
            tokens += result.token_ids
            logprobs += result.logprobs
    together = Verifier(load_model("target", path), SessionStore(1 << 30, 100))
    together.loaded.eos_token_id = -1
    results = together.verify_batch(items(4))
    assert [(r.accepted_nodes, r.token_ids) for r in results] == [(nodes, tokens) for nodes, tokens, _ in expected]
    for result, (_, _, logprobs) in zip(results, expected):
        assert result.logprobs == pytest.approx(logprobs, abs=1e-4)
    assert [r.steps for r in results] == [4] * len(results)
    assert results[0].accepted_nodes == [0], "the greedy session's node is the target's token"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(plain_steps=0), "plain_steps must be between 1 and 64"),
        (dict(plain_steps=60, tree_tokens=[5, 6], tree_parents=[-1, 0], proposals=[([5], [1.0]), ([6], [1.0])]), "60 passes and tree exceeds"),
        (dict(plain_steps=64, new_token_ids=[1] * 8), "exceeds the model's 64 positions"),
    ],
)
def test_plain_steps_out_of_bounds_are_refused_naming_the_field(change, message):
    item = VerifyItem("s", 0, [1, 2, 3], SamplingParams())
    for key, value in change.items():
        setattr(item, key, value)
    with pytest.raises(ValueError, match=message):
        validate_item(item, vocab_size=300, max_context=64)
