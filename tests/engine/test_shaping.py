"""specfleet/engine/shaping.py: draft proposals and their confidences, greedy and sampled rows in one batch; the
target's tokens of greedy and raced rows. SPECFLEET_TEST_DEVICE=cuda gives `target_tokens` its logits on a GPU
(scripts/device-check sets it)."""

from __future__ import annotations

import os

import pytest
import torch

from specfleet.engine import shaping
from specfleet.engine.sampling import race, race_keys, race_noise
from specfleet.sampling import SamplingParams

DEVICE = os.environ.get("SPECFLEET_TEST_DEVICE", "cpu")


def test_each_row_of_a_mixed_batch_is_confident_as_its_own_law_says():
    """A greedy row proposes its argmax as a point mass, confident by the model's own probability of it (temperature 1);
    a sampled row proposes a token of its truncated q, confident by its shaped probability of that token; a batch of
    sampled rows alone gives them the same."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3)) * 2
    params = [SamplingParams(), SamplingParams(temperature=0.7, seed=5)]
    tokens, proposals, confidences = shaping.propose(lambda ids: ids, logits, params, [10, 10], [1, 1], 8)
    assert tokens[0] == int(logits[0].argmax()) and proposals[0] == ([tokens[0]], [1.0])
    assert abs(confidences[0] - float(logits[0].softmax(dim=0)[tokens[0]])) < 1e-6
    shaped = (logits[1] / 0.7).softmax(dim=0)
    assert tokens[1] in proposals[1][0] and len(proposals[1][0]) == 8
    assert abs(confidences[1] - float(shaped[tokens[1]])) < 1e-6
    alone = shaping.propose(lambda ids: ids, logits[1:], params[1:], [10], [1], 8)
    assert (alone[0], alone[2]) == (tokens[1:], confidences[1:])


def test_the_target_s_tokens_are_the_argmax_or_the_race_keyed_by_the_position_each_row_fills():
    """Greedy rows take the argmax; a raced session's rows up to its last filled one take the race over the whole
    vocabulary of its shaped p, keyed by (seed, the position the row fills); the tensor race on the CPU gives the same
    winners; rows past a session's filled ones (the batch's padding) are never read."""
    gen = torch.Generator().manual_seed(8)
    vocab, width = 3000, 4
    logits = torch.randn(3, width, vocab, generator=gen) * 3
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=11, drafter_invariant=True),
        SamplingParams(temperature=1.0, top_k=40, seed=2**63 + 5, drafter_invariant=True),
    ]
    filled = [[20], [30, 31, 31], [7, 8, 9, 9]]
    wanted = shaping.target_tokens(params, logits.to(DEVICE), filled).cpu()
    assert wanted[0, 0] == logits[0, 0].argmax()
    for b in (1, 2):
        rows = len(filled[b])
        probs = shaping.shape([params[b]] * rows, logits[b, :rows].unsqueeze(1)).squeeze(1)
        keys = race_keys([params[b].seed] * rows, filled[b])
        assert torch.equal(wanted[b, :rows], race(probs, race_noise(keys, torch.arange(vocab))))


def test_a_logit_bias_moves_every_row_of_its_session_and_no_other():
    """`biased` adds a session's bias at its ids on each of its rows (the verifier's [B, W, V] logits), leaves the other
    sessions' rows and the logits it was given as they were, and hands back the same tensor where nobody has a bias."""
    logits = torch.randn(2, 3, 40, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(logit_bias=((5, 100.0), (7, -2.5))), SamplingParams()]
    before = logits.clone()
    out = shaping.adjusted(params, logits.to(DEVICE)).cpu()
    assert torch.equal(logits, before)
    expected = before.clone()
    expected[0, :, 5] += 100.0
    expected[0, :, 7] -= 2.5
    assert torch.equal(out, expected)
    assert (out[0].argmax(dim=-1) == 5).all() and torch.equal(out[1], before[1])
    plain = [SamplingParams(), SamplingParams(temperature=1.0)]
    assert shaping.adjusted(plain, logits) is logits


def test_a_drafter_biases_the_positions_its_token_map_gives_the_biased_ids():
    """A drafter whose output layer covers part of the vocabulary (a token map: position i is id map[i]) biases the
    positions of the biased ids it has, and a biased id it lacks changes nothing; its proposals then follow the
    biased logits: a bias of 100 all but forces the token, greedy and sampled."""
    token_map = torch.tensor([3, 9, 20, 21, 40])
    logits = torch.zeros(2, 5)
    params = [SamplingParams(logit_bias=((20, 100.0), (77, 100.0))), SamplingParams(temperature=1.0, seed=1, logit_bias=((9, 100.0), (40, -1.0)))]
    out = shaping.adjusted(params, logits, global_ids=lambda local: token_map[local])
    assert torch.equal(out, torch.tensor([[0.0, 0.0, 100.0, 0.0, 0.0], [0.0, 100.0, 0.0, 0.0, -1.0]]))
    tokens, proposals, _ = shaping.propose(lambda local: token_map[local], out, params, [4, 4], [1, 1], 3)
    assert tokens == [20, 9] and proposals[0] == ([20], [1.0])


def _penalized_by_hand(row: list[float], seen: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """vLLM's penalties on one row, token by token: repetition on what the prompt or output holds, then frequency and
    presence on what the output holds."""
    out = []
    for v, x in enumerate(row):
        if v in seen or v in output:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        out.append(x - p.frequency_penalty * output.count(v) - p.presence_penalty * (v in output))
    return out


def test_penalties_read_what_each_row_of_a_tree_sees():
    """Row r of a session's pass sees its tokens (prompt, then output from output_start) and the path to its node:
    its penalties count them, nothing else; a bias comes first; an unpenalized session of the batch is left alone;
    a drafter's token map reads each position's id."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 4, 12, generator=gen) * 2
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5, output_start=3, logit_bias=((2, 1.0),))
    tokens, paths = [1, 2, 3, 4, 4, 5], shaping.tree_paths([6, 4, 7], [-1, 0, 0])
    assert paths == [[], [6], [6, 4], [6, 7]]
    out = shaping.adjusted([p, SamplingParams()], logits.to(DEVICE), [(tokens, paths), None]).cpu()
    for r, path in enumerate(paths):
        row = logits[0, r].tolist()
        row[2] += 1.0
        expected = _penalized_by_hand(row, tokens[:3], tokens[3:] + path, p)
        assert out[0, r].tolist() == pytest.approx(expected, abs=1e-5), r
    assert torch.equal(out[1], logits[1])
    # A drafter's row over ids [9, 4, 1, 11] (its token map) sees the same context: each position as its id.
    token_map = torch.tensor([9, 4, 1, 11])
    row = logits[0, 0, :4]
    drafted = shaping.adjusted([p], row.unsqueeze(0), [(tokens, [[6]])], global_ids=lambda local: token_map[local])[0]
    assert drafted.tolist() == pytest.approx(_penalized_by_hand_at(row.tolist(), token_map.tolist(), tokens[:3], tokens[3:] + [6], p), abs=1e-5)


def _penalized_by_hand_at(row: list[float], ids: list[int], seen: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """`_penalized_by_hand` for a row whose position j holds vocabulary id ids[j] (no bias on those ids)."""
    full = [0.0] * (max(ids) + 1)
    for j, v in enumerate(ids):
        full[v] = row[j]
    penalized = _penalized_by_hand(full, seen, output, p)
    return [penalized[v] for v in ids]


def test_min_tokens_holds_back_its_tokens_at_the_rows_before_the_output_s_last_held_position():
    """Rows filling a position before output_start + min_tokens (the session's length plus the row's path) give the
    held-back tokens no chance; later rows, and a drafter's positions for them, are left as they were."""
    logits = torch.randn(1, 4, 10, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(output_start=3, min_tokens=5, held_back=(0, 4))
    tokens, paths = [1, 2, 3, 5, 6, 7], shaping.tree_paths([8, 9, 8], [-1, 0, 1])  # outputs of 3, then 4, 5, 6
    out = shaping.adjusted([p], logits.to(DEVICE), [(tokens, paths)]).cpu()
    assert (out[0, :2, [0, 4]] == float("-inf")).all() and torch.equal(out[0, 2:], logits[0, 2:])
    kept = [v for v in range(10) if v not in (0, 4)]
    assert torch.equal(out[0, :2, kept], logits[0, :2, kept])
    token_map = torch.tensor([4, 9, 0, 1])
    drafted = shaping.adjusted([p], logits[:, 0, :4], [(tokens, [[]])], global_ids=lambda local: token_map[local])[0]
    assert drafted[0] == drafted[2] == float("-inf") and torch.equal(drafted[[1, 3]], logits[0, 0, [1, 3]])


def test_allowed_token_ids_leave_every_other_token_no_chance_at_every_row():
    """Every row of a session with allowed_token_ids keeps their logits alone; another session is left as it was; a
    drafter's positions keep the allowed ids they hold, and a drafter holding none of them drafts unmasked."""
    logits = torch.randn(2, 3, 10, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(allowed_token_ids=(2, 7)), SamplingParams()]
    out = shaping.adjusted(params, logits.to(DEVICE)).cpu()
    others = [v for v in range(10) if v not in (2, 7)]
    assert (out[0][:, others] == float("-inf")).all() and torch.equal(out[0][:, [2, 7]], logits[0][:, [2, 7]])
    assert torch.equal(out[1], logits[1])
    token_map = torch.tensor([7, 3, 2, 5])
    drafted = shaping.adjusted(params[:1], logits[:1, 0, :4], global_ids=lambda local: token_map[local])[0]
    assert drafted[1] == drafted[3] == float("-inf") and torch.equal(drafted[[0, 2]], logits[0, 0, [0, 2]])
    none_held = shaping.adjusted(params[:1], logits[:1, 0, :4], global_ids=lambda local: torch.tensor([1, 3, 4, 5])[local])
    assert torch.equal(none_held[0], logits[0, 0, :4])


def test_bad_words_ban_a_word_s_last_token_where_each_row_s_output_ends_with_the_rest():
    """Row r sees the output (from output_start, never the prompt) then its path: a one-token word is banned at every
    row, a longer one's last token only where that context ends with its other tokens; bans that would leave a row no
    token at all are not made there; a drafter's positions are read as their ids."""
    logits = torch.randn(1, 4, 10, generator=torch.Generator().manual_seed(7))
    p = SamplingParams(output_start=2, bad_words=((9,), (5, 6, 8), (6, 3)))
    tokens, paths = [1, 5, 6], shaping.tree_paths([5, 6, 4], [-1, 0, 1])  # output [6]; paths [], [5], [5, 6], [5, 6, 4]
    out = shaping.adjusted([p], logits.to(DEVICE), [(tokens, paths)]).cpu()
    banned = {0: {9, 3}, 1: {9}, 2: {9, 8, 3}, 3: {9}}  # the prompt's 5 never counts: row 0 keeps 8
    for r, ids in banned.items():
        assert {v for v in range(10) if out[0, r, v] == float("-inf")} == ids, r
    only = SamplingParams(allowed_token_ids=(3, 9), output_start=2, bad_words=((9,), (6, 3)))
    kept = shaping.adjusted([only], logits[:, :2].to(DEVICE), [(tokens, paths[:2])]).cpu()
    assert kept[0, 0, 3] == logits[0, 0, 3] and kept[0, 0, 9] == logits[0, 0, 9]  # after 6, both banned: none is
    assert kept[0, 1, 9] == float("-inf") and kept[0, 1, 3] == logits[0, 1, 3]
    token_map = torch.tensor([8, 9, 0])
    drafted = shaping.adjusted([p], logits[:, 2, :3], [(tokens, [[5, 6]])], global_ids=lambda local: token_map[local])[0]
    assert drafted[0] == drafted[1] == float("-inf") and drafted[2] == logits[0, 2, 2]
