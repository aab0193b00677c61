"""Sessions and their KV caches: token ids, the cached prefix in blocks, LRU eviction under a budget.

A session is a growing list of token ids plus a KV cache for a prefix of them.
Caches extend incrementally, roll back rejected positions, and are evicted
least-recently-used under a memory budget; an evicted cache is rebuilt from
the session's token ids on its next use (`runner.prefill`), so eviction never
changes output.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specfleet.engine.llama import LlamaModel

log = logging.getLogger(__name__)

# Positions a block holds: what a session's memory is rounded up to.
BLOCK_SIZE = 16
# Blocks a new pool holds; it doubles (one copy) when a session needs more than are free.
INITIAL_BLOCKS = 64


class KVPool:
    """The KV memory of one model: blocks of `block_size` positions on one token axis.

    `kv` is [layers, 2, KV heads, blocks x block_size, D] on the model's device. A session
    holds a list of blocks (its block table); position p of the session lies at
    `blocks[p // block_size] * block_size + p % block_size` of the token axis. Memory is
    proportional to the positions sessions hold, rounded up to a block each.

    Why one token axis rather than [blocks, block_size]: a session whose blocks are
    consecutive is one range of the axis, which attention reads as a view, nothing
    gathered (`llama.forward`). The pool keeps sessions consecutive where it can: a
    session grows into the block after its last one, and a new run starts in the middle of
    the largest free gap (leaving the session before it room to grow). On a CPU, where
    gathering scattered blocks at every layer of every pass costs more than the pass's
    attention, sessions are always consecutive: one that cannot grow in place moves to a
    gap that holds it (one copy of its cache), and the pool doubles when no gap does.
    Block 0 is the pool's scratch: never handed out, it is where padding reads (masked)
    and a CUDA graph's padding rows write.
    """

    def __init__(self, model: LlamaModel, block_size: int = BLOCK_SIZE, blocks: int = INITIAL_BLOCKS):
        if block_size < 1:
            raise ValueError(f"a KV block holds at least one position, not {block_size}")
        self.block_size = block_size
        self.kv = torch.zeros(model.num_layers, 2, model.kv_heads, blocks * block_size, model.head_dim, dtype=model.dtype, device=model.device)
        self._free: set[int] = set(range(1, blocks))
        self.block_bytes = model.num_layers * 2 * model.kv_heads * block_size * model.head_dim * self.kv.element_size()
        # Moving a session to keep it consecutive pays where attention reads views (a CPU, per session).
        self.relocate = model.device.type == "cpu"
        self.relocations = 0
        # Bumped when the pool's tensor is replaced (growth): captured CUDA graphs hold the old one.
        self.generation = 0

    @property
    def blocks(self) -> int:
        return self.kv.shape[3] // self.block_size

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def reserve(self, blocks: int) -> None:
        """Hold at least `blocks` blocks now (one allocation up front, as a GPU serving a budget wants)."""
        if blocks > self.blocks:
            self._grow(blocks)

    def allocate(self, count: int, after: int | None = None) -> list[int]:
        """`count` free blocks, following block `after` where those are free, else consecutive where a gap holds them."""
        if count <= 0:
            return []
        if after is not None and all(b in self._free for b in range(after + 1, after + 1 + count)):
            return self.take(range(after + 1, after + 1 + count))
        if not self.relocate and self.gap_for(count) is None and len(self._free) >= count:
            return self.take(sorted(self._free)[:count])  # scattered: attention gathers them
        return self.run(count)

    def run(self, count: int) -> list[int]:
        """`count` consecutive free blocks, the pool grown (doubling) when no gap holds them."""
        start = self.gap_for(count)
        if start is None:
            self._grow(max(2 * self.blocks, self.blocks + count))
            start = self.gap_for(count)
        return self.take(range(start, start + count))

    def release(self, blocks: list[int]) -> None:
        # Not zeroed: positions past a session's length are masked, and every value here is a finite
        # key or value written by some pass (or the zeros of allocation), so masked reads add 0.
        self._free.update(blocks)

    def take(self, blocks) -> list[int]:
        taken = list(blocks)
        self._free.difference_update(taken)
        return taken

    def gap_for(self, count: int) -> int | None:
        """Where `count` consecutive free blocks start: in the largest free gap, past its middle when a
        session's blocks precede it (room for that one to grow), else at its start; None if no gap fits."""
        best = None  # (length, start)
        for start, length in self._gaps():
            if length >= count and (best is None or length > best[0]):
                best = (length, start)
        if best is None:
            return None
        length, start = best
        if start - 1 in self._free or start == 1:  # nothing before it grows into it
            return start
        return start + (length - count) // 2

    def _gaps(self):
        """(first block, length) of every run of free blocks, in order."""
        run_start, previous = None, None
        for b in sorted(self._free):
            if previous is None or b != previous + 1:
                if run_start is not None:
                    yield run_start, previous - run_start + 1
                run_start = b
            previous = b
        if run_start is not None:
            yield run_start, previous - run_start + 1

    def move(self, blocks: list[int], to: list[int], length: int) -> None:
        """Copy positions [0, length) of a session from `blocks` to `to` (same order), in one indexed copy."""
        src, dst = self.index(blocks, length), self.index(to, length)
        self.kv[:, :, :, dst] = self.kv[:, :, :, src]
        self.relocations += 1

    def index(self, blocks: list[int], length: int) -> torch.Tensor:
        """[length] long on the pool's device: where positions [0, length) of a session holding `blocks` lie."""
        bs = self.block_size
        table = torch.tensor(blocks, dtype=torch.long, device=self.kv.device)
        return (table[:, None] * bs + torch.arange(bs, device=self.kv.device)).view(-1)[:length]

    def _grow(self, blocks: int) -> None:
        old = self.kv
        shape = list(old.shape)
        shape[3] = blocks * self.block_size
        self.kv = torch.zeros(shape, dtype=old.dtype, device=old.device)
        self.kv[:, :, :, : old.shape[3]] = old
        self._free.update(range(old.shape[3] // self.block_size, blocks))
        self.generation += 1


class UnknownSession(Exception):
    """The store does not hold this session (or holds fewer tokens than the client assumed)."""


@dataclass
class Session:
    token_ids: list[int]
    kv_len: int = 0
    # Positions [0, kv_len) of the cache lie in `blocks` of `pool` (KVPool's layout); no blocks, no cache.
    pool: KVPool | None = None
    blocks: list[int] = field(default_factory=list)
    used_at: float = 0.0  # time.monotonic() of the last call that synced it (SessionStore.expire_idle)

    def place(self) -> int | torch.Tensor:
        """Where the cache lies on the pool's token axis: its first position's index when its blocks are
        consecutive (a range, read as a view), else every held position's index ([blocks x block size])."""
        first = self.blocks[0]
        if self.blocks[-1] - first == len(self.blocks) - 1 and all(b == first + i for i, b in enumerate(self.blocks)):
            return first * self.pool.block_size
        return self.pool.index(self.blocks, len(self.blocks) * self.pool.block_size)

    def kv_bytes(self) -> int:
        return 0 if self.pool is None else len(self.blocks) * self.pool.block_bytes

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens (rolling back rejected drafts)."""
        del self.token_ids[length:]
        self.crop_kv(length)

    def crop_kv(self, length: int) -> None:
        if length < self.kv_len:
            self.kv_len = length
            self._trim()

    def reserve(self, pool: KVPool, count: int, limit: int) -> None:
        """Make room for `count` positions past the cached prefix, in blocks of `pool`; at most `limit` positions in all."""
        if self.kv_len + count > limit:
            raise ValueError(f"a session of {self.kv_len + count} positions exceeds the model's {limit}")
        self.pool = pool
        need = -(-(self.kv_len + count) // pool.block_size) - len(self.blocks)
        if need <= 0:
            return
        after = self.blocks[-1] if self.blocks else None
        added = pool.allocate(need, after)
        if after is not None and added[0] != after + 1 and pool.relocate and self.kv_len:
            # Cannot grow in place: move to a gap that holds all of it rather than be read scattered.
            pool.release(added)
            moved = pool.run(len(self.blocks) + need)
            pool.move(self.blocks, moved[: len(self.blocks)], self.kv_len)
            pool.release(self.blocks)
            self.blocks = moved
            return
        self.blocks += added

    def commit(self, rows: list[int]) -> None:
        """Keep these of the positions the last forward pass wrote past the cached prefix, in this order."""
        if rows != list(range(len(rows))):
            index = self.pool.index(self.blocks, len(self.blocks) * self.pool.block_size)
            kv = self.pool.kv
            src = index[torch.tensor(rows, device=kv.device) + self.kv_len]
            kv[:, :, :, index[self.kv_len : self.kv_len + len(rows)]] = kv[:, :, :, src]
        self.kv_len += len(rows)
        self._trim()

    def _trim(self) -> None:
        """Free the blocks past the cached prefix: a rollback gives whole blocks back."""
        keep = -(-self.kv_len // self.pool.block_size) if self.pool is not None else 0
        if len(self.blocks) > keep:
            self.pool.release(self.blocks[keep:])
            del self.blocks[keep:]

    def evict_kv(self) -> None:
        if self.blocks:
            self.pool.release(self.blocks)
        self.blocks = []
        self.pool = None
        self.kv_len = 0


class SessionStore:
    """Sessions by id, least recently used first.

    Two budgets: `max_cache_bytes` of KV (over it, the least recently used
    sessions lose their KV but keep their token ids) and `max_sessions` (over
    it, the least recently used sessions are forgotten; their clients get
    SESSION_UNKNOWN and resend the full token ids).
    """

    def __init__(self, max_cache_bytes: int, max_sessions: int, idle_s: float = 0.0):
        self.max_cache_bytes = max_cache_bytes
        self.max_sessions = max_sessions
        self.idle_s = idle_s  # `expire_idle` forgets sessions no call has used for this long (0: never)
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently synced first
        self.evictions = 0
        self.expired = 0
        # Held by the model thread for a whole batch, so a release never races a batch using the session.
        self.lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._sessions)

    def sync(self, session_id: str, prefix_length: int, new_token_ids: list[int]) -> Session:
        """Apply a client's SessionSync: keep prefix_length tokens, append new ones."""
        session = self._sessions.get(session_id)
        if prefix_length == 0:
            if session is None:
                session = Session(token_ids=[])
                self._sessions[session_id] = session
            session.truncate(0)
        elif session is None or len(session.token_ids) < prefix_length:
            raise UnknownSession(session_id)
        else:
            session.truncate(prefix_length)
        session.token_ids.extend(new_token_ids)
        self._sessions.move_to_end(session_id)
        session.used_at = time.monotonic()
        return session

    def expire_idle(self, now: float | None = None) -> int:
        """Forget the sessions no call has used for idle_s: a client that died without releasing its sessions
        (a router killed) leaves nothing held for longer. A client that comes back gets SESSION_UNKNOWN and
        resends the full token ids. Returns how many it forgot."""
        if self.idle_s <= 0:
            return 0
        cutoff = (time.monotonic() if now is None else now) - self.idle_s
        with self.lock:
            # In sync order: the idle ones are the first, up to the first one used since the cutoff.
            stale = list(itertools.takewhile(lambda sid: self._sessions[sid].used_at < cutoff, self._sessions))
            for sid in stale:
                self._sessions.pop(sid).evict_kv()
            self.expired += len(stale)
        if stale:
            log.info("forgot %d sessions that no call used for %.0f s (their client went away without releasing them)", len(stale), self.idle_s)
        return len(stale)

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def release(self, session_ids: list[str], keep_tokens: bool) -> int:
        with self.lock:
            return self._release(session_ids, keep_tokens)

    def _release(self, session_ids: list[str], keep_tokens: bool) -> int:
        released = 0
        for sid in session_ids:
            session = self._sessions.get(sid)
            if session is None:
                continue
            released += 1
            session.evict_kv()
            if not keep_tokens:
                del self._sessions[sid]
        return released

    def enforce_budget(self, protect: set[str] = frozenset()) -> None:
        """Evict least recently used sessions until within budget; `protect` ids are in use now."""
        while len(self._sessions) > self.max_sessions:
            victim = next((sid for sid in self._sessions if sid not in protect), None)
            if victim is None:
                break
            self._sessions.pop(victim).evict_kv()
            self.evictions += 1
        total = sum(s.kv_bytes() for s in self._sessions.values())
        for sid, session in self._sessions.items():
            if total <= self.max_cache_bytes:
                break
            if sid in protect or session.kv_bytes() == 0:
                continue
            total -= session.kv_bytes()
            session.evict_kv()
            self.evictions += 1
