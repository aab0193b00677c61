"""specfleet.metrics' service telemetry over a real KV pool and session store: what the KV cache families report."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client import generate_latest

from specfleet.engine.kv import KVPool
from specfleet.engine.sessions import SessionStore
from specfleet.metrics import PassTelemetry

BLOCK = 4


def _samples(telemetry: PassTelemetry) -> dict[str, float]:
    text = generate_latest(telemetry.registry).decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_kv_usage_is_the_share_of_the_budget_sessions_hold_and_evicted_sessions_count_as_preempted():
    model = SimpleNamespace(num_layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    pool = KVPool(model, BLOCK, blocks=8)
    store = SessionStore(max_cache_bytes=10 * pool.block_bytes, max_sessions=2)
    pool.add_budget(store.max_cache_bytes)  # 10 blocks: more than the pool holds yet
    telemetry = PassTelemetry("verifier", lambda: [store], pools=lambda: [pool])
    assert _samples(telemetry)["specfleet:kv_cache_usage_perc"] == 0.0
    sessions = [store.sync(f"s{i}", 0, list(range(8))) for i in range(3)]
    for session in sessions:
        session.reserve(pool, 8, limit=1 << 20)  # two blocks each
    assert pool.held_blocks == 6
    assert _samples(telemetry)["specfleet:kv_cache_usage_perc"] == 6 / 10
    store.enforce_budget()  # room for two sessions: the least recently synced loses its KV (and is forgotten)
    samples = _samples(telemetry)
    assert samples["specfleet:num_preemptions_total"] == 1 and samples["specfleet:kv_cache_usage_perc"] == 4 / 10
    # Past its budget (a pass's sessions need more), the pool's blocks are the measure: the share stays at most 1.
    more = store.sync("s3", 0, list(range(40)))
    more.reserve(pool, 40, limit=1 << 20)
    samples = _samples(telemetry)
    assert pool.blocks - 1 > 10 and samples["specfleet:kv_cache_usage_perc"] == pool.held_blocks / (pool.blocks - 1) <= 1
