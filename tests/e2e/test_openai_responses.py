"""OpenAI's Responses API, POST /v1/responses (router/openai_responses.py), driven by the official `openai` client
against a running `specfleet serve` (test_openai_api.py's): a chat request's output in the Responses API's shape."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from tests.e2e import test_openai_api as served
from tests.e2e.test_openai_api import API_KEY, MAX_TOKENS, PROMPTS, TIME, WEATHER
from tests.helpers import target_greedy
from tests.operations import metrics

# test_openai_api.py's server and client (a cluster of this module's own): the random target with a chat template.
api, client, target_with_template, tokenizer = served.api, served.client, served.target_with_template, served.tokenizer

MODEL = "random-target"
DRAFTING = {"speculation": {"max_draft_tokens": 4}}
# The chat tools in the Responses API's shape: each function's fields beside its type.
FUNCTIONS = [{"type": "function", **tool["function"]} for tool in (WEATHER, TIME)]


def greedy(**fields) -> dict:
    return {"model": MODEL, "temperature": 0, "max_output_tokens": MAX_TOKENS, "extra_body": DRAFTING, **fields}


def chat_greedy(client, messages: list[dict], **fields):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS, extra_body=DRAFTING, **fields)


def test_greedy_output_is_the_chat_completion_s_and_the_target_s_with_the_same_usage(client, tokenizer, target_with_template):
    messages = [{"role": "user", "content": PROMPTS[0]}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = tokenizer.decode(target_greedy(str(target_with_template), prompt, MAX_TOKENS), skip_special_tokens=True)
    chat = chat_greedy(client, messages)
    assert chat.choices[0].message.content == expected != ""
    parts = [{"role": "user", "content": [{"type": "input_text", "text": PROMPTS[0]}]}]
    for given in (PROMPTS[0], parts, [{"type": "message", **messages[0]}]):
        reply = client.responses.create(**greedy(input=given, store=False, metadata={"run": "1"}, user="u1"))
        assert reply.output_text == expected, given
        assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == MODEL
        assert reply.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
        assert (reply.metadata, reply.user, reply.temperature, reply.max_output_tokens) == ({"run": "1"}, "u1", 0, MAX_TOKENS)
        (message,) = reply.output
        assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text") and message.id.startswith("msg_")
        usage, counted = reply.usage, chat.usage
        assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
            counted.prompt_tokens,
            counted.completion_tokens,
            counted.total_tokens,
        )
        # The chat's request cached the prompt's full blocks (of 16 tokens) before its last token: this one found them.
        assert usage.input_tokens_details.cached_tokens == (usage.input_tokens - 1) // 16 * 16
        assert usage.output_tokens_details.reasoning_tokens == 0
        assert reply.model_extra["speculation"]["rounds"] >= 1
    # store: true, OpenAI's default, keeps the response; the output is the same.
    kept = client.responses.create(**greedy(input=PROMPTS[0], store=True))
    assert (kept.output_text, kept.store, reply.store) == (expected, True, False)


def test_instructions_are_a_system_message_first(client):
    chat = chat_greedy(client, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[1]}])
    reply = client.responses.create(**greedy(instructions="Be brief.", input=PROMPTS[1]))
    assert reply.output_text == chat.choices[0].message.content and reply.instructions == "Be brief."
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    inline = client.responses.create(**greedy(input=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[1]}]))
    assert (inline.output_text, inline.usage.input_tokens) == (reply.output_text, reply.usage.input_tokens)
    assert client.responses.create(**greedy(input=PROMPTS[1])).usage.input_tokens < reply.usage.input_tokens


def test_streamed_events_are_well_formed_and_their_deltas_are_the_unary_text(client):
    args = greedy(input=PROMPTS[2])
    unary = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    opened = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    closed = ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert types[:4] == opened and types[-4:] == closed and set(types[4:-4]) == {"response.output_text.delta"}, types
    deltas = [e.delta for e in events[4:-4]]
    assert len(deltas) >= 2 and "".join(deltas) == unary.output_text == events[-4].text != ""
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2]) and events[-2].item.id == item_id
    assert events[-2].item.content[0].text == unary.output_text
    created, completed = events[0].response, events[-1].response
    assert (created.status, created.output, created.usage) == ("in_progress", [], None) and created.id == completed.id == events[1].response.id
    assert completed.output_text == unary.output_text and completed.status == unary.status
    # The same but for the prompt's tokens the prefix cache held, which the unary request cached for the stream.
    assert completed.usage.model_dump(exclude={"input_tokens_details"}) == unary.usage.model_dump(exclude={"input_tokens_details"})
    # The client's stream helper reads the events into the same response.
    with client.responses.stream(**args) as stream:
        assert stream.get_final_response().output_text == unary.output_text


def test_output_cut_by_max_output_tokens_is_incomplete_with_the_reason_unary_and_streaming(client):
    args = dict(model=MODEL, input=PROMPTS[0], temperature=0, max_output_tokens=3, extra_body={"ignore_eos": True})
    reply = client.responses.create(**args)
    assert (reply.status, reply.incomplete_details.reason, reply.usage.output_tokens) == ("incomplete", "max_output_tokens", 3)
    assert reply.output[0].status == "incomplete"
    final = list(client.responses.create(**args, stream=True))[-1]
    assert final.type == "response.completed" and (final.response.status, final.response.incomplete_details.reason) == (
        "incomplete",
        "max_output_tokens",
    )
    # An output that ends before the limit is complete.
    done = client.responses.create(
        model=MODEL, input=PROMPTS[0], temperature=0, max_output_tokens=16, extra_body={"structured_outputs": {"regex": r"Yes\."}}
    )
    assert (done.status, done.incomplete_details, done.output_text, done.output[0].status) == ("completed", None, "Yes.", "completed")


def test_text_format_json_schema_and_json_object_guide_the_output_as_chat_s_response_format(client):
    answer = {"type": "string", "enum": ["yes", "no"]}
    schema = {"type": "object", "properties": {"answer": answer}, "required": ["answer"], "additionalProperties": False}
    question = "Is the sky blue? Answer in JSON."
    compact = {"structured_outputs": {"disable_any_whitespace": True}}
    fmt = {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
    reply = client.responses.create(model=MODEL, input=question, temperature=0, max_output_tokens=64, text={"format": fmt}, extra_body=compact)
    assert reply.output_text in ('{"answer":"yes"}', '{"answer":"no"}'), reply.output_text
    assert reply.text.format.type == "json_schema" and reply.status == "completed"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=64, extra_body=compact,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )  # fmt: skip
    assert reply.output_text == chat.choices[0].message.content
    seeded = client.responses.create(
        model=MODEL, input=question, max_output_tokens=64, text={"format": {"type": "json_object"}}, extra_body={"seed": 3}
    )
    if seeded.status == "completed":
        assert isinstance(json.loads(seeded.output_text), dict)
    else:  # cut by the length limit before it closed, as in vLLM
        assert seeded.output_text.lstrip().startswith("{"), seeded.output_text


def test_a_thought_is_a_reasoning_item_and_its_tokens_are_reasoning_tokens_unary_and_streaming(client, tokenizer):
    thought = {"structured_outputs": {"regex": r"<think>(Paris|Oslo) is a city\.</think>In France\."}}
    args = dict(model=MODEL, input="Where is Paris?", temperature=0, max_output_tokens=64, extra_body=thought)
    reply = client.responses.create(**args)
    reasoning, message = reply.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.content[0].text in ("Paris is a city.", "Oslo is a city.")
    assert message.type == "message" and reply.output_text == "In France."
    messages = [{"role": "user", "content": "Where is Paris?"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=64, extra_body={**thought, "return_token_ids": True}
    )
    ids = chat.choices[0].model_extra["token_ids"]
    assert chat.choices[0].message.reasoning == reasoning.content[0].text
    closing = next(n for n in range(1, len(ids) + 1) if "</think>" in tokenizer.decode(ids[:n]))
    assert reply.usage.output_tokens_details.reasoning_tokens == closing < reply.usage.output_tokens == len(ids)
    events = list(client.responses.create(**args, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "In France."
    completed = events[-1].response
    assert [item.type for item in completed.output] == ["reasoning", "message"]
    assert completed.usage.model_dump(exclude={"input_tokens_details"}) == reply.usage.model_dump(exclude={"input_tokens_details"})
    # The output sent back in the next turn's input (a stateless conversation): the thought rides with the assistant's
    # message, as chat's reasoning_content, which the template renders.
    follow_up = [{"role": "user", "content": "Where is Paris?"}, *[item.model_dump() for item in reply.output], {"role": "user", "content": "And?"}]
    again = client.responses.create(model=MODEL, input=follow_up, temperature=0, max_output_tokens=1)
    earlier = {"role": "assistant", "content": "In France.", "reasoning_content": reasoning.content[0].text}
    chat = client.chat.completions.create(model=MODEL, messages=[*messages, earlier, {"role": "user", "content": "And?"}], max_tokens=1)
    prompt = tokenizer.apply_chat_template([*messages, earlier, {"role": "user", "content": "And?"}], tokenize=False, add_generation_prompt=True)
    assert "<think>" + reasoning.content[0].text + "</think>In France." in prompt
    assert again.usage.input_tokens == chat.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


def test_function_tools_give_function_call_items_and_a_call_s_output_goes_back_in_input(client):
    question = "What is the weather in Paris?"
    args = dict(model=MODEL, input=question, temperature=0, max_output_tokens=128, tools=FUNCTIONS)
    reply = client.responses.create(**args, tool_choice={"type": "function", "name": "get_weather"})
    (call,) = reply.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed") and call.id.startswith("fc_") and call.call_id
    named = {"type": "function", "function": {"name": "get_weather"}}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=128, tools=[WEATHER, TIME], tool_choice=named
    )
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    arguments = json.loads(call.arguments)
    assert arguments["city"] in ("Paris", "Oslo") and arguments["unit"] in ("C", "F"), arguments
    events = list(client.responses.create(**args, tool_choice={"type": "function", "name": "get_weather"}, stream=True))
    called = [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e.type for e in events[2:-1]] == called and events[-2].item.arguments == call.arguments
    # The call and its output go back in input, as a chat's tool_calls and tool message: the same prompt.
    turn = [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments}]
    turn.append({"type": "function_call_output", "call_id": call.call_id, "output": "18 C"})
    followed = client.responses.create(**greedy(input=[{"role": "user", "content": question}, *turn], tools=FUNCTIONS[:1], tool_choice="none"))
    function = {"name": call.name, "arguments": call.arguments}
    assistant = {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": function}]}
    result = {"role": "tool", "tool_call_id": call.call_id, "content": "18 C"}
    chat = chat_greedy(client, [{"role": "user", "content": question}, assistant, result], tools=[WEATHER], tool_choice="none")
    assert (followed.output_text, followed.usage.input_tokens) == (chat.choices[0].message.content, chat.usage.prompt_tokens)
    # "auto": the calls the model writes (hermes' tags, the template's) read from its text, after its text's message.
    hermes = r'Checking\.<tool_call>\{"name":"get_weather","arguments":\{"city":"(Paris|Oslo)","unit":"(C|F)"\}\}</tool_call>'
    auto = client.responses.create(**args, extra_body={"structured_outputs": {"regex": hermes}})
    assert [item.type for item in auto.output] == ["message", "function_call"] and auto.output_text == "Checking."
    assert auto.output[1].name == "get_weather"
    # The call's output after the stored response that made it (previous_response_id): the same prompt again.
    after = client.responses.create(**greedy(input=turn[1:], tools=FUNCTIONS[:1], tool_choice="none", previous_response_id=reply.id))
    assert (after.output_text, after.usage.input_tokens) == (followed.output_text, followed.usage.input_tokens)


def test_an_unfinished_assistant_message_last_is_continued_as_chat_s_continue_final_message(client):
    """vLLM's: the last input item, an assistant's message whose status is incomplete, is the model's to go on with."""
    question = {"role": "user", "content": PROMPTS[0]}
    opened = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "    return"}], "status": "incomplete"}
    reply = client.responses.create(**greedy(input=[question, opened]))
    options = {**DRAFTING, "add_generation_prompt": False, "continue_final_message": True}
    messages = [question, {"role": "assistant", "content": "    return"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=MAX_TOKENS, extra_body=options)
    assert (reply.output_text, reply.usage.input_tokens) == (chat.choices[0].message.content, chat.usage.prompt_tokens)
    # Finished (completed, or no status), it is an earlier turn: the assistant's next one opens after it.
    done = client.responses.create(**greedy(input=[question, {**opened, "status": "completed"}]))
    assert done.usage.input_tokens > reply.usage.input_tokens


def test_truncation_auto_keeps_the_prompt_s_last_tokens_that_fit_beside_the_output(client, tokenizer):
    long = "the quick brown fox jumps over the lazy dog " * 150
    assert len(tokenizer.encode(long, add_special_tokens=False)) > 1024  # the random target's context
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, input=long, max_output_tokens=4)
    assert err.value.body["param"] == "input" and err.value.body["message"].startswith("input: "), err.value.body
    reply = client.responses.create(model=MODEL, input=long, max_output_tokens=4, truncation="auto", extra_body={"ignore_eos": True})
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.truncation) == (1024 - 4, 4, "auto")


REFUSED = [
    ({"background": True, "stream": True}, "background"),
    ({"background": True, "store": False}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": FUNCTIONS, "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": FUNCTIONS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "x"}]}, "input"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "content": [{"type": "output_text", "text": "Hm."}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]}, "input"),
    ({"input": [{"role": "tool", "content": "18 C"}]}, "input"),
    ({"extra_body": {"max_tokens": 5}}, "max_tokens"),
    ({"extra_body": {"n": 2}}, "n"),
    ({"extra_body": {"logprobs": True}}, "logprobs"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"extra_body": {"seed": "x"}}, "seed"),
    # Refused as chat refuses them, named as this API names them.
    ({"extra_body": {"min_p": 1.5}}, "min_p"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 1024}, "max_output_tokens"),  # the random target's context is 1024 tokens
]


@pytest.mark.parametrize("fields, param", REFUSED, ids=[f"{p}-{i}" for i, (_, p) in enumerate(REFUSED)])
def test_fields_not_served_are_refused_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**{"model": MODEL, "input": "hi", "max_output_tokens": 4, **fields})
    body = err.value.body
    assert (err.value.status_code, body["param"], body["type"]) == (400, param, "invalid_request_error"), body
    assert body["message"].startswith(param) or param in body["message"], body


def _post(conn: http.client.HTTPConnection, body: dict) -> tuple[int, dict]:
    conn.request("POST", "/v1/responses", json.dumps(body), {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    reply = conn.getresponse()
    return reply.status, json.loads(reply.read())


def test_a_bad_body_text_that_is_not_text_and_an_unknown_model_are_refused_and_counted(api, client):
    """Each counts in specfleet:request_failure_total under its gRPC status, as chat's refusals do."""
    port = api.config["router"]["metrics_port"]
    name = 'specfleet:request_failure_total{{code="{}"}}'.format
    before = metrics(port)
    conn = http.client.HTTPConnection("127.0.0.1", api.config["router"]["http_port"], timeout=60)
    status, reply = _post(conn, {"model": MODEL, "input": 5})
    assert (status, reply["error"]["param"]) == (400, "input"), reply
    status, reply = _post(conn, {"model": MODEL, "input": "\ud800"})
    assert (status, reply["error"]["param"]) == (400, "input") and "lone UTF-16 surrogate" in reply["error"]["message"], reply
    conn.close()
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="gpt-4o", input="hi")
    assert err.value.body["param"] == "model"
    after = metrics(port)
    moved = {code: after.get(name(code), 0.0) - before.get(name(code), 0.0) for code in ("INVALID_ARGUMENT", "NOT_FOUND")}
    assert moved == {"INVALID_ARGUMENT": 2, "NOT_FOUND": 1}, moved


def test_a_client_that_leaves_a_stream_cancels_its_request(api, client):
    router, verifier = api.config["router"]["metrics_port"], api.config["verifier"]["metrics_port"]
    cancelled = metrics(router)["specfleet:request_cancelled_total"]
    tokens = metrics(router)["specfleet:generation_tokens_total"]
    # Long enough (ignore_eos, no drafting) that it is still generating when the client leaves.
    extra = {"ignore_eos": True, "speculation": {"disabled": True}}
    stream = client.responses.create(model=MODEL, input=PROMPTS[1], temperature=0, max_output_tokens=900, stream=True, extra_body=extra)
    events = iter(stream)
    assert next(e for e in events if e.type == "response.output_text.delta").delta
    assert metrics(verifier)["specfleet:sessions"] == 1
    # vLLM's /load: the one request the router holds, for a load balancer to spread new ones by.
    assert json.loads(urllib.request.urlopen(api.base_url + "/load", timeout=10).read()) == {"server_load": 1}
    stream.close()
    deadline = time.monotonic() + 60
    while (metrics(router)["specfleet:num_requests_running"] or metrics(verifier)["specfleet:sessions"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metrics(router)["specfleet:num_requests_running"] == 0 and metrics(verifier)["specfleet:sessions"] == 0
    assert metrics(router)["specfleet:request_cancelled_total"] == cancelled + 1
    assert metrics(router)["specfleet:generation_tokens_total"] - tokens < 900


def test_a_response_continues_a_stored_one_as_if_its_conversation_were_sent_whole(api, client):
    """previous_response_id: the stored response's input and output items come before this request's input (its
    instructions do not, as OpenAI has it); the same output and prompt as the whole conversation sent in input, and as
    chat's messages. Each response is kept (GET returns it) and continues from a stream's too."""
    first = client.responses.create(**greedy(input=PROMPTS[0], instructions="Be brief."))
    assert (first.store, first.previous_response_id) == (True, None)
    second = client.responses.create(**greedy(input=PROMPTS[1], previous_response_id=first.id))
    assert second.previous_response_id == first.id
    sent = [{"role": "user", "content": PROMPTS[0]}, *[item.model_dump() for item in first.output], {"role": "user", "content": PROMPTS[1]}]
    whole = client.responses.create(**greedy(input=sent))
    assert (second.output_text, second.usage.input_tokens) == (whole.output_text, whole.usage.input_tokens)
    messages = [{"role": "user", "content": PROMPTS[0]}, {"role": "assistant", "content": first.output_text}, {"role": "user", "content": PROMPTS[1]}]
    chat = chat_greedy(client, messages)
    assert (second.output_text, second.usage.input_tokens) == (chat.choices[0].message.content, chat.usage.prompt_tokens)
    # Three turns: the second's conversation (the first's included) comes before the third's input.
    third = client.responses.create(**greedy(input=PROMPTS[2], previous_response_id=second.id))
    more = chat_greedy(client, [*messages, {"role": "assistant", "content": second.output_text}, {"role": "user", "content": PROMPTS[2]}])
    assert (third.output_text, third.usage.input_tokens) == (more.choices[0].message.content, more.usage.prompt_tokens)
    # Its prompt starts with the second's, whose full blocks (16 tokens) the verifier's prefix cache kept.
    assert third.usage.input_tokens_details.cached_tokens >= (second.usage.input_tokens - 1) // 16 * 16 > 0
    stored = client.responses.retrieve(second.id)
    assert (stored.id, stored.output_text, stored.usage.input_tokens, stored.previous_response_id) == (
        second.id,
        second.output_text,
        second.usage.input_tokens,
        first.id,
    )
    # Its input items: the whole conversation it answered, newest first, each with an id.
    listed = client.responses.input_items.list(third.id)
    roles = [(item.type, item.role) for item in listed.data]
    assert roles == [("message", "user"), ("message", "assistant"), ("message", "user"), ("message", "assistant"), ("message", "user")], roles
    assert listed.data[0].content[0].text == PROMPTS[2] and listed.data[-1].content[0].text == PROMPTS[0]
    assert listed.data[1].id == second.output[0].id and len({item.id for item in listed.data}) == 5
    # A bad query parameter is a 400 naming it, as a bad body field is.
    for query, message in (("limit=abc", "limit: Input should be a valid integer"), ("limit=500", "limit: from 1 to 100")):
        url = f"{api.base_url}/v1/responses/{third.id}/input_items?{query}"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {API_KEY}"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        body = json.loads(err.value.read())["error"]
        assert (err.value.code, body["param"]) == (400, "limit") and body["message"].startswith(message), body
    # A streamed response is kept once complete, and continued as a unary one is.
    events = list(client.responses.create(**greedy(input=PROMPTS[0], instructions="Be brief."), stream=True))
    streamed = events[-1].response
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text == first.output_text
    again = client.responses.create(**greedy(input=PROMPTS[1], previous_response_id=streamed.id))
    assert again.output_text == second.output_text


def test_a_response_not_stored_or_deleted_is_not_found_naming_why(api, client):
    """store: false keeps nothing; DELETE forgets a kept one: GET and previous_response_id then answer 404, whose message
    says what to do, counted as refused requests are (NOT_FOUND)."""
    port = api.config["router"]["metrics_port"]
    refused = 'specfleet:request_failure_total{code="NOT_FOUND"}'
    before = metrics(port).get(refused, 0.0)
    unkept = client.responses.create(**greedy(input=PROMPTS[0], store=False))
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(unkept.id)
    assert "store: false" in err.value.body["message"] and "send the conversation in input" in err.value.body["message"], err.value.body
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(**greedy(input=PROMPTS[1], previous_response_id=unkept.id))
    body = err.value.body
    assert (body["param"], body["code"]) == ("previous_response_id", "previous_response_not_found") and unkept.id in body["message"], body
    kept = client.responses.create(**greedy(input=PROMPTS[0]))
    assert client.responses.retrieve(kept.id).id == kept.id
    client.responses.delete(kept.id)
    for call in (lambda: client.responses.retrieve(kept.id), lambda: client.responses.delete(kept.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.NotFoundError):
        client.responses.create(**greedy(input=PROMPTS[1], previous_response_id=kept.id))
    assert metrics(port).get(refused, 0.0) - before == 2, "each previous_response_id not found, and nothing else"


def _until_ended(client, response_id: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while (response := client.responses.retrieve(response_id)).status == "in_progress":
        assert time.monotonic() < deadline, response
        time.sleep(0.05)
    return response


def test_a_background_response_is_answered_as_it_starts_and_read_back_finished(client):
    """background: true answers at once (in_progress, stored); GET reads it meanwhile and, once generated, the same
    output as the unary response; cancelling one that ended returns it as it ended."""
    unary = client.responses.create(**greedy(input=PROMPTS[1]))
    started = client.responses.create(**greedy(input=PROMPTS[1], background=True))
    assert (started.status, started.background, started.output) == ("in_progress", True, [])
    ended = _until_ended(client, started.id)
    assert (ended.status, ended.output_text, ended.background) == (unary.status, unary.output_text, True)
    assert ended.usage.output_tokens == unary.usage.output_tokens
    assert client.responses.cancel(started.id).status == ended.status
    # It continues a conversation as any stored response does.
    after = client.responses.create(**greedy(input=PROMPTS[2], previous_response_id=started.id))
    assert after.output_text == client.responses.create(**greedy(input=PROMPTS[2], previous_response_id=unary.id)).output_text
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.cancel(unary.id)
    assert "background" in err.value.body["message"]


def test_a_cancelled_background_response_stops_and_keeps_its_output_so_far(api, client):
    """Its client leaving changes nothing; POST /v1/responses/{id}/cancel stops it (the request cancelled at the
    router, no session left at the verifier) and stores it as cancelled with the output it had."""
    router, verifier = api.config["router"]["metrics_port"], api.config["verifier"]["metrics_port"]
    cancelled = metrics(router)["specfleet:request_cancelled_total"]
    tokens = metrics(router)["specfleet:generation_tokens_total"]
    extra = {"ignore_eos": True, "speculation": {"disabled": True}}
    started = client.responses.create(model=MODEL, input=PROMPTS[1], temperature=0, max_output_tokens=900, background=True, extra_body=extra)
    deadline = time.monotonic() + 60
    while metrics(router)["specfleet:generation_tokens_total"] == tokens:  # until its first tokens
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Still generating: it cannot be continued yet, and the refusal says when it can.
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**greedy(input=PROMPTS[2], previous_response_id=started.id))
    assert err.value.body["param"] == "previous_response_id" and "still in progress" in err.value.body["message"]
    stopped = client.responses.cancel(started.id)
    assert stopped.status == "cancelled" and 0 < stopped.usage.output_tokens < 900, stopped
    assert client.responses.retrieve(started.id).status == "cancelled"
    deadline = time.monotonic() + 60
    while (metrics(router)["specfleet:num_requests_running"] or metrics(verifier)["specfleet:sessions"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metrics(router)["specfleet:num_requests_running"] == 0 and metrics(verifier)["specfleet:sessions"] == 0
    assert metrics(router)["specfleet:request_cancelled_total"] == cancelled + 1
