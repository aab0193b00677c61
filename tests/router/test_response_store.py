"""router/response_store.py: stored responses within a byte budget, least recently used forgotten first."""

from __future__ import annotations

import asyncio
import json

import pytest

from router.openai_errors import ApiError
from router.response_store import Responses, ResponseStore, Stored, identified, input_items


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
    responses = Responses(store)  # in memory alone: no redis_url
    asyncio.run(responses.delete("resp_0"))
    assert (len(store), store.used_bytes) == (0, 0)
    with pytest.raises(ApiError) as err:
        asyncio.run(responses.delete("resp_0"))
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


def test_input_items_are_the_conversation_paged_newest_first_by_default():
    items = [identified({"role": "user", "content": f"turn {i}"}) for i in range(5)]
    assert all(item["id"].startswith("msg_") and item["content"] == [{"type": "input_text", "text": f"turn {i}"}] for i, item in enumerate(items))
    stored = Stored(response(0), items)
    page = input_items(stored, limit=2)
    assert [i["id"] for i in page["data"]] == [items[4]["id"], items[3]["id"]] and page["has_more"]
    assert (page["first_id"], page["last_id"]) == (items[4]["id"], items[3]["id"])
    rest = input_items(stored, limit=10, after=page["last_id"])
    assert [i["id"] for i in rest["data"]] == [items[i]["id"] for i in (2, 1, 0)] and not rest["has_more"]
    assert [i["id"] for i in input_items(stored, order="asc", before=items[2]["id"])["data"]] == [items[0]["id"], items[1]["id"]]
    for bad, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")):
        with pytest.raises(ApiError) as err:
            input_items(stored, **bad)
        assert (err.value.status, err.value.param) == (400, param)


def test_an_item_with_an_id_keeps_it_and_an_assistant_s_text_is_output_text():
    kept = identified({"type": "function_call_output", "call_id": "c1", "output": "18 C", "id": "fco_1"})
    assert kept["id"] == "fco_1" and identified({"type": "function_call_output", "call_id": "c1", "output": "x"})["id"].startswith("fco_")
    assert identified({"role": "assistant", "content": "Hi."})["content"] == [{"type": "output_text", "text": "Hi."}]


def test_a_response_kept_again_under_its_id_replaces_the_first_and_its_bytes():
    """A background response is kept as it starts, then again once finished: one entry, counted once."""
    store = ResponseStore(1 << 20)
    store.put(response(0, "short"), [])
    store.put(response(0, "a longer text"), [])
    assert len(store) == 1 and store.used_bytes == len(json.dumps(response(0, "a longer text"))) + len(json.dumps([]))
    assert store.get("resp_0").response["output"][0]["content"][0]["text"] == "a longer text"
