"""specfleet.engine.kv: the block pool's bookkeeping of the prefix cache (the passes over it: test_llama.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from specfleet.engine.kv import KVPool, Session
from tests.engine.test_free_runs import runs_of

BLOCK = 4


def _pool(blocks: int, prefix_caching: bool = True, relocate: bool = True) -> KVPool:
    # The pool reads only the cache's shape from its model.
    model = SimpleNamespace(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    pool = KVPool(model, BLOCK, blocks, prefix_caching=prefix_caching)
    pool.relocate = relocate  # a CPU's pool keeps each session consecutive
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


def test_blocks_a_grown_pool_adds_join_the_free_run_at_its_old_end():
    """Growth frees the new blocks in one batch: with the free blocks before them they are one gap, which a session
    longer than either part fits."""
    pool = _pool(blocks=8, prefix_caching=False)
    assert pool.allocate(3) == [1, 2, 3]  # the first run starts at block 1: nothing before it grows into it
    pool.reserve(16)
    assert list(pool._runs) == [(4, 12)] and pool.run(12) == list(range(4, 16)) and pool.blocks == 16
    check_pool(pool)


def _old_gap_for(free: set[int], count: int) -> int | None:
    """The pool's gap search before it kept its free runs: every free block sorted and walked, the first of the
    longest runs that hold `count`, then its start where nothing before it grows into it, else past its middle."""
    best = None  # (length, start)
    for start, length in runs_of(free):
        if length >= count and (best is None or length > best[0]):
            best = (length, start)
    if best is None:
        return None
    length, start = best
    if start - 1 in free or start == 1:
        return start
    return start + (length - count) // 2


def check_pool(pool: KVPool) -> None:
    """The pool's free runs are those of its free blocks, every block but the scratch is free, idle or held (one of
    them), and each count's gap is where the sort of every free block puts it."""
    assert list(pool._runs) == runs_of(pool._free)
    held, idle = set(pool._refs), set(pool._idle)
    assert not (held & idle or held & pool._free or idle & pool._free) and held | idle | pool._free == set(range(1, pool.blocks))
    for count in range(1, max((length for _, length in pool._runs), default=0) + 2):
        assert pool.gap_for(count) == _old_gap_for(pool._free, count), count


def _sync(pool: KVPool, session: Session) -> None:
    """A pass over the session's uncached tokens: room for them (grown in place, moved, or a new run), written, cached."""
    if not session.blocks:
        session.reuse_prefix(pool, len(session.token_ids) - 1)
    n = len(session.token_ids) - session.kv_len
    session.reserve(pool, n, limit=1 << 20)
    session.commit(list(range(n)))
    if pool.prefix_caching:
        pool.register(session)


@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-caching", "no-prefix-caching"])
@pytest.mark.parametrize("relocate", [True, False], ids=["cpu", "gpu"])
def test_a_random_walk_keeps_the_free_runs_and_finds_the_gaps_a_sort_finds(prefix_caching, relocate):
    """Sessions started (matching cached prefixes), grown (in place, moved, or the pool grown), rolled back and
    evicted at random, idle cached blocks forgotten and the pool reserved larger: after every step the pool's free
    runs match a sort of its free blocks, and `gap_for` picks what the sort-and-walk it replaced picked."""
    rng = random.Random(7)
    pool = _pool(blocks=8, prefix_caching=prefix_caching, relocate=relocate)
    pool.add_budget(48 * pool.block_bytes)  # past it, idle cached blocks are forgotten rather than the pool grown
    prompts = [[rng.randrange(1000) for _ in range(rng.randint(4, 24))] for _ in range(3)]
    sessions: list[Session] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.25 and len(sessions) < 16:
            session = Session(token_ids=rng.choice(prompts) + [rng.randrange(1000) for _ in range(rng.randint(1, 9))])
            sessions.append(session)
            _sync(pool, session)
        elif op < 0.6 and sessions:
            session = rng.choice(sessions)
            session.token_ids += [rng.randrange(1000) for _ in range(rng.randint(1, 12))]
            _sync(pool, session)
        elif op < 0.75 and sessions:
            session = rng.choice(sessions)
            session.truncate(rng.randint(0, len(session.token_ids)))
        elif op < 0.95 and sessions:
            sessions.pop(rng.randrange(len(sessions))).evict_kv()
        else:
            pool.reserve(pool.blocks + rng.randint(1, 8))
        check_pool(pool)
    assert pool.generation > 1 and (pool.relocations > 0) == relocate
    assert not prefix_caching or pool.hits > 0
