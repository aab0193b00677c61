"""router/response_store.py: stored responses within a byte budget, least recently used forgotten first."""

from __future__ import annotations

import json

import pytest

from router.openai_errors import ApiError
from router.response_store import ResponseStore


def response(i: int, text: str = "x" * 100) -> dict:
    return {"id": f"resp_{i}", "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]}


def size(i: int) -> int:
    return len(json.dumps(response(i))) + len(json.dumps([]))


def test_the_least_recently_used_is_forgotten_to_keep_the_budget():
    store = ResponseStore(3 * size(0))
    for i in range(3):
        assert store.put(response(i), [])
    store.get("resp_0")  # read: now the most recently used
    assert store.put(response(3), [])
    assert len(store) == 3 and store.used_bytes <= store.budget_bytes
    with pytest.raises(ApiError) as err:
        store.get("resp_1")
    assert err.value.status == 404 and "forgotten" in err.value.message
    assert [store.get(f"resp_{i}").response["id"] for i in (0, 2, 3)] == ["resp_0", "resp_2", "resp_3"]


def test_a_continuation_reads_the_context_then_the_output():
    store = ResponseStore(1 << 20)
    asked = [{"type": "message", "role": "user", "content": "hi"}]
    store.put(response(0, "hello"), asked)
    assert store.get("resp_0").conversation() == [*asked, *response(0, "hello")["output"]]


def test_one_larger_than_the_budget_is_not_kept_and_forgets_nothing():
    store = ResponseStore(2 * size(0))
    assert store.put(response(0), [])
    assert not store.put(response(1, "y" * 1000), [])
    assert len(store) == 1 and store.get("resp_0")


def test_delete_frees_its_bytes_and_an_unknown_id_is_a_404_naming_the_param():
    store = ResponseStore(1 << 20)
    store.put(response(0), [])
    store.delete("resp_0")
    assert (len(store), store.used_bytes) == (0, 0)
    with pytest.raises(ApiError) as err:
        store.delete("resp_0")
    assert (err.value.status, err.value.code) == (404, "not_found")
    with pytest.raises(ApiError) as err:
        store.get("resp_9", "previous_response_id")
    assert (err.value.param, err.value.code) == ("previous_response_id", "previous_response_not_found")


def test_a_store_of_no_bytes_keeps_nothing_and_says_so():
    store = ResponseStore(0)
    assert not store.put(response(0), [])
    with pytest.raises(ApiError) as err:
        store.get("resp_0")
    assert "router.response_store_mb is 0" in err.value.message
