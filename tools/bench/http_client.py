"""The bench's HTTP client: one streamed `POST /v1/completions`, the way a vLLM user's client asks, used alike for
vLLM (bench/vllm.py) and for specfleet's own OpenAI-compatible API (bench/specfleet_http.py), so that the two are
measured through the same client, protocol and parsing."""

from __future__ import annotations

import json
import time

from tools.bench.systems import Output


def stream_completion(base: str, body: dict, timeout_s: float) -> Output:
    """`body` streamed from `base` (http://host:port) with return_token_ids: the output's token ids, when the first
    token came and when the last did; specfleet's `speculation` statistics where the final choice carries them."""
    import requests

    body = {**body, "stream": True, "return_token_ids": True}
    t_submit = time.perf_counter()
    t_first, ids, text_seen, stats = None, [], False, {}
    try:
        with requests.post(f"{base}/v1/completions", json=body, stream=True, timeout=timeout_s) as r:
            if r.status_code != 200:
                return Output([], t_submit, None, time.perf_counter(), error=f"HTTP {r.status_code}: {r.text[:300]}")
            for line in r.iter_lines():
                if not line or not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Output(ids, t_submit, t_first, time.perf_counter(), error=f"stream error: {chunk['error']}")
                for choice in chunk.get("choices", []):
                    new = choice.get("token_ids") or []
                    if (new or choice.get("text")) and t_first is None:
                        t_first = time.perf_counter()
                    text_seen = text_seen or bool(choice.get("text"))
                    ids.extend(new)
                    if choice.get("speculation"):
                        stats = speculation_stats(choice["speculation"])
    except requests.RequestException as err:
        return Output(ids, t_submit, t_first, time.perf_counter(), error=f"{type(err).__name__}: {err}")
    error = None
    if not ids and text_seen:
        error = "the server returned text without token ids (return_token_ids unsupported); cannot check exactness"
    return Output(ids, t_submit, t_first, time.perf_counter(), stats=stats, error=error)


def speculation_stats(fields: dict) -> dict:
    """specfleet's `speculation` JSON (protobuf's JSON form: zero fields left out) as the bench's stats of a gRPC reply."""
    stats = {key: fields.get(key, 0) for key in ("rounds", "draft_tokens", "accepted_tokens")}
    stats["drafters"] = {
        d["drafter"]: {key: d.get(key, 0) for key in ("rounds", "draft_tokens", "accepted_tokens")} for d in fields.get("drafters", [])
    }
    timings = ("draft_wall_ms", "draft_compute_ms", "verify_wall_ms", "verify_compute_ms", "draft_queue_ms", "verify_queue_ms", "router_ms")
    stats.update({key: fields.get(key, 0.0) for key in timings})
    stats["routed_domain"] = fields.get("domain", "")
    return stats
