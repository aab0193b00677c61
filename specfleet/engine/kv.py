"""Sessions and their KV caches: token ids, the cached prefix, LRU eviction under a budget.

A session is a growing list of token ids plus a KV cache for a prefix of them.
Caches extend incrementally, roll back rejected positions, and are evicted
least-recently-used under a memory budget; an evicted cache is rebuilt from
the session's token ids on its next use (`runner.prefill`), so eviction never
changes output.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from specfleet.engine.llama import LlamaModel


class UnknownSession(Exception):
    """The store does not hold this session (or holds fewer tokens than the client assumed)."""


@dataclass
class Session:
    token_ids: list[int]
    kv_len: int = 0
    # [layers, 2, KV heads, capacity, head dim]; positions [0, kv_len) hold the KV of
    # token_ids[:kv_len]. Spare capacity makes appending a write, not a copy.
    kv: torch.Tensor | None = None

    def kv_bytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    def truncate(self, length: int) -> None:
        """Keep only the first `length` tokens (rolling back rejected drafts)."""
        del self.token_ids[length:]
        self.crop_kv(length)

    def crop_kv(self, length: int) -> None:
        self.kv_len = min(self.kv_len, length)

    def reserve(self, model: LlamaModel, count: int) -> None:
        """Make room for `count` positions past the cached prefix."""
        needed = self.kv_len + count
        if self.kv is not None and needed <= self.kv.shape[3]:
            return
        # Doubling keeps appends amortised O(1) per position.
        capacity = max(64, 1 << (needed - 1).bit_length())
        # Zeros, not empty: the batched attention path reads (masked) positions past a session's end.
        grown = torch.zeros(
            model.num_layers, 2, model.kv_heads, capacity, model.head_dim, dtype=model.dtype, device=model.device
        )
        if self.kv is not None and self.kv_len:
            grown[:, :, :, : self.kv_len] = self.kv[:, :, :, : self.kv_len]
        self.kv = grown

    def commit(self, rows: list[int]) -> None:
        """Keep these of the positions the last forward pass wrote past the cached prefix, in this order."""
        if rows != list(range(len(rows))):
            src = torch.tensor(rows, device=self.kv.device) + self.kv_len
            self.kv[:, :, :, self.kv_len : self.kv_len + len(rows)] = self.kv[:, :, :, src]
        self.kv_len += len(rows)

    def evict_kv(self) -> None:
        self.kv = None
        self.kv_len = 0


class SessionStore:
    """Sessions by id, least recently used first.

    Two budgets: `max_cache_bytes` of KV (over it, the least recently used
    sessions lose their KV but keep their token ids) and `max_sessions` (over
    it, the least recently used sessions are forgotten; their clients get
    SESSION_UNKNOWN and resend the full token ids).
    """

    def __init__(self, max_cache_bytes: int, max_sessions: int):
        self.max_cache_bytes = max_cache_bytes
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self.evictions = 0
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
        return session

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
            if keep_tokens:
                session.evict_kv()
            else:
                del self._sessions[sid]
        return released

    def enforce_budget(self, protect: set[str] = frozenset()) -> None:
        """Evict least recently used sessions until within budget; `protect` ids are in use now."""
        while len(self._sessions) > self.max_sessions:
            victim = next((sid for sid in self._sessions if sid not in protect), None)
            if victim is None:
                break
            del self._sessions[victim]
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
