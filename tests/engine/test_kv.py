"""specfleet.engine.kv: the block pool's bookkeeping of the prefix cache (the passes over it: test_llama.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from specfleet.engine.kv import KVPool, Session

BLOCK = 4


def _pool(blocks: int) -> KVPool:
    # The pool reads only the cache's shape from its model.
    model = SimpleNamespace(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    pool = KVPool(model, BLOCK, blocks, prefix_caching=True)
    pool.relocate = True  # a CPU's pool keeps each session consecutive
    return pool


def _grow(pool: KVPool, session: Session, tokens: list[int]) -> None:
    """What a pass does to a session's cache: room for `tokens`, their positions written, full blocks cached."""
    session.token_ids += tokens
    session.reserve(pool, len(tokens), limit=1 << 20)
    session.commit(list(range(len(tokens))))
    pool.register(session)


def test_a_session_that_moves_keeps_its_prefix_cached_where_its_kv_now_lies():
    """A session that cannot grow in place moves (one copy of its cache); its cached blocks' hashes go with it. Were
    they left on the old blocks, those would be idle and the first the pool forgets: the prefix's first block gone,
    no later one matches (each is known by the hash of all before it), and a client that resends the session (a
    drafter call that timed out, a prompt prefilled in chunks) prefills all of it again."""
    pool = _pool(blocks=8)
    session = Session(token_ids=[])
    _grow(pool, session, list(range(100, 112)))  # three full blocks
    blocker = pool.allocate(1, after=session.blocks[-1])  # another session's block, right after these
    first = list(session.blocks)
    _grow(pool, session, list(range(112, 116)))
    assert pool.relocations == 1 and not set(first) & set(session.blocks)
    assert [pool._cached[h] for h in session.hashes] == session.blocks
    # The old blocks are free, and making room (more consecutive blocks than any gap holds: every idle cached block
    # forgotten, then the pool grown) forgets nothing the session holds.
    assert set(first) <= pool._free
    taken = pool.allocate(pool.blocks)
    pool.release(taken + blocker)
    resent = Session(token_ids=list(session.token_ids) + [999])
    resent.reuse_prefix(pool, len(resent.token_ids) - 1)
    assert resent.blocks == session.blocks and resent.kv_len == 16 and pool.hits == 16


def test_idle_cached_blocks_are_forgotten_only_once_the_pool_holds_its_budget():
    """A new session that finds no gap grows the pool, up to its services' KV budget, rather than forget the idle
    blocks of a finished one (a conversation's earlier turns, say); at the budget it forgets them, least recently
    released first."""
    for budget, kept in ((0, False), (64, True)):
        pool = _pool(blocks=8)
        pool.add_budget(budget * pool.block_bytes)
        finished = Session(token_ids=[])
        _grow(pool, finished, list(range(100, 116)))  # four full blocks
        finished.evict_kv()  # its client is done: the blocks are idle, still cached
        other = Session(token_ids=[])
        _grow(pool, other, list(range(200, 220)))  # five blocks: no gap holds them beside the idle four
        again = Session(token_ids=list(range(100, 116)) + [7])
        again.reuse_prefix(pool, 16)
        assert (again.kv_len == 16) is kept, budget
        assert pool.blocks == (16 if kept else 8)
    pool = _pool(blocks=8)
    pool.add_budget(8 * pool.block_bytes)  # the pool already holds its budget
    finished = Session(token_ids=[])
    _grow(pool, finished, list(range(100, 116)))
    finished.evict_kv()
    _grow(pool, Session(token_ids=[]), list(range(200, 220)))
    assert pool.blocks == 8 and not pool._idle


def test_a_moved_session_leaves_a_block_it_shares_cached_where_the_other_holds_it():
    """A cached block another session also holds stays where it is: that session still reads it there."""
    pool = _pool(blocks=16)
    a = Session(token_ids=[])
    _grow(pool, a, list(range(8)))
    b = Session(token_ids=list(range(8)) + [50])
    b.reuse_prefix(pool, 8)
    assert b.blocks == a.blocks
    b.token_ids.pop()
    pool.allocate(1, after=b.blocks[-1])
    _grow(pool, b, [50, 51, 52, 53])
    assert pool.relocations == 1 and not set(a.blocks) & set(b.blocks)
    assert [pool._cached[h] for h in a.hashes] == a.blocks
    assert pool._cached[b.hashes[-1]] == b.blocks[-1]  # its own new block, cached where it lies


def test_a_session_s_cached_tokens_are_its_first_lookup_s():
    """vLLM's cached_tokens: of a prompt, what its first lookup in the prefix cache found; a rebuild after its KV was
    evicted (which finds its own output cached too) changes nothing."""
    pool = _pool(blocks=16)
    first = Session(token_ids=[])
    _grow(pool, first, list(range(100, 108)))  # two full blocks, cached
    second = Session(token_ids=list(range(100, 108)) + [1, 2, 3])
    assert second.cached_tokens is None
    second.reuse_prefix(pool, len(second.token_ids) - 1)
    assert second.cached_tokens == 8
    _grow(pool, second, [4, 5, 6, 7, 8])  # its own blocks past the prompt's, cached too
    second.evict_kv()
    second.reuse_prefix(pool, len(second.token_ids) - 1)
    assert second.kv_len == 12 and second.cached_tokens == 8
