"""verifier_service/verifier.py: chunked prefill (`max_prefill_tokens`).

A long prompt is prefilled a budget's worth a batch and answered `prefilling` until it is whole, while a
session already decoding is verified in every batch, before or after it in the batch; each session's
tokens are the target's, as without chunks."""

from __future__ import annotations

import torch

from specfleet.engine import SessionStore, load_model
from specfleet.sampling import SamplingParams
from verifier_service.verifier import Verifier, VerifyItem

BUDGET = 64


def _run(path: str, budget: int, short: list[int], long: list[int]) -> tuple[list[int], list]:
    """short's first batch alone, then batches of [long, short] until long is verified: short's first
    tokens, and per later batch (short's tokens, long's tokens or None while it prefills, long's cache)."""
    verifier = Verifier(load_model("target", path), SessionStore(1 << 30, 100), max_prefill_tokens=budget)
    (first,) = verifier.verify_batch([VerifyItem("short", 0, short, SamplingParams())])
    held = {"short": len(verifier.store.get("short").token_ids), "long": 0}
    batches = []
    while True:
        items = [
            VerifyItem("long", held["long"], [] if held["long"] else long, SamplingParams()),
            VerifyItem("short", held["short"], [], SamplingParams()),
        ]
        long_result, short_result = verifier.verify_batch(items)
        assert short_result.known and not short_result.prefilling and long_result.known
        held = {sid: len(verifier.store.get(sid).token_ids) for sid in held}
        batches.append((short_result.token_ids, None if long_result.prefilling else long_result.token_ids, verifier.store.get("long").kv_len))
        if not long_result.prefilling:
            return first.token_ids, batches


def test_a_long_prompt_is_prefilled_in_chunks_while_a_decoding_session_keeps_its_pace(random_family):
    path = str(random_family["target"])
    gen = torch.Generator().manual_seed(0)
    short = torch.randint(1, 300, (10,), generator=gen).tolist()
    long = torch.randint(1, 300, (300,), generator=gen).tolist()
    first, chunked = _run(path, BUDGET, short, long)
    # 64 of long's 299 positions a batch, until the last 43 fit.
    assert [cache for _, _, cache in chunked[:-1]] == [64, 128, 192, 256]
    assert [tokens is None for _, tokens, _ in chunked] == [True] * 4 + [False]
    assert all(len(tokens) == 1 for tokens, _, _ in chunked), "short decodes a token in every batch"
    _, whole = _run(path, 0, short, long)
    assert len(whole) == 1 and chunked[-1][1] == whole[0][1], "long's first token is the target's, chunked or not"
    # And short's tokens, batch after batch, are what it decodes alone.
    alone = Verifier(load_model("target", path), SessionStore(1 << 30, 100))
    tokens: list[int] = []
    for _ in range(1 + len(chunked)):
        (result,) = alone.verify_batch([VerifyItem("short", len(short) + len(tokens) if tokens else 0, [] if tokens else short, SamplingParams())])
        tokens += result.token_ids
    assert first + [t for batch, _, _ in chunked for t in batch] == tokens


def test_a_chunked_batch_looks_each_prompt_up_in_the_prefix_cache_once(random_family):
    """The budget counts what the prefix cache leaves to compute, and the batch then prefills without looking
    again: prefix_cache_queries counts each prompt's positions once."""
    loaded = load_model("target", str(random_family["target"]), prefix_caching=True)
    verifier = Verifier(loaded, SessionStore(1 << 30, 100), max_prefill_tokens=BUDGET)
    prompt = torch.randint(1, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    verifier.verify_batch([VerifyItem("a", 0, prompt, SamplingParams())])
    assert (loaded.pool.queries, loaded.pool.hits) == (39, 0)
    verifier.verify_batch([VerifyItem("b", 0, prompt, SamplingParams())])
    assert (loaded.pool.queries, loaded.pool.hits) == (78, 32), "b finds a's two full blocks"
