"""router/server.py's per-call limits: sized to the longest request unless the config says otherwise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from router import server
from specfleet import config


def _config(**drafter) -> config.Config:
    cfg = config.Config()
    cfg.drafters = [config.DrafterServiceConfig(name="d", models=[config.DraftModelConfig(name="g", path="x")], **drafter)]
    return cfg


def test_unset_call_tokens_hold_one_full_context_session_and_never_fewer_than_32768():
    long, short = SimpleNamespace(max_context=131072), SimpleNamespace(max_context=512)
    verify, draft = server.call_limits(_config(), long, {"d": 2**31 - 1})  # an n-gram drafter: no context of its own
    assert verify.tokens == 131072 and draft["d"].tokens == 131072, "a 131,072-token request fits one call"
    verify, draft = server.call_limits(_config(), short, {"d": 512})
    assert verify.tokens == 32768 and draft["d"].tokens == 32768, "short contexts still batch up to 32,768 tokens a call"
    cfg = _config()
    cfg.router.routing.fusion_width = 3
    assert server.call_limits(cfg, long, {"d": 65536})[1]["d"].tokens == 3 * 65536, "a lockstep group of full contexts"


def test_configured_call_tokens_below_a_full_context_session_stop_the_router():
    cfg = _config()
    cfg.verifier.max_call_tokens = 8192
    with pytest.raises(server.StartupError, match=r"verifier.max_call_tokens \(8192\) is below the target's context \(131072 tokens\)"):
        server.call_limits(cfg, SimpleNamespace(max_context=131072), {"d": 512})
    cfg = _config(max_call_tokens=1000)
    with pytest.raises(server.StartupError, match=r"drafters\[d\].max_call_sessions \(256\) and max_call_tokens \(1000\) must hold"):
        server.call_limits(cfg, SimpleNamespace(max_context=2048), {"d": 4096})
    assert server.call_limits(_config(max_call_tokens=5000), SimpleNamespace(max_context=2048), {"d": 4096})[1]["d"].tokens == 5000
