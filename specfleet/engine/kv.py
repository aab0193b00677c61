"""Sessions and their KV caches: token ids, the cached prefix, LRU eviction under a budget.

A session is a growing list of token ids plus a KV cache for a prefix of them.
Caches extend incrementally, roll back rejected positions, and are evicted
least-recently-used under a memory budget; an evicted cache is rebuilt from
the session's token ids on its next use (`runner.prefill`), so eviction never
changes output.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from specfleet.engine.llama import LlamaModel

log = logging.getLogger(__name__)


class KVPool:
    """The KV memory of one model: fixed slots of `positions` positions, one per session holding a cache.

    `kv` is [layers, 2, slots, KV heads, positions, head dim] on the model's device. A session
    takes a slot when it first needs a cache and keeps it until its cache is evicted: it grows
    into the slot (a write past its length) and rolls back in it (a length change), never moving.

    Fixed slots rather than paged blocks: the sessions of a pass attend in one call over their
    slots' range as one strided view of the pool (`llama.forward`), with nothing gathered when
    their slots are adjacent (the lowest free slot is handed out first, so they mostly are), and
    plain SDPA needs no block table; the same tensors every pass is what CUDA graphs need. The
    price is memory: a slot holds `positions` (the model's context) whatever the session's length,
    and the cache budget counts whole slots. The pool grows (doubling, one copy) when every slot
    is taken, so a tiny budget still serves the sessions of the pass in hand.
    """

    def __init__(self, model: LlamaModel, positions: int):
        self.positions = positions
        self.kv = torch.zeros(model.num_layers, 2, 0, model.kv_heads, positions, model.head_dim, dtype=model.dtype, device=model.device)
        self._free: list[int] = []  # a heap: the lowest free slot first
        self.slot_bytes = model.num_layers * 2 * model.kv_heads * positions * model.head_dim * self.kv.element_size()
        # Bumped when the pool's tensor is replaced (growth): captured CUDA graphs hold the old one.
        self.generation = 0

    @property
    def slots(self) -> int:
        return self.kv.shape[2]

    def acquire(self) -> int:
        if not self._free:
            self._grow(max(4, 2 * self.slots))
        return heapq.heappop(self._free)

    def reserve(self, slots: int) -> None:
        """Hold at least `slots` slots now (one allocation up front, as a GPU serving a budget wants)."""
        if slots > self.slots:
            self._grow(slots)

    def release(self, slot: int) -> None:
        # Not zeroed: positions past a session's length are masked, and every value here is a finite
        # key or value written by some pass (or the zeros of allocation), so masked reads add 0.
        heapq.heappush(self._free, slot)

    def _grow(self, slots: int) -> None:
        old = self.kv
        shape = list(old.shape)
        shape[2] = slots
        self.kv = torch.zeros(shape, dtype=old.dtype, device=old.device)
        self.kv[:, :, : old.shape[2]] = old
        for added in range(old.shape[2], slots):
            heapq.heappush(self._free, added)
        self.generation += 1


class UnknownSession(Exception):
    """The store does not hold this session (or holds fewer tokens than the client assumed)."""


@dataclass
class Session:
    token_ids: list[int]
    kv_len: int = 0
    # Positions [0, kv_len) of the pool's slot `slot` hold the KV of token_ids[:kv_len]; no slot, no cache.
    pool: KVPool | None = None
    slot: int | None = None
    used_at: float = 0.0  # time.monotonic() of the last call that synced it (SessionStore.expire_idle)

    @property
    def kv(self) -> torch.Tensor | None:
        """This session's slot: [layers, 2, KV heads, positions, head dim], a view of the pool."""
        return None if self.slot is None else self.pool.kv[:, :, self.slot]

    def kv_bytes(self) -> int:
        return 0 if self.slot is None else self.pool.slot_bytes

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens (rolling back rejected drafts)."""
        del self.token_ids[length:]
        self.crop_kv(length)

    def crop_kv(self, length: int) -> None:
        self.kv_len = min(self.kv_len, length)

    def reserve(self, pool: KVPool, count: int) -> None:
        """Make room for `count` positions past the cached prefix: a slot of `pool`, if it has none."""
        if self.kv_len + count > pool.positions:
            raise ValueError(f"a session of {self.kv_len + count} positions exceeds the model's {pool.positions}")
        if self.slot is None:
            self.pool, self.slot = pool, pool.acquire()

    def commit(self, rows: list[int]) -> None:
        """Keep these of the positions the last forward pass wrote past the cached prefix, in this order."""
        if rows != list(range(len(rows))):
            kv = self.pool.kv
            src = torch.tensor(rows, device=kv.device) + self.kv_len
            kv[:, :, self.slot, :, self.kv_len : self.kv_len + len(rows)] = kv[:, :, self.slot, :, src]
        self.kv_len += len(rows)

    def evict_kv(self) -> None:
        if self.slot is not None:
            self.pool.release(self.slot)
        self.pool = self.slot = None
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
