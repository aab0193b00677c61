"""Sessions by id: what a service holds for its clients, under two budgets (KV bytes, sessions) and an idle time."""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
from collections import OrderedDict

from specfleet.engine.kv import Session

log = logging.getLogger(__name__)


def salted(namespace: bytes, cache_salt: str) -> bytes:
    """Where a session's first block's hash starts from: its model's namespace, followed by a fixed-length digest of
    its request's salt where it has one, so that no two salts' blocks (nor a salt's and the unsalted) ever meet."""
    return namespace + b"\0salt:" + hashlib.blake2b(cache_salt.encode(), digest_size=16).digest() if cache_salt else namespace


class UnknownSession(Exception):
    """The store does not hold this session (or holds fewer tokens than the client assumed)."""


class SessionStore:
    """Sessions by id, least recently used first.

    Two budgets: `max_cache_bytes` of KV (over it, the least recently used
    sessions lose their KV but keep their token ids) and `max_sessions` (over
    it, the least recently used sessions are forgotten; their clients get
    SESSION_UNKNOWN and resend the full token ids).
    """

    def __init__(self, max_cache_bytes: int, max_sessions: int, idle_s: float = 0.0, namespace: bytes = b""):
        self.max_cache_bytes = max_cache_bytes
        self.max_sessions = max_sessions
        self.idle_s = idle_s  # `expire_idle` forgets sessions no call has used for this long (0: never)
        self.namespace = namespace  # its sessions' `Session.namespace`: the model's, where models share a KV pool
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently synced first
        self.evictions = 0
        self.expired = 0
        # Held by the model thread for a whole batch, so a release never races a batch using the session.
        self.lock = threading.RLock()

    def __len__(self) -> int:
        return len(self._sessions)

    def sync(self, session_id: str, prefix_length: int, new_token_ids: list[int], cache_salt: str = "") -> Session:
        """Apply a client's SessionSync: keep prefix_length tokens, append new ones. A session started afresh
        (prefix_length 0) shares cached blocks only with sessions of its `cache_salt`."""
        session = self._sessions.get(session_id)
        if prefix_length == 0:
            if session is None:
                session = Session(token_ids=[])
                self._sessions[session_id] = session
            session.truncate(0)
            session.namespace, session.cached_tokens = salted(self.namespace, cache_salt), None
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
