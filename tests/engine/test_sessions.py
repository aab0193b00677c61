"""specfleet.engine.sessions.SessionStore forgets the sessions no call has used for its idle time."""

from __future__ import annotations

import pytest

from specfleet.engine import SessionStore, UnknownSession, sessions


def test_sessions_idle_past_the_limit_are_forgotten_and_a_used_one_is_kept(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(sessions.time, "monotonic", lambda: clock[0])
    store = SessionStore(max_cache_bytes=1 << 20, max_sessions=8, idle_s=60.0)
    store.sync("old", 0, [1, 2, 3])
    store.sync("busy", 0, [4, 5])
    clock[0] += 40
    store.sync("busy", 2, [6])  # used again: its idle time starts over
    clock[0] += 21  # "old" unused for 61 s, "busy" for 21 s
    assert store.expire_idle() == 1 and store.get("old") is None and store.get("busy") is not None and store.expired == 1
    # The client comes back: the store knows nothing of its session, so it must resend every token.
    with pytest.raises(UnknownSession):
        store.sync("old", 3, [7])
    assert store.sync("old", 0, [1, 2, 3, 7]).token_ids == [1, 2, 3, 7]
    clock[0] += 61
    assert store.expire_idle() == 2 and len(store) == 0


def test_no_idle_limit_forgets_nothing(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(sessions.time, "monotonic", lambda: clock[0])
    store = SessionStore(max_cache_bytes=1 << 20, max_sessions=8)
    store.sync("s", 0, [1])
    clock[0] += 10**6
    assert store.expire_idle() == 0 and store.get("s") is not None
