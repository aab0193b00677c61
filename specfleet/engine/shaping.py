"""From a pass's logits to what the services send: the target's tokens and distributions, draft proposals.

Shaping is `specfleet.sampling`'s (temperature, then top-k, then top-p; a point
mass at temperature 0), applied per session as its request asked, on the
model's device. Random draws come from `sampling.generator_for(seed, position,
stream)` on the CPU and move to the device, so they are the same numbers on
any device; the exponential race's noise is integer hashing (`race_noise`),
the same bits on any device.

Shapes: B sessions, W rows per session (the root and the tree's nodes), V vocabulary, K proposal entries.
"""

from __future__ import annotations

from typing import Callable

import torch

from specfleet.engine.guides import GuideState, mask_rows
from specfleet.engine.sampling import (
    generator_for,
    probs_from_logits,
    race,
    race_keys,
    race_noise,
    race_vocabulary,
    sample_sparse,
    truncate,
)
from specfleet.sampling import STREAM_VERIFY, SamplingParams


# A session's context for its penalties: its tokens (prompt and output so far) and, per row of its pass, the tokens
# after them that the row sees (a tree's path from the root to the row's node; [] for the root's row).
Context = tuple[list[int], list[list[int]]]


def adjusted(
    params: list[SamplingParams],
    logits: torch.Tensor,
    contexts: list[Context | None] | None = None,
    global_ids: Callable[[torch.Tensor], torch.Tensor] | None = None,
    guides: list[GuideState | None] | None = None,
) -> torch.Tensor:
    """logits [B, W, V] (or [B, V]: one row a session) as each session asked before temperature: its logit bias added,
    every token outside its allowed_token_ids given no chance, then its penalties applied on what each row's context
    holds, in vLLM's order, and the tokens min_tokens holds back given no chance at rows before the output's
    min_tokens-th token, then every token its guide disallows at a row given none (`guides[b]`, the session's
    `GuideState`), then its bad words' (`contexts[b]` is needed for sessions that read their context). Everything
    reads these: the argmax of greedy sessions, the race's and rejection sampling's p, a drafter's q. The same tensor
    where nobody asked for any. `global_ids` (a drafter's, `propose`'s) turns positions
    along a row into vocabulary ids, for a model whose output layer covers part of the vocabulary: an id it lacks
    changes nothing."""
    sessions = [b for b, p in enumerate(params) if p.logit_bias or p.allowed_token_ids or p.reads_context]
    if not sessions:
        return logits
    logits = logits.clone()
    rows = logits if logits.dim() == 3 else logits.unsqueeze(1)  # a view: writes reach `logits`
    width = rows.shape[-1]
    ids_of = None if global_ids is None else global_ids(torch.arange(width).expand(len(params), width)).cpu()
    for b in sessions:
        ids = None if ids_of is None else ids_of[b]
        if params[b].logit_bias:
            _bias(rows[b], params[b].logit_bias, ids)
        if params[b].allowed_token_ids:
            _allow(rows[b], params[b].allowed_token_ids, ids)
        if params[b].penalized:
            _penalize(rows[b], params[b], *contexts[b], ids)
        if params[b].min_tokens and params[b].held_back:
            _hold_back(rows[b], params[b], *contexts[b], ids)
        if guides is not None and guides[b] is not None:
            _guide(rows[b], params[b], guides[b], *contexts[b], ids)
        if params[b].bad_words:
            _ban_words(rows[b], params[b], *contexts[b], ids)
    return logits


def _allow(rows: torch.Tensor, allowed: tuple[int, ...], ids_of: torch.Tensor | None) -> None:
    """Every token outside `allowed` given no chance (logit -inf) at every row of rows [W, V'] in place. A drafter whose
    vocabulary holds none of them drafts unmasked: what it proposes then has p = 0 at the target, and is rejected."""
    at = _positions(allowed, ids_of)
    if len(at) == 0:
        return
    keep = torch.zeros(rows.shape[-1], dtype=torch.bool, device=rows.device)
    keep[at.to(rows.device)] = True
    rows.masked_fill_(~keep, float("-inf"))


def _ban_words(rows: torch.Tensor, params: SamplingParams, tokens: list[int], paths: list[list[int]], ids_of: torch.Tensor | None) -> None:
    """At row r of rows [W, V'] (after the output, from output_start, and paths[r]), the last token of each bad word
    whose other tokens end that context given no chance (logit -inf), in place; except at a row they would leave no
    token at all (allowed_token_ids or the guide's all banned), which keeps its tokens: a distribution needs one."""
    longest = max(len(word) for word in params.bad_words) - 1
    tail = tokens[max(params.output_start, len(tokens) - longest) :]
    for r, path in enumerate(paths):
        context = (tail + path)[-longest:] if longest else []
        banned = [word[-1] for word in params.bad_words if len(word) == 1 or context[len(context) - len(word) + 1 :] == list(word[:-1])]
        if not banned:
            continue
        at = _positions(banned, ids_of)
        left = torch.isfinite(rows[r])
        left[at.to(rows.device)] = False
        if left.any():
            rows[r, at.to(rows.device)] = float("-inf")


def _positions(ids, ids_of: torch.Tensor | None) -> torch.Tensor:
    """Where vocabulary ids lie along a row: the ids themselves, or the positions that hold them where ids_of[j] is
    position j's id (a drafter's token map; an id it lacks has none)."""
    ids = torch.as_tensor(ids)
    return ids if ids_of is None else torch.isin(ids_of, ids).nonzero().squeeze(1)


def _guide(rows: torch.Tensor, params: SamplingParams, state: GuideState, tokens: list[int], paths: list[list[int]], ids_of) -> None:
    """Every token the guide disallows at row r of rows [W, V'] given no chance (logit -inf) in place, row r after the
    session's output (its tokens from output_start) and paths[r]."""
    bitmask = state.bitmask(tokens[params.output_start :], paths)
    if bitmask is not None:
        mask_rows(rows[: len(paths)], bitmask, ids_of)


def _hold_back(rows: torch.Tensor, params: SamplingParams, tokens: list[int], paths: list[list[int]], ids_of: torch.Tensor | None) -> None:
    """The held-back tokens given no chance (logit -inf) in place at each row of rows [W, V'] whose position (the
    session's length, plus its path's) comes before the output's min_tokens-th token."""
    early = [r for r, path in enumerate(paths) if len(tokens) + len(path) - params.output_start < params.min_tokens]
    if not early:
        return
    at = _positions(params.held_back, ids_of)
    rows[torch.tensor(early, device=rows.device).unsqueeze(1), at.to(rows.device).unsqueeze(0)] = float("-inf")


def _bias(rows: torch.Tensor, bias: tuple[tuple[int, float], ...], ids_of: torch.Tensor | None) -> None:
    """Each (id, value) of `bias` added to every row of rows [W, V'] in place; ids_of[j]: position j's vocabulary id."""
    ids = torch.tensor([token for token, _ in bias])
    values = torch.tensor([value for _, value in bias], dtype=rows.dtype)
    if ids_of is None:
        at = ids
    else:  # the positions whose vocabulary id is biased, each with its id's value
        table = torch.zeros(max(int(ids.max()), int(ids_of.max())) + 1, dtype=rows.dtype)
        table[ids] = values
        at = torch.isin(ids_of, ids).nonzero().squeeze(1)
        values = table[ids_of[at]]
    rows[:, at.to(rows.device)] += values.to(rows.device)


def _penalize(rows: torch.Tensor, params: SamplingParams, tokens: list[int], paths: list[list[int]], ids_of: torch.Tensor | None) -> None:
    """The penalties applied in place to rows [W, V'] of one session, row r seeing `tokens` then paths[r] (rows past
    the paths are padding, left as they are). Counts are taken over vocabulary ids, then read at each position's."""
    history = torch.tensor(tokens, dtype=torch.long)
    seen_ids = [int(history.max()) if len(tokens) else 0, *(max(path) for path in paths if path)]
    size = rows.shape[-1] if ids_of is None else max(int(ids_of.max()), *seen_ids) + 1
    output = torch.bincount(history[params.output_start :], minlength=size).to(rows.dtype)
    counts = output.expand(len(paths), size).clone()  # [R, size]: the output's counts with each row's path
    for r, path in enumerate(paths):
        if path:
            counts[r].index_add_(0, torch.tensor(path), torch.ones(len(path), dtype=rows.dtype))
    seen = counts > 0
    seen |= torch.zeros(size, dtype=torch.bool).index_fill_(0, history[: params.output_start], True)
    if ids_of is not None:
        counts, seen = counts[:, ids_of], seen[:, ids_of]
    counts, seen = counts.to(rows.device), seen.to(rows.device)
    block = rows[: len(paths)]
    if params.repetition_penalty != 1:
        block = torch.where(seen, torch.where(block > 0, block / params.repetition_penalty, block * params.repetition_penalty), block)
    block = block - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).to(block.dtype)
    rows[: len(paths)] = block


def tree_paths(tokens: list[int], parents: list[int]) -> list[list[int]]:
    """Per row of a tree's pass (the root's, then each node's), the tokens from the root to the row's node."""
    paths = [[]]
    for token, parent in zip(tokens, parents):
        paths.append(paths[parent + 1] + [token])
    return paths


def shape(params: list[SamplingParams], logits: torch.Tensor) -> torch.Tensor:
    """p [B, W, V] as each session asked (temperature, min-p, top-k, top-p), from logits [B, W, V]."""
    batch, width, vocab = logits.shape
    per_row = lambda values, dtype: torch.tensor([v for v in values for _ in range(width)], dtype=dtype, device=logits.device)  # noqa: E731
    return probs_from_logits(
        logits.reshape(batch * width, vocab),
        per_row([p.temperature for p in params], torch.float32),
        per_row([p.top_k for p in params], torch.long),
        per_row([p.top_p for p in params], torch.float32),
        per_row([p.min_p for p in params], torch.float32) if any(p.min_p > 0 for p in params) else None,
    ).reshape(batch, width, vocab)


def target_tokens(params: list[SamplingParams], logits: torch.Tensor, filled: list[list[int]]) -> torch.Tensor:
    """[B, W] the target's token at every row of sessions with a fixed one: the argmax for greedy sessions,
    the exponential race's winner over p for raced ones, keyed by the position the row fills
    (`filled[b]`, at most W entries; rows past them are padding, never read)."""
    raced = [b for b, p in enumerate(params) if p.raced]
    if not raced:
        return logits.argmax(dim=-1)
    # The argmax of greedy sessions' rows alone: over a raced session's it is a vocabulary-wide pass thrown away.
    wanted = torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device)
    greedy = [b for b, p in enumerate(params) if not p.raced]
    if greedy:
        wanted[greedy] = logits[greedy].argmax(dim=-1)
    # Each raced session's rows up to its last filled one (padding rows stay 0, never read).
    real = [(b, w, position) for b in raced for w, position in enumerate(filled[b])]
    sessions, rows = [b for b, _, _ in real], [w for _, w, _ in real]
    probs = shape([params[b] for b in sessions], logits[sessions, rows].unsqueeze(1)).squeeze(1)
    keys = race_keys([params[b].seed for b in sessions], [position for _, _, position in real], device=logits.device)
    wanted[sessions, rows] = race_vocabulary(probs, keys)
    return wanted


def verify_noise(params: list[SamplingParams], positions: list[int], width: int) -> tuple[list[list[float]], list[float]]:
    """Rejection sampling's draws per session, on the host where the walk reads them: uniforms (W - 1 a session, one
    per node) and one more (the final draw), from (seed, position of the session's next token, STREAM_VERIFY). The
    final draw comes first and node i takes the draw after it, so that neither depends on W, the widest tree of the
    batch the session was verified in."""
    draws = [torch.rand(width, generator=generator_for(p.seed, position, STREAM_VERIFY)).tolist() for p, position in zip(params, positions)]
    return [row[1:] for row in draws], [row[0] for row in draws]


def propose(
    global_ids: Callable[[torch.Tensor], torch.Tensor],
    logits: torch.Tensor,
    params: list[SamplingParams],
    positions: list[int],
    streams: list[int],
    proposal_top_k: int,
) -> tuple[list[int], list[tuple[list[int], list[float]]], list[float]]:
    """Draft tokens from logits [B, V']: (token ids, proposals as (ids, probs), confidences), one per session.

    `global_ids` turns positions along each row of the logits ([B] or [B, K] tensors, every
    row) into vocabulary ids (a token map's, `LoadedModel.global_ids`, or each stacked model's,
    `stack.Stack`); `streams[b]` is row b's draft model's stream of random draws.

    Greedy sessions: the argmax and its point mass. Sampled ones: drawn from the shaped
    distribution truncated to its `proposal_top_k` most likely tokens and renormalised, which
    is exactly what is sent. Raced sessions (drafter-invariant): the exponential race of that
    truncated q against the noise keyed by (seed, position) that the verifier races p with
    (verification.py, obligation 6). Confidence: the model's own probability of its token; for
    greedy sessions at temperature 1, since the point mass says nothing.
    """
    if all(p.greedy for p in params):
        local_tokens = logits.argmax(dim=1)
        confidences = logits.softmax(dim=1).gather(1, local_tokens.unsqueeze(1)).squeeze(1)
        tokens = global_ids(local_tokens).tolist()
        return tokens, [([t], [1.0]) for t in tokens], confidences.tolist()
    device = logits.device
    probs = shape(params, logits.unsqueeze(1)).squeeze(1)  # [B, V']
    ids, q = truncate(probs, proposal_top_k)
    # The draws use CPU generators (the same numbers on any device): K entries a session.
    ids_host, q_host = ids.cpu(), q.cpu()
    vocab_ids = global_ids(ids_host)  # [B, K]
    local_tokens = torch.empty(len(params), dtype=torch.long)
    raced = [b for b, p in enumerate(params) if p.raced]
    drawn = [b for b, p in enumerate(params) if not p.raced]
    if drawn:
        gens = [generator_for(params[b].seed, positions[b], streams[b]) for b in drawn]
        local_tokens[drawn] = sample_sparse(ids_host[drawn], q_host[drawn], gens)
    if raced:
        keys = race_keys([params[b].seed for b in raced], [positions[b] for b in raced])
        winners = race(q_host[raced], race_noise(keys, vocab_ids[raced]))
        local_tokens[raced] = ids_host[raced].gather(1, winners.unsqueeze(1)).squeeze(1)
    local_tokens = local_tokens.to(device)
    if any(p.greedy for p in params):
        greedy = torch.tensor([p.greedy for p in params], device=device).unsqueeze(1)
        probs = torch.where(greedy, logits.softmax(dim=1), probs)
    confidences = probs.gather(1, local_tokens.unsqueeze(1)).squeeze(1)
    tokens = global_ids(local_tokens).tolist()
    proposals = [
        ([t for t, p in zip(row_ids, row_q) if p > 0], [p for p in row_q if p > 0]) for row_ids, row_q in zip(vocab_ids.tolist(), q.tolist())
    ]
    return tokens, proposals, confidences.tolist()


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int) -> tuple[list[float], list[int], list[float]]:
    """Log-probabilities of token_ids[i] under row i of logits [len(token_ids), V], and each row's top_n tokens.

    The target's raw distribution, log_softmax of its logits before temperature, top-k and
    top-p, as vLLM reports them by default (`logprobs_mode="raw_logprobs"`): a client sees
    how likely the model found each token, whatever sampling shaped the choice."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(1, torch.tensor(token_ids, device=logp.device).unsqueeze(1)).squeeze(1).tolist()
    if top_n <= 0:
        return chosen, [], []
    top = logp.topk(top_n, dim=-1)
    return chosen, top.indices.flatten().tolist(), top.values.flatten().tolist()
