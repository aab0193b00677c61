"""Batched forward passes over sessions: what the verifier and the drafters run.

`forward_batch` runs many sessions in one forward pass (`llama.forward`):
each session feeds its own new tokens at its own positions with its own
attention pattern among them (causal for a chain, ancestor-only for a token
tree), and the pass writes their keys and values into the session's cache
just past its cached prefix. The caller then keeps the positions it wants
(`Session.commit`): all of them for a prompt, the accepted path of a tree.
`prefill` rebuilds caches; `tree_pass` (verification) and `next_token_logits`
(drafting) are the two passes the services run, handed token ids and sessions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfleet.engine import llama, parallel
from specfleet.engine.kv import Session
from specfleet.engine.loading import LoadedModel


@dataclass
class ForwardItem:
    """One session's part of a batched forward pass."""

    session: Session
    input_ids: list[int]  # new tokens fed this pass (n of them)
    positions: list[int]  # their position ids
    attend: torch.Tensor | None = None  # [n, n] bool: new token i may attend to new token j; None = causal


def forward_batch(
    loaded: LoadedModel, items: list[ForwardItem], logits: bool = True, host: bool = True, runs: llama.Runs | None = None
) -> torch.Tensor | None:
    """One forward pass over many sessions: logits [B, N, V] float32 (row b valid for its first n_b positions).

    V is the vocabulary, or the token map's ids in its order when the model has one
    (`LoadedModel.global_ids` turns positions into vocabulary ids). With `host` the logits
    come back on the CPU, where the verifier and the drafter shape and sample them today;
    `host=False` leaves them on the model's device. `runs`: `loaded` is a stack of models
    (`stack.py`) and the items are sorted by model as `runs` says.

    Each session's new KV is written just past its cached prefix and is not yet
    part of it: the caller keeps what it wants with `Session.commit`.
    """
    model = loaded.model
    new_lens = [len(it.input_ids) for it in items]
    width = max(new_lens)
    # Padded in Python lists and sent to the device once: a tensor op per session costs more.
    ids_rows, pos_rows, attends = [], [], []
    for it, n in zip(items, new_lens):
        ids_rows.append(list(it.input_ids) + [0] * (width - n))
        pos_rows.append(list(it.positions) + [0] * (width - n))
        it.session.reserve(loaded.pool, n, loaded.max_context)
        if n == 1:
            attends.append(None)
        else:
            attends.append(it.attend if it.attend is not None else torch.ones(n, n, dtype=torch.bool).tril())
    places, kv_lens = [it.session.place() for it in items], [it.session.kv_len for it in items]
    call = (ids_rows, pos_rows, places, kv_lens, new_lens, attends, logits, runs)
    if model.parallel is None:
        out = execute(loaded, *call)
    else:  # the other ranks run the same pass on their heads (`rank.serve`)
        ops, loaded.pool.log = loaded.pool.log, []
        model.parallel.send(("pass", ops, _to_host(call)))
        try:
            out = execute(loaded, *call)
        except BaseException as err:  # the others are inside the pass's collectives: the group cannot go on
            parallel.abort(err)
    if out is None:
        return None
    return out.float().cpu() if host else out.float()


def execute(loaded: LoadedModel, ids_rows, pos_rows, places, kv_lens, new_lens, attends, logits, runs) -> torch.Tensor | None:
    """`forward_batch`'s pass itself, its inputs padded: a CUDA graph's where one fits, else `llama.forward`."""
    model = loaded.model
    out = None
    if loaded.graphs is not None and runs is None:
        out = loaded.graphs.run(ids_rows, pos_rows, places, kv_lens, new_lens, attends, logits)
    if out is None:
        out = llama.forward(
            model,
            torch.tensor(ids_rows, dtype=torch.long, device=model.device),
            torch.tensor(pos_rows, dtype=torch.long, device=model.device),
            loaded.pool.kv,
            places,
            kv_lens,
            new_lens,
            attends,
            logits=logits,
            runs=runs,
        )
    return out


def _to_host(call: tuple) -> tuple:
    """A pass's inputs as another rank receives them: tensors on the CPU (`on_device` moves them to its own)."""
    return _moved(call, torch.device("cpu"))


def on_device(call: tuple, device: torch.device) -> tuple:
    """Another rank's pass inputs (`_to_host`) on this rank's device, as `execute` takes them."""
    return _moved(call, device)


def _moved(call: tuple, device: torch.device) -> tuple:
    ids_rows, pos_rows, places, kv_lens, new_lens, attends, logits, runs = call
    move = lambda t: t if t is None or isinstance(t, int) else t.to(device)  # noqa: E731
    # Patterns stay on the host, where every attention mode lays out its masks.
    host = [None if a is None else a.cpu() for a in attends]
    return ids_rows, pos_rows, [move(p) for p in places], kv_lens, new_lens, host, logits, runs


def prefill_shares(needs: list[int], budget: int) -> list[int]:
    """Chunked prefill (the verifier's and each drafter service's `max_prefill_tokens`): of its `needs[i]` positions,
    how many session i prefills in a batch of `budget` (0: no limit), in the order given. All of them while the
    budget holds them, what is left for the first it does not, none for the rest: they wait for a later batch.
    A session with nothing to prefill (decoding) is never held back."""
    if budget <= 0:
        return list(needs)
    shares, left = [], budget
    for need in needs:
        shares.append(min(need, left))
        left -= shares[-1]
    return shares


# Rows of one prefill pass at most (bounds the [rows, V] logits a scored pass holds).
_PREFILL_ROWS = 2048


def prefill(
    loaded: LoadedModel,
    sessions: list[Session],
    keep_last: int = 1,
    score: bool = False,
    members: list[int] | None = None,
    ends: list[int] | None = None,
    reuse: bool = True,
) -> list[tuple[float, int]]:
    """Bring each session's cache up to all but its last `keep_last` tokens (or up to `ends[b]`: a chunk).

    Sessions are prefilled together in passes of similar lengths (padding at most
    a quarter of a pass's rows), apart from any decode step: rebuilding a long
    context inside a batched decode step would pad every other session to its
    length. With `score`, also returns per session (sum of log-probabilities,
    count) of each prefilled token's successor given what precedes it: how well
    the model knows this text. Without it, the pass skips the vocabulary projection.
    With `members`, `loaded` is a stack of models (`stack.py`) and session b is model members[b]'s.
    Without `reuse`, a session without a cache does not look its tokens up in the prefix cache (its caller did).
    """
    scores = [(0.0, 0)] * len(sessions)
    todo = []  # (index, session, first position to prefill, end)
    for i, session in enumerate(sessions):
        end = len(session.token_ids) - keep_last if ends is None else ends[i]
        session.crop_kv(end)
        if reuse and not score and session.prompt_logprobs is None:  # these need every position's logits
            session.reuse_prefix(loaded.pool, end)
        if session.kv_len < end:
            todo.append((i, session, session.kv_len, end))
    # Sessions that record their prompt's log-probabilities pass apart: only their passes project to the vocabulary.
    todo.sort(key=lambda t: (t[1].prompt_logprobs is not None, t[3] - t[2]))
    passes: list[list] = []
    rows = 0  # real (unpadded) rows of the last pass
    for t in todo:
        n = t[3] - t[2]
        # Sorted by length, so n is the widest of the pass: with t, its padded rows are (len + 1) * n.
        padded = (len(passes[-1]) + 1) * n if passes else 0
        apart = passes and (passes[-1][0][1].prompt_logprobs is None) != (t[1].prompt_logprobs is None)
        if passes and not apart and padded <= 1.25 * (rows + n) and padded <= _PREFILL_ROWS:
            passes[-1].append(t)
            rows += n
        else:
            passes.append([t])
            rows = n
    for group in passes:
        runs = None
        if members is not None:
            group.sort(key=lambda t: members[t[0]])
            runs = llama.Runs.of([members[t[0]] for t in group], loaded.model.device)
        items = [ForwardItem(session, session.token_ids[start:end], list(range(start, end))) for _, session, start, end in group]
        recording = group[0][1].prompt_logprobs is not None
        logits = forward_batch(loaded, items, logits=score or recording, runs=runs)
        for b, (i, session, start, end) in enumerate(group):
            session.commit(list(range(end - start)))
            if recording:
                session.prompt_logprobs.record(start, logits[b, : end - start], session.token_ids[start + 1 : end + 1])
            if session.pool.prefix_caching:  # its blocks are cached now, for the sessions of the next call
                session.pool.register(session)
            if score:
                scorer = loaded if members is None else loaded.members[members[i]]
                scores[i] = _score(scorer, logits[b, : end - start], session.token_ids[start + 1 : end + 1])
    return scores


def _score(loaded: LoadedModel, logits: torch.Tensor, successors: list[int]) -> tuple[float, int]:
    """(sum of log-probabilities of `successors` under `logits` [n, V], n)."""
    successors = torch.tensor(successors)
    log_probs = logits.log_softmax(dim=-1)
    if loaded.token_map is None:
        log_probs = log_probs.gather(1, successors.unsqueeze(1))
    else:
        # A successor outside the token map is one the model cannot propose: it scores as
        # unlikely as the model's least likely mapped token.
        local = loaded.local_index[successors]
        log_probs = torch.where(local >= 0, log_probs.gather(1, local.clamp(min=0).unsqueeze(1)).squeeze(1), log_probs.min(dim=1).values)
    return float(log_probs.sum()), len(successors)


@dataclass
class TreePass:
    """What a verification pass gives back: the target's logits after each session's root and nodes."""

    logits: torch.Tensor  # [B, 1 + N, V] on the model's device; row b valid for its first 1 + n_b positions
    depths: list[list[int]]  # per session, each node's depth below the root (1 for the root's children)


def tree_pass(loaded: LoadedModel, trees: list[tuple[Session, list[int], list[int]]]) -> TreePass:
    """One pass over (session, tree token ids, tree parents) triples: each session's last token (the root)
    followed by its tree's nodes, every node seeing itself and its ancestors.

    Each session's cache must hold all but its last token (`prefill(keep_last=1)`); the
    pass writes the root's and the nodes' KV past it, for `Session.commit` to keep a path.
    """
    items, depths = [], []
    for session, tokens, parents in trees:
        root_pos = len(session.token_ids) - 1
        n = len(tokens)
        # Row j: which of [root, node 0, ..., node n-1] token j sees (itself and its ancestors).
        # Built in Python, one tensor at the end: per-element tensor ops cost more than the pass.
        depth = [0] * n
        rows = [[True] + [False] * n]
        for i, parent in enumerate(parents):
            depth[i] = 1 if parent < 0 else depth[parent] + 1
            row = list(rows[parent + 1])
            row[i + 1] = True
            rows.append(row)
        depths.append(depth)
        attend = torch.tensor(rows) if n else None  # on the host, where the pass lays out its masks
        items.append(ForwardItem(session, [session.token_ids[-1], *tokens], [root_pos] + [root_pos + d for d in depth], attend))
    return TreePass(forward_batch(loaded, items, host=False), depths)


def next_token_logits(loaded: LoadedModel, sessions: list[Session], runs: llama.Runs | None = None) -> torch.Tensor:
    """[B, V] logits after each session's last token, on the model's device, in one pass
    (of a stack of models with `runs`: `forward_batch`).

    Each session feeds what its cache lacks (at least its last token), and its cache then
    holds all its tokens. V is the token map's ids when the model has one (`global_ids`).
    """
    items = [ForwardItem(s, s.token_ids[s.kv_len :], list(range(s.kv_len, len(s.token_ids)))) for s in sessions]
    fed = [len(item.input_ids) for item in items]
    logits = forward_batch(loaded, items, host=False, runs=runs)
    for session, n in zip(sessions, fed):
        session.commit(list(range(n)))
    device = logits.device
    return logits[torch.arange(len(fed), device=device), torch.tensor(fed, device=device) - 1]
