"""The OpenAI-compatible HTTP API, driven by the official `openai` client against a running `specfleet serve`."""

from __future__ import annotations

import json
import os
import http.client
import pathlib
import re
import shlex
import shutil
import socket
import subprocess
import time
import urllib.request

import urllib.error
import openai
import pytest
import torch

from router.openai_api import ApiError, render_chat
from specfleet.guides import Guide
from specfleet.tokenizer import load_tokenizer
from specfleet.v1 import common_pb2, generation_pb2_grpc
from tests.harness import Cluster, cluster_config, free_port
from tests.helpers import greedy_request, target_greedy, target_logprobs
from tests.operations import host_pid, metrics, service_pid, without_model_name

API_KEY = "test-key-123"
# Tools are rendered, and calls asked for, as the hermes format writes them, and a thought opened where the template's
# `thinking` is set (chat_template_kwargs): router.tool_call_parser and reasoning_parser "auto" read both. An assistant
# message's earlier thought is rendered as Qwen 3's template renders it.
TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools> Call one as <tool_call>{...}</tool_call>\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% if thinking %}<think>{% endif %}{% endif %}"
)
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "name: specfleet\nversion:"]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def target_with_template(random_family, tmp_path_factory):
    """The random target with a chat template in its tokenizer (the template is not in the tokenizer's fingerprint)."""
    path = tmp_path_factory.mktemp("templated") / "target"
    shutil.copytree(random_family["target"], path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = TEMPLATE
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def api(random_family, target_with_template, tmp_path_factory):
    # The drafter service a process of its own: its environment is checked for the API key (test_only_the_router_...).
    config = cluster_config(
        random_family,
        # The cost model under which drafting pays (cluster_config's): requests draft in every round, so that tests see
        # drafted tokens accepted (test_completions_logprobs_...), whatever the machine measures. A token a plain
        # round: a request of 900 plain tokens on the small random model then outlasts the hang-up's detection
        # (test_a_unary_client_that_hangs_up_...), which with 4 steps a round it may not; the gRPC tests cover plain
        # steps.
        router={
            "http_port": free_port(),
            "metrics_port": free_port(),
            "served_model_name": "random-target",
            "plain_steps": 1,
        },
        drafter_service={"colocate": False},
    )
    config["verifier"]["model"] = str(target_with_template)
    config["verifier"]["metrics_port"] = free_port()
    config["drafters"][0]["metrics_port"] = free_port()
    # `specfleet serve` reads it (as `--api-key`); the gRPC API needs it too (cluster.channel() sends it).
    cluster = Cluster(config, tmp_path_factory.mktemp("openai"), "openai", env={"SPECFLEET_API_KEY": API_KEY}).start()
    cluster.base_url = f"http://127.0.0.1:{config['router']['http_port']}"
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def client(api):
    with openai.OpenAI(base_url=api.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer(target_with_template):
    return load_tokenizer(str(target_with_template))


def greedy(**extra):
    """Greedy with drafting on: the output must still be the target's own."""
    return {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"speculation": {"max_draft_tokens": 4}, **extra}}


def test_completions_greedy_equal_grpc_and_target_alone(api, client, tokenizer, target_with_template):
    with api.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for prompt in PROMPTS:
            expected_ids = target_greedy(str(target_with_template), prompt, MAX_TOKENS)
            expected = tokenizer.decode(expected_ids, skip_special_tokens=True)
            grpc_reply = stub.Generate(greedy_request(prompt, MAX_TOKENS, 4), timeout=120)
            reply = client.completions.create(model="random-target", prompt=prompt, **greedy())
            assert reply.choices[0].text == grpc_reply.text == expected, prompt
            assert reply.usage.completion_tokens == len(expected_ids)
            assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
            assert reply.choices[0].finish_reason == ("stop" if tokenizer.eos_token_id in expected_ids else "length")
            assert reply.model_extra["speculation"][0]["rounds"] >= 1


def test_completions_take_token_ids_and_several_prompts(client, tokenizer, target_with_template):
    expected = [tokenizer.decode(target_greedy(str(target_with_template), p, MAX_TOKENS), skip_special_tokens=True) for p in PROMPTS[:2]]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS[:2]]
    for prompt in (PROMPTS[:2], ids, ids[0]):
        reply = client.completions.create(model="random-target", prompt=prompt, **greedy())
        texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
        assert texts == (expected[:1] if prompt is ids[0] else expected)


def test_completions_stream_with_usage(client, tokenizer, target_with_template):
    prompt = PROMPTS[0]
    expected_ids = target_greedy(str(target_with_template), prompt, MAX_TOKENS)
    # As `vllm bench serve` asks: with vLLM's neutral repetition_penalty.
    chunks = list(
        client.completions.create(
            model="random-target", prompt=prompt, stream=True, stream_options={"include_usage": True}, **greedy(repetition_penalty=1.0)
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == tokenizer.decode(expected_ids, skip_special_tokens=True)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1 and chunks[-2].choices[0].finish_reason == finishes[0]
    # The usage chunk comes last, with no choices.
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected_ids)


def test_continuous_usage_stats_give_each_chunk_its_choice_s_usage_so_far(client, tokenizer, target_with_template):
    """vLLM's stream_options.continuous_usage_stats: every chunk with a choice carries that choice's prompt tokens and
    the tokens it has streamed so far, the last of them its whole output; the usage chunk still comes last."""
    prompt_tokens = len(tokenizer.encode(PROMPTS[0], add_special_tokens=False))
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model="random-target", prompt=PROMPTS[0], stream=True, stream_options=options, n=2, **greedy()))
    total = chunks[-1].usage.completion_tokens
    assert chunks[-1].choices == []
    by_choice = {0: [], 1: []}
    for chunk in chunks[:-1]:
        assert chunk.usage.prompt_tokens == prompt_tokens
        by_choice[chunk.choices[0].index].append(chunk.usage.completion_tokens)
    expected = len(target_greedy(str(target_with_template), PROMPTS[0], MAX_TOKENS))
    assert all(counts == sorted(counts) and counts[-1] == expected for counts in by_choice.values())
    assert total == 2 * expected and chunks[-1].usage.prompt_tokens == prompt_tokens, "the prompt counted once, its two choices' output each"
    # Without it, the chunks carry no usage.
    plain = list(client.completions.create(model="random-target", prompt=PROMPTS[0], stream=True, stream_options={"include_usage": True}, **greedy()))
    assert all(c.usage is None for c in plain[:-1])


def test_response_format_text_is_plain_output(client):
    """OpenAI's default format, sent explicitly, changes nothing (other formats are refused: REFUSED above)."""
    messages = [{"role": "user", "content": PROMPTS[1]}]
    plain = client.chat.completions.create(model="random-target", messages=messages, **greedy())
    text = client.chat.completions.create(model="random-target", messages=messages, response_format={"type": "text"}, **greedy())
    assert text.choices[0].message.content == plain.choices[0].message.content


def test_the_stop_string_and_special_tokens_text_are_kept_where_asked(client, tokenizer, target_with_template):
    expected = tokenizer.decode(target_greedy(str(target_with_template), PROMPTS[0], MAX_TOKENS), skip_special_tokens=True)
    stop = expected[3:6]
    for include in (False, True):
        reply = client.completions.create(model="random-target", prompt=PROMPTS[0], stop=[stop], **greedy(include_stop_str_in_output=include))
        assert reply.choices[0].text == expected[: expected.index(stop) + (len(stop) if include else 0)], include
    # End of sequence forced by its bias, and not an end (ignore_eos): its text is the output's only where asked.
    eos = tokenizer.eos_token_id
    args = dict(model="random-target", prompt=PROMPTS[0], max_tokens=3, temperature=0, logit_bias={str(eos): 100})
    for skip in (True, False):
        reply = client.completions.create(**args, extra_body={"ignore_eos": True, "skip_special_tokens": skip})
        assert reply.choices[0].text == tokenizer.decode([eos] * 3, skip_special_tokens=skip) and (skip or reply.choices[0].text), skip


def test_chat_renders_the_template_unary_and_streaming(client, tokenizer, target_with_template):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def fibonacci(n):"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<system>Be brief.\n")
    expected = tokenizer.decode(target_greedy(str(target_with_template), prompt, MAX_TOKENS), skip_special_tokens=True)
    args = greedy()
    args["max_completion_tokens"] = args.pop("max_tokens")
    reply = client.chat.completions.create(model="random-target", messages=messages, **args)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    chunks = list(client.chat.completions.create(model="random-target", messages=messages, stream=True, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_n_choices_greedy_are_the_target_s_and_seeded_ones_differ_and_repeat(client, tokenizer, target_with_template):
    ids = [target_greedy(str(target_with_template), p, MAX_TOKENS) for p in PROMPTS[:2]]
    expected = [tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    reply = client.completions.create(model="random-target", prompt=PROMPTS[:2], n=3, **greedy())
    # Choice i * n + c is prompt i's c-th.
    assert [c.index for c in reply.choices] == list(range(6))
    assert [c.text for c in reply.choices] == [expected[0]] * 3 + [expected[1]] * 3
    assert reply.usage.completion_tokens == 3 * (len(ids[0]) + len(ids[1]))
    # Each prompt counted once, however many choices it has (OpenAI's and vLLM's usage).
    assert reply.usage.prompt_tokens == sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS[:2])
    assert len(reply.model_extra["speculation"]) == 6
    # Sampled with a seed: each choice its own sample, and the seed fixes all of them.
    sampled = {"model": "random-target", "messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": 11, "temperature": 1.0, "max_tokens": 16}
    chat = client.chat.completions.create(**sampled)
    first = [c.message.content for c in chat.choices]
    assert chat.usage.prompt_tokens == client.chat.completions.create(**{**sampled, "n": 1}).usage.prompt_tokens
    again = [c.message.content for c in client.chat.completions.create(**sampled, stream=False).choices]
    streamed = ["", "", ""]
    for chunk in client.chat.completions.create(**sampled, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert first == again == streamed
    assert len(set(first)) == 3


def test_a_model_without_a_chat_template_is_refused_with_the_reason(random_family):
    plain = load_tokenizer(str(random_family["target"]))
    with pytest.raises(ApiError) as err:
        render_chat(plain, [{"role": "user", "content": "hi"}])
    assert err.value.status == 400 and err.value.param == "messages" and "no chat template" in err.value.message


def test_messages_the_chat_template_refuses_get_its_reason(random_family):
    strict = load_tokenizer(str(random_family["target"]))
    strict.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(ApiError) as err:
        render_chat(strict, [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}])
    assert err.value.status == 400 and "roles must alternate" in err.value.message


REFUSED = [
    ("completions", {"n": 0}, "n"),
    ("chat", {"extra_body": {"min_p": 1.5}}, "min_p"),
    ("chat", {"n": 17}, "n"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"extra_body": {"top_logprobs": 2}}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    # OpenAI's rule: alternatives only with logprobs.
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("completions", {"frequency_penalty": 2.5}, "frequency_penalty"),
    ("chat", {"presence_penalty": -3}, "presence_penalty"),
    ("completions", {"logit_bias": {"five": 10}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": "ten"}}, "logit_bias"),
    ("completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("chat", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("completions", {"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ("completions", {"extra_body": {"min_tokens": 5}}, "min_tokens"),  # beyond max_tokens (4)
    ("chat", {"extra_body": {"stop_token_ids": [999999]}}, "stop_token_ids"),
    ("chat", {"extra_body": {"allowed_token_ids": [999999]}}, "allowed_token_ids"),
    ("completions", {"extra_body": {"allowed_token_ids": []}}, "allowed_token_ids"),
    ("completions", {"extra_body": {"bad_words": ["  "]}}, "bad_words"),
    ("completions", {"extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
    ("chat", {"extra_body": {"priority": 1}}, "priority"),  # router.priority_scheduling is off
    ("completions", {"extra_body": {"cache_salt": ""}}, "cache_salt"),
    ("chat", {"extra_body": {"allowed_token_ids": [5], "structured_outputs": {"regex": "a"}}}, "allowed_token_ids"),
    ("chat", {"extra_body": {"echo": True}}, "echo"),
    ("completions", {"extra_body": {"prompt_logprobs": 21}}, "prompt_logprobs"),
    ("chat", {"stream": True, "extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ("completions", {"suffix": "end"}, "suffix"),
    ("completions", {"best_of": 2}, "best_of"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ("completions", {"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "guide"),
    ("completions", {"extra_body": {"structured_outputs": {"json": {"type": "nope"}}}}, "guide"),
    ("completions", {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}}, "structured_outputs"),
    ("completions", {"extra_body": {"structured_outputs": {"structural_tag": "{}"}}}, "structured_outputs.structural_tag"),
    ("chat", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("completions", {"seed": -1}, "seed"),
    ("completions", {"temperature": -1}, "temperature"),
    ("completions", {"top_p": 0}, "top_p"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_tokens": 5, "max_completion_tokens": 5}, "max_completion_tokens"),
    # The random target's context is 1024 tokens: the prompt leaves less room than this.
    ("completions", {"max_tokens": 1024}, "max_tokens"),
    ("completions", {"extra_body": {"speculation": {"max_draft_tokens": 1000}}}, "speculation"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
]


@pytest.mark.parametrize("endpoint,fields,param", REFUSED, ids=[f"{e}-{p}" for e, _, p in REFUSED])
def test_unsupported_and_invalid_fields_are_refused_by_name(client, endpoint, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        if endpoint == "chat":
            client.chat.completions.create(**{"model": "random-target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields})
        else:
            client.completions.create(**{"model": "random-target", "prompt": "hi", "max_tokens": 4, **fields})
    assert err.value.status_code == 400
    assert err.value.body["param"] == param
    assert err.value.body["type"] == "invalid_request_error"
    assert param in err.value.body["message"]


# Input that once failed inside the server (500, and uvicorn closed the connection): (endpoint, fields, param, in the message).
NOT_TEXT = "lone UTF-16 surrogate"
UNREPRESENTABLE = [
    ("completions", {"max_tokens": 2**40}, "max_tokens", "max_tokens"),
    ("completions", {"top_k": 2**40}, "top_k", "top_k"),
    ("completions", {"prompt": [5, 2**40]}, "prompt", "outside the vocabulary"),
    ("completions", {"speculation": {"max_draft_tokens": 2**40}}, "speculation", "max_draft_tokens"),
    ("completions", {"prompt": "a\ud800b"}, "prompt", f"prompt, character 1: a {NOT_TEXT}"),
    ("completions", {"prompt": ["ok", "\udfff"]}, "prompt", f"prompt[1], character 0: a {NOT_TEXT}"),
    ("completions", {"stop": ["\ud800"]}, "stop", NOT_TEXT),
    ("chat", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages", f"messages[0].content, character 3: a {NOT_TEXT}"),
    (
        "chat",
        {"messages": [{"role": "user", "content": "hi", "\ud800": 1}]},
        "messages",
        f"the name of messages[0].\\ud800, character 0: a {NOT_TEXT}",
    ),
]


def _post(conn: http.client.HTTPConnection, path: str, body: dict) -> tuple[int, dict]:
    # json.dumps writes a lone surrogate as the escape "\ud800", as a client in another language may send it.
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    reply = conn.getresponse()
    return reply.status, json.loads(reply.read())


@pytest.mark.parametrize("endpoint,fields,param,says", UNREPRESENTABLE, ids=[f"{e}-{p}-{i}" for i, (e, _, p, _) in enumerate(UNREPRESENTABLE)])
def test_numbers_and_strings_the_server_cannot_represent_are_a_400_on_a_connection_that_stays_open(api, endpoint, fields, param, says):
    conn = http.client.HTTPConnection("127.0.0.1", api.config["router"]["http_port"], timeout=60)
    base = {"model": "random-target", "max_tokens": 2}
    base.update({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "hi"})
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    status, body = _post(conn, path, {**base, **fields})
    assert status == 400, body
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["param"] == param
    assert says in body["error"]["message"]
    sock = conn.sock
    status, body = _post(conn, path, base)  # the same connection serves the next request
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    assert conn.sock is sock is not None
    conn.close()


def test_what_http_refuses_itself_counts_as_a_failure_by_status(api, client):
    """A body the schema refuses, a field specfleet does not implement and a model it does not serve never reach the
    front door; each counts in specfleet:request_failure_total under its gRPC status, as the front door's refusals do.
    An unknown route is not a request, and counts nowhere."""
    port = api.config["router"]["metrics_port"]
    name = 'specfleet:request_failure_total{{code="{}"}}'.format
    before = metrics(port)
    conn = http.client.HTTPConnection("127.0.0.1", api.config["router"]["http_port"], timeout=60)
    assert _post(conn, "/v1/completions", {"model": "random-target", "prompt": "hi", "max_tokens": "lots"})[0] == 400
    assert _post(conn, "/v1/chat/completions", {"model": "random-target", "messages": [], "best_of": 2})[0] == 400
    assert _post(conn, "/v1/completions", {"model": "gpt-4", "prompt": "hi", "max_tokens": 2})[0] == 404
    assert _post(conn, "/v1/nothing", {})[0] == 404
    conn.close()
    after = metrics(port)
    moved = {code: after.get(name(code), 0.0) - before.get(name(code), 0.0) for code in ("INVALID_ARGUMENT", "NOT_FOUND")}
    assert moved == {"INVALID_ARGUMENT": 2, "NOT_FOUND": 1}, moved


def test_the_router_s_metrics_are_served_beside_v1_as_vllm_serves_them(api):
    """GET /metrics on the HTTP port, without the API key (as vLLM's): the metrics port's samples, model_name and all."""
    beside = urllib.request.urlopen(api.base_url + "/metrics", timeout=30)
    text = beside.read().decode()
    own = urllib.request.urlopen(f"http://127.0.0.1:{api.config['router']['metrics_port']}/metrics", timeout=30).read().decode()
    names = lambda page: {line.split("{")[0].split(" ")[0] for line in page.splitlines() if line and not line.startswith("#")}  # noqa: E731
    assert beside.headers["Content-Type"].startswith("text/plain") and 'model_name="random-target"' in text
    assert names(text) == names(own) and "specfleet:num_requests_running" in names(text)


def test_tokenize_counts_a_prompt_as_generation_does_and_detokenize_gives_its_text(api, client, tokenizer):
    """vLLM's /tokenize: a prompt's ids as the completions endpoint sends them, chat messages through the template, each
    count the usage a request reports; /detokenize: ids' text; both refuse bad input naming the field, and need the key."""
    conn = http.client.HTTPConnection("127.0.0.1", api.config["router"]["http_port"], timeout=60)
    ids = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    expected = {"count": len(ids), "max_model_len": 1024, "tokens": ids}
    assert _post(conn, "/tokenize", {"model": "random-target", "prompt": PROMPTS[0]}) == (200, expected)
    assert client.completions.create(model="random-target", prompt=PROMPTS[0], max_tokens=1, temperature=0).usage.prompt_tokens == len(ids)
    messages = [{"role": "user", "content": PROMPTS[1]}]
    status, chat = _post(conn, "/tokenize", {"model": "random-target", "messages": messages})
    reply = client.chat.completions.create(model="random-target", messages=messages, max_tokens=1, temperature=0)
    assert status == 200 and chat["count"] == reply.usage.prompt_tokens == len(chat["tokens"])
    assert _post(conn, "/detokenize", {"model": "random-target", "tokens": ids}) == (200, {"prompt": tokenizer.decode(ids)})
    for path, body, param in [
        ("/tokenize", {"model": "random-target", "prompt": "hi", "messages": messages}, "prompt"),
        ("/tokenize", {"model": "random-target", "prompt": "a\ud800"}, "prompt"),
        ("/detokenize", {"model": "random-target", "tokens": [5, 10**6]}, "tokens"),
        ("/detokenize", {"model": "gpt-4", "tokens": [5]}, "model"),
    ]:
        status, error = _post(conn, path, body)
        assert status == (404 if param == "model" else 400) and error["error"]["param"] == param, (path, body, error)
    assert _post(conn, "/tokenize", {"model": "random-target", "prompt": "hi", "add_bos": True})[0] == 400
    # The last message left open for the model to go on with, counted alike.
    messages = [{"role": "user", "content": "The capital?"}, {"role": "assistant", "content": "The capital is"}]
    open_end = {"add_generation_prompt": False, "continue_final_message": True}
    status, chat = _post(conn, "/tokenize", {"model": "random-target", "messages": messages, **open_end})
    reply = client.chat.completions.create(model="random-target", messages=messages, max_tokens=1, temperature=0, extra_body=open_end)
    expected = tokenizer.encode("<user>The capital?\n<assistant>The capital is", add_special_tokens=False)
    assert status == 200 and chat["tokens"] == expected and reply.usage.prompt_tokens == len(expected)
    conn.close()
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(urllib.request.Request(api.base_url + "/tokenize", data=b"{}", method="POST"), timeout=10)
    assert err.value.code == 401


def test_unknown_routes_are_a_404_in_openai_s_shape(api):
    for method, path in (("GET", "/v1/nothing"), ("POST", "/completions")):
        request = urllib.request.Request(api.base_url + path, method=method, headers={"Authorization": f"Bearer {API_KEY}"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=10)
        assert err.value.code == 404
        error = json.loads(err.value.read())["error"]
        assert error["type"] == "not_found_error" and f"{method} {path}: no such route" in error["message"]
        assert "POST /v1/completions" in error["message"]


def test_max_tokens_beyond_the_context_is_refused_with_the_room_left(client, tokenizer):
    room = 1024 - len(tokenizer.encode("hi", add_special_tokens=False))
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="random-target", prompt="hi", max_tokens=room + 1)
    assert f"context of 1024 tokens; ask for at most {room}" in err.value.body["message"]


def test_the_ready_message_prints_commands_that_work(api):
    """The lines after `specfleet is ready`: a generate command to paste, and the API's address."""
    try_line = api.proc.stdout.readline()
    assert "try: " in try_line
    command = shlex.split(try_line.split("try: ", 1)[1]) + ["--max-tokens", "4"]
    # `specfleet generate` sends $SPECFLEET_API_KEY, as a user who set it for the router has it.
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd="/", env={**os.environ, "SPECFLEET_API_KEY": API_KEY})
    assert result.returncode == 0, result.stderr
    api_line = api.proc.stdout.readline()
    assert f"OpenAI-compatible API: {api.base_url}/v1" in api_line


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_server_reflection_answers_as_v1_and_v1alpha(api, version):
    from grpc_reflection.v1alpha import reflection_pb2

    with api.channel() as channel:
        call = channel.stream_stream(
            f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        requests = [
            reflection_pb2.ServerReflectionRequest(list_services=""),
            reflection_pb2.ServerReflectionRequest(file_containing_symbol="specfleet.v1.Generation"),
        ]
        listed, described = list(call(iter(requests), timeout=30))
    names = {s.name for s in listed.list_services_response.service}
    assert {"specfleet.v1.Generation", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= names
    assert described.file_descriptor_response.file_descriptor_proto


def test_a_wrong_or_missing_key_is_refused(api, client):
    with openai.OpenAI(base_url=api.base_url + "/v1", api_key="not-the-key", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="random-target", prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    with pytest.raises(urllib.error.HTTPError) as err:  # no Authorization header at all
        urllib.request.urlopen(api.base_url + "/v1/models", timeout=10)
    assert err.value.code == 401
    # Health (and /ping, its other name), load and version are for load balancers and need no key.
    assert urllib.request.urlopen(api.base_url + "/health", timeout=10).status == 200
    for method in ("GET", "POST"):
        ping = urllib.request.urlopen(urllib.request.Request(api.base_url + "/ping", method=method), timeout=10)
        assert (ping.status, json.loads(ping.read())) == (200, {"status": "ok"}), method
    assert json.loads(urllib.request.urlopen(api.base_url + "/version", timeout=10).read())["version"]
    # Nothing else runs in this module's cluster meanwhile: no request is held (once an earlier test's last one ended).
    deadline = time.monotonic() + 30
    while (load := json.loads(urllib.request.urlopen(api.base_url + "/load", timeout=10).read())) != {"server_load": 0}:
        assert time.monotonic() < deadline, load
        time.sleep(0.2)


def test_models_lists_the_served_name_and_unknown_models_are_404(client):
    assert [m.id for m in client.models.list()] == ["random-target"]
    # Its root is the name too, as vLLM's: not the target's path on the server's disk.
    assert [m.model_extra["root"] for m in client.models.list()] == ["random-target"]
    assert client.models.retrieve("random-target").model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4")
    assert (err.value.body["param"], err.value.body["code"]) == ("model", "model_not_found") and "random-target" in err.value.body["message"]
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert err.value.body["param"] == "model"


def test_x_request_id_names_the_request_and_comes_back_on_every_answer(api, client):
    """vLLM's X-Request-Id: a client's id names its request in the router's log (with its choice's index) and comes
    back as a header; an answer to a request without one, or with an unusable one, carries a new id; a refusal too."""
    raw = client.completions.with_raw_response.create(
        model="random-target", prompt=PROMPTS[0], max_tokens=2, extra_headers={"X-Request-Id": "trace-7f3a"}
    )
    assert raw.headers["x-request-id"] == "trace-7f3a" and raw.parse().choices[0].text is not None
    deadline = time.monotonic() + 10
    while "request trace-7f3a-0 finished" not in api.log_path.read_text():
        assert time.monotonic() < deadline, "the router's log never named the request by its X-Request-Id"
        time.sleep(0.1)
    for sent in ({}, {"X-Request-Id": "x" * 65}, {"X-Request-Id": "tab\there"}):
        made = client.models.with_raw_response.list(extra_headers=sent).headers["x-request-id"]
        assert re.fullmatch(r"[0-9a-f]{32}", made), (sent, made)
    with pytest.raises(openai.AuthenticationError) as err:
        with openai.OpenAI(base_url=api.base_url + "/v1", api_key="wrong", max_retries=0) as wrong:
            wrong.models.list(extra_headers={"X-Request-Id": "trace-refused"})
    assert err.value.response.headers["x-request-id"] == "trace-refused"


def test_only_the_router_has_the_api_key_in_its_environment(api):
    """The verifier and drafters never check the key: `specfleet serve` keeps it out of their environment."""

    def environment(pid: int) -> dict[str, str]:
        raw = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
        return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry)

    router = service_pid(api, "router")
    assert environment(router)["SPECFLEET_API_KEY"] == API_KEY
    # A service in the router's process (verifier.colocate, drafters[].colocate) shares the router's environment.
    apart = [service for service in ("verifier", "drafter") if host_pid(api, service) != router]
    assert "drafter" in apart
    for service in apart:
        env = environment(host_pid(api, service))  # compared as flags: a failing `in env` would print every secret in it
        assert ("SPECFLEET_API_KEY" in env, "SPECFLEET_INTERNAL_TOKEN" in env) == (False, True), service


def _metric(url: str, name: str) -> float:
    text = without_model_name(urllib.request.urlopen(url, timeout=10).read().decode())
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    assert match, f"{name} not in {url}"
    return float(match.group(1))


def test_a_client_that_disconnects_mid_stream_leaves_no_session_behind(api, client):
    metrics = f"http://127.0.0.1:{api.config['router']['metrics_port']}/metrics"
    verifier_metrics = f"http://127.0.0.1:{api.config['verifier']['metrics_port']}/metrics"
    request_id = f"disconnect-{time.monotonic_ns()}"
    tokens_before = _metric(metrics, "specfleet:generation_tokens_total")
    cancelled_before = _metric(metrics, "specfleet:request_cancelled_total")
    # Long enough (ignore_eos, no drafting) that it is still generating when the client leaves.
    stream = client.completions.create(
        model="random-target",
        prompt="The quick brown fox",
        max_tokens=900,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "request_id": request_id, "speculation": {"disabled": True}},
    )
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    assert _metric(verifier_metrics, "specfleet:sessions") == 1  # this request's, while it runs
    stream.close()
    deadline = time.monotonic() + 60
    while (
        _metric(metrics, "specfleet:num_requests_running") > 0 or _metric(verifier_metrics, "specfleet:sessions") > 0
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(metrics, "specfleet:num_requests_running") == 0
    assert _metric(verifier_metrics, "specfleet:sessions") == 0
    # Cancelled, not run to its end: without drafting each token is one verifier call, so
    # 900 of them take far longer than the client's leaving.
    assert _metric(metrics, "specfleet:request_cancelled_total") == cancelled_before + 1
    assert _metric(metrics, "specfleet:generation_tokens_total") - tokens_before < 900
    assert f"request {request_id}-0 cancelled" in api.log_path.read_text()


def test_a_unary_client_that_hangs_up_cancels_its_request(api):
    metrics = f"http://127.0.0.1:{api.config['router']['metrics_port']}/metrics"
    verifier_metrics = f"http://127.0.0.1:{api.config['verifier']['metrics_port']}/metrics"
    cancelled_before = _metric(metrics, "specfleet:request_cancelled_total")
    tokens_before = _metric(metrics, "specfleet:generation_tokens_total")
    body = {
        "model": "random-target",
        "prompt": "The quick brown fox",
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "speculation": {"disabled": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", api.config["router"]["http_port"], timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    deadline = time.monotonic() + 60
    while _metric(metrics, "specfleet:num_requests_running") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _metric(metrics, "specfleet:num_requests_running") == 1
    conn.close()  # hang up before the answer
    while (
        _metric(metrics, "specfleet:num_requests_running") > 0 or _metric(verifier_metrics, "specfleet:sessions") > 0
    ) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric(verifier_metrics, "specfleet:sessions") == 0
    assert _metric(metrics, "specfleet:request_cancelled_total") == cancelled_before + 1
    assert _metric(metrics, "specfleet:generation_tokens_total") - tokens_before < 900


# float32 on CPU: the verifier's cached, batched tree passes and one plain transformers pass
# agree to about 1e-5; a wrong row or a shaped (temperature, top-k) distribution is off by far more.
LOGPROB_TOLERANCE = 1e-3


def _ids(tokens: list[str]) -> list[int]:
    """Token ids from logprobs' token names under return_tokens_as_token_ids."""
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.split(":", 1)[1]) for t in tokens]


def _check_against_target(path, prompt_ids, ids, logprobs, tops: list[dict] | None = None, top: int = 0):
    """logprobs of ids equal the target's own; tops (token name -> logprob per position) its `top` most likely."""
    chosen, best_ids, best_values = target_logprobs(path, prompt_ids, ids, top)
    assert logprobs == pytest.approx(chosen, abs=LOGPROB_TOLERANCE)
    for position, alternatives in enumerate(tops or []):
        expected = {f"token_id:{t}": v for t, v in zip(best_ids[position], best_values[position])}
        expected[f"token_id:{ids[position]}"] = chosen[position]  # the chosen token is listed too
        assert set(alternatives) == set(expected), position
        assert [alternatives[k] for k in expected] == pytest.approx(list(expected.values()), abs=LOGPROB_TOLERANCE)


SAMPLED = {"temperature": 0.7, "top_p": 0.9, "seed": 5}


def test_stop_token_ids_end_the_output_and_min_tokens_holds_them_back(api, client, tokenizer, target_with_template):
    """Greedy with drafting on: the output ends after the first of stop_token_ids (kept, finish reason "stop"); with
    end of sequence raised by 100 the output is min_tokens other tokens and then it, over HTTP and gRPC; stop strings
    wait for min_tokens too."""
    prompt = PROMPTS[1]
    plain = target_greedy(str(target_with_template), prompt, MAX_TOKENS)
    stop = plain[5]
    args = greedy(return_tokens_as_token_ids=True, ignore_eos=True, stop_token_ids=[stop, 999 % len(tokenizer)])
    reply = client.completions.create(model="random-target", prompt=prompt, logprobs=0, **args)
    assert _ids(reply.choices[0].logprobs.tokens) == plain[: plain.index(stop) + 1]
    assert reply.choices[0].finish_reason == "stop"
    eos = tokenizer.eos_token_id
    held = greedy(return_tokens_as_token_ids=True, min_tokens=6)
    forced = client.completions.create(model="random-target", prompt=prompt, logprobs=0, logit_bias={str(eos): 100}, **held)
    ids = _ids(forced.choices[0].logprobs.tokens)
    assert len(ids) == 7 and eos not in ids[:6] and ids[6] == eos and forced.choices[0].finish_reason == "stop"
    with api.channel() as channel:
        request = greedy_request(prompt, MAX_TOKENS, 4, logit_bias={eos: 100.0}, min_tokens=6)
        assert list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120).token_ids) == ids
    # A stop string is looked for once the output holds min_tokens tokens (vLLM's order): its first token's text, which
    # ends the output at once without min_tokens, does not before.
    first = tokenizer.decode(plain[:1]).strip() or tokenizer.decode(plain[:1])
    early = client.completions.create(model="random-target", prompt=prompt, stop=[first], **greedy(ignore_eos=True))
    held = client.completions.create(model="random-target", prompt=prompt, stop=[first], **greedy(ignore_eos=True, min_tokens=6))
    assert early.usage.completion_tokens < 6 <= held.usage.completion_tokens


def test_penalties_give_transformers_output_under_the_same_penalties_over_http_and_grpc(api, client, tokenizer, target_with_template):
    """Greedy with drafting on, presence, frequency and repetition penalties: the output is transformers' `generate` with
    the same penalties (tests/verifier_service/test_penalties.py `reference`), unary, streaming and over gRPC; presence
    and frequency count the output's tokens, not the prompt's."""
    from tests.verifier_service.test_penalties import PENALTIES, reference

    prompt = PROMPTS[2]
    expected = reference(str(target_with_template), tokenizer.encode(prompt, add_special_tokens=False), MAX_TOKENS)
    args = greedy(return_tokens_as_token_ids=True, ignore_eos=True, repetition_penalty=PENALTIES["repetition_penalty"])
    penalties = dict(presence_penalty=PENALTIES["presence_penalty"], frequency_penalty=PENALTIES["frequency_penalty"])
    reply = client.completions.create(model="random-target", prompt=prompt, logprobs=0, **penalties, **args)
    assert _ids(reply.choices[0].logprobs.tokens) == expected
    streamed = [t for chunk in client.completions.create(model="random-target", prompt=prompt, logprobs=0, stream=True, **penalties, **args)
                if chunk.choices and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.tokens]  # fmt: skip
    assert streamed == reply.choices[0].logprobs.tokens
    with api.channel() as channel:
        request = greedy_request(prompt, MAX_TOKENS, 4, stop_at_eos=False, repetition_penalty=PENALTIES["repetition_penalty"], **penalties)
        assert list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120).token_ids) == expected
    # Presence counts the output alone: after a prompt that ends with the target's own continuation, which it would
    # go on repeating, the prompt's tokens are not penalized.
    looped = tokenizer.encode(prompt, add_special_tokens=False) + target_greedy(str(target_with_template), prompt, MAX_TOKENS)
    assert reference(str(target_with_template), looped, 1, None)[0] in looped, "the target goes on with a token of its prompt"
    expected = reference(str(target_with_template), looped, 8, dict(presence_penalty=2.0))
    args = {**greedy(return_tokens_as_token_ids=True, ignore_eos=True), "max_tokens": 8}
    reply = client.completions.create(model="random-target", prompt=looped, logprobs=0, presence_penalty=2.0, **args)
    assert _ids(reply.choices[0].logprobs.tokens) == expected


def test_logit_bias_gives_the_target_s_output_under_the_same_bias_and_drafters_bias_alike(api, client, tokenizer, target_with_template):
    """Greedy with drafting on: with the target's own first token banned and another token raised, the output is
    transformers' greedy `generate` with the same bias (`sequence_bias`), unary, streaming and over gRPC; a bias of 100 makes a
    token the output at every position and the drafters, biased alike, propose it: their drafts are accepted."""
    from tests.helpers import load_target

    prompt = PROMPTS[1]
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    plain = target_greedy(str(target_with_template), prompt, MAX_TOKENS)
    bias = {plain[0]: -100.0, plain[3]: 2.5}
    model, _ = load_target(str(target_with_template))
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=tokenizer.eos_token_id,
            sequence_bias={(t,): v for t, v in bias.items()},
        )  # fmt: skip
    expected = out[0, len(prompt_ids) :].tolist()
    assert expected != plain
    args = greedy(return_tokens_as_token_ids=True, ignore_eos=True)
    sent = {str(t): v for t, v in bias.items()}
    reply = client.completions.create(model="random-target", prompt=prompt, logprobs=0, logit_bias=sent, **args)
    assert _ids(reply.choices[0].logprobs.tokens) == expected[: len(reply.choices[0].logprobs.tokens)]
    streamed = [t for chunk in client.completions.create(model="random-target", prompt=prompt, logprobs=0, logit_bias=sent, stream=True, **args)
                if chunk.choices and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.tokens]  # fmt: skip
    assert streamed == reply.choices[0].logprobs.tokens
    with api.channel() as channel:
        request = greedy_request(prompt, MAX_TOKENS, 4, stop_at_eos=False, logit_bias=bias)
        assert list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120).token_ids) == _ids(reply.choices[0].logprobs.tokens)
    forced = client.completions.create(model="random-target", prompt=prompt, logprobs=0, logit_bias={"77": 100}, **args)
    assert _ids(forced.choices[0].logprobs.tokens) == [77] * MAX_TOKENS
    assert forced.model_extra["speculation"][0]["accepted_tokens"] > 0


def _limited_greedy(path: str, prompt_ids: list[int], allowed: list[int], bad_words: list[list[int]], max_tokens: int) -> list[int]:
    """transformers' greedy `generate` with vLLM's allowed_token_ids and bad_words: only the allowed tokens, and each bad
    word's last token never where the output (not the prompt) ends with its other tokens."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from tests.helpers import load_target

    class Limits(LogitsProcessor):
        def __call__(self, input_ids, scores):
            output = input_ids[0, len(prompt_ids) :].tolist()
            if allowed:
                keep = torch.full_like(scores, float("-inf"))
                keep[:, allowed] = 0
                scores = scores + keep
            for word in bad_words:
                if len(word) == 1 or output[len(output) - len(word) + 1 :] == word[:-1]:
                    scores[:, word[-1]] = float("-inf")
            return scores

    model, tokenizer = load_target(path)
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id,
            logits_processor=LogitsProcessorList([Limits()]),
        )  # fmt: skip
    return out[0, len(prompt_ids) :].tolist()


def test_allowed_token_ids_and_bad_words_give_the_target_s_output_under_them_over_http_and_grpc(api, client, tokenizer, target_with_template):
    """Greedy with drafting on: allowed_token_ids keep the output to them, and a bad word (as the target's tokenizer
    writes it first and after a space) is never generated; the output is transformers' greedy `generate` under the
    same limits, unary, streaming and over gRPC."""
    path, prompt = str(target_with_template), PROMPTS[0]
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    plain = target_greedy(path, prompt, MAX_TOKENS)
    allowed = sorted(set(plain[1:8]) | {77})
    expected = _limited_greedy(path, prompt_ids, allowed, [], MAX_TOKENS)
    assert expected != plain[: len(expected)] and set(expected) <= set(allowed)
    args = greedy(return_tokens_as_token_ids=True, ignore_eos=True, allowed_token_ids=allowed)
    reply = client.completions.create(model="random-target", prompt=prompt, logprobs=0, **args)
    assert _ids(reply.choices[0].logprobs.tokens) == expected
    # A word of the target's own output, as the router tokenizes it: the output differs where it would have held it.
    for word in (tokenizer.decode(plain[k : k + 2]) for k in range(1, 8)):
        spellings = [tokenizer.encode(text, add_special_tokens=False) for text in (word.lstrip(), " " + word.lstrip())]
        expected = _limited_greedy(path, prompt_ids, [], spellings, MAX_TOKENS)
        if expected != plain:
            break
    assert expected != plain, "some word of the output changes it when banned"
    args = greedy(return_tokens_as_token_ids=True, ignore_eos=True, bad_words=[word])
    reply = client.completions.create(model="random-target", prompt=prompt, logprobs=0, **args)
    assert _ids(reply.choices[0].logprobs.tokens) == expected
    streamed = [t for chunk in client.completions.create(model="random-target", prompt=prompt, logprobs=0, stream=True, **args)
                if chunk.choices and chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.tokens]  # fmt: skip
    assert streamed == reply.choices[0].logprobs.tokens
    with api.channel() as channel:
        request = greedy_request(prompt, MAX_TOKENS, 4, stop_at_eos=False, bad_words=[word], allowed_token_ids=[])
        assert list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120).token_ids) == expected


def test_a_truncated_prompt_is_its_last_tokens_over_http_and_grpc(api, client, tokenizer, target_with_template):
    """vLLM's truncate_prompt_tokens: the output is the target's greedy continuation of the prompt's last tokens, which
    usage counts and echo repeats."""
    prompt = PROMPTS[2]
    kept = tokenizer.encode(prompt, add_special_tokens=False)[-3:]
    expected = _limited_greedy(str(target_with_template), kept, [], [], MAX_TOKENS)
    args = greedy(return_tokens_as_token_ids=True, ignore_eos=True, truncate_prompt_tokens=3)
    reply = client.completions.create(model="random-target", prompt=prompt, logprobs=0, echo=True, **args)
    assert reply.usage.prompt_tokens == 3 and _ids(reply.choices[0].logprobs.tokens) == kept + expected
    assert reply.choices[0].text.startswith(tokenizer.decode(kept))
    with api.channel() as channel:
        request = greedy_request(prompt, MAX_TOKENS, 4, stop_at_eos=False, truncate_prompt_tokens=3)
        assert list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120).token_ids) == expected


def test_return_token_ids_gives_the_prompt_s_and_the_output_s_ids_unary_and_streaming(client, tokenizer, target_with_template):
    """vLLM's return_token_ids: a completion's choices carry the prompt's ids and their own; streamed, each event the
    ids its text came from and the first the prompt's; a chat's ids beside its choices, the prompt's once at the top."""
    prompt = PROMPTS[1]
    ids, plain = tokenizer.encode(prompt, add_special_tokens=False), target_greedy(str(target_with_template), PROMPTS[1], MAX_TOKENS)
    choice = client.completions.create(model="random-target", prompt=prompt, **greedy(return_token_ids=True)).choices[0]
    assert (choice.prompt_token_ids, choice.token_ids) == (ids, plain)
    events = [e for e in client.completions.create(model="random-target", prompt=prompt, stream=True, **greedy(return_token_ids=True)) if e.choices]
    assert events[0].choices[0].prompt_token_ids == ids and not any("prompt_token_ids" in e.choices[0].model_extra for e in events[1:])
    assert [t for e in events for t in e.choices[0].token_ids] == plain
    assert "token_ids" not in client.completions.create(model="random-target", prompt=prompt, **greedy()).choices[0].model_extra
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model="random-target", messages=messages, **greedy(return_token_ids=True))
    rendered = tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)
    assert chat.prompt_token_ids == rendered and len(chat.choices[0].token_ids) == chat.usage.completion_tokens
    events = list(client.chat.completions.create(model="random-target", messages=messages, stream=True, **greedy(return_token_ids=True)))
    assert events[0].prompt_token_ids == rendered and not any("prompt_token_ids" in e.model_extra for e in events[1:])
    assert [t for e in events if e.choices for t in e.choices[0].token_ids] == chat.choices[0].token_ids


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_completions_logprobs_are_the_target_s_unary_and_streaming(client, tokenizer, target_with_template, sampling):
    prompt = PROMPTS[0]
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    args = greedy(return_tokens_as_token_ids=True, top_k=8)
    if sampling == "sampled":
        args.update(SAMPLED)  # shaped sampling: the logprobs stay the raw distribution's
    reply = client.completions.create(model="random-target", prompt=prompt, logprobs=3, **args)
    lp = reply.choices[0].logprobs
    ids = _ids(lp.tokens)
    assert len(ids) == reply.usage.completion_tokens and reply.model_extra["speculation"][0]["accepted_tokens"] > 0
    if sampling == "greedy":
        assert ids == target_greedy(str(target_with_template), prompt, MAX_TOKENS)
    assert all(len(alternatives) in (3, 4) for alternatives in lp.top_logprobs)
    _check_against_target(str(target_with_template), prompt_ids, ids, lp.token_logprobs, lp.top_logprobs, top=3)
    assert lp.text_offset == [len("token_id:") * i + sum(len(str(t)) for t in ids[:i]) for i in range(len(ids))]

    streamed_tokens, streamed_logprobs = [], []
    for chunk in client.completions.create(model="random-target", prompt=prompt, logprobs=3, stream=True, **args):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed_tokens += chunk.choices[0].logprobs.tokens
            streamed_logprobs += chunk.choices[0].logprobs.token_logprobs
    assert streamed_tokens == lp.tokens
    assert streamed_logprobs == pytest.approx(lp.token_logprobs, abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize("sampling", ["greedy", "sampled"])
def test_chat_logprobs_are_the_target_s_unary_and_streaming(client, tokenizer, target_with_template, sampling):
    messages = [{"role": "user", "content": "The quick brown fox"}]
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    args = greedy(return_tokens_as_token_ids=True)
    if sampling == "sampled":
        args.update(SAMPLED)
    reply = client.chat.completions.create(model="random-target", messages=messages, logprobs=True, top_logprobs=2, **args)
    content = reply.choices[0].logprobs.content
    ids = _ids([e.token for e in content])
    assert len(ids) == reply.usage.completion_tokens
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in content)
    tops = [{t.token: t.logprob for t in [*e.top_logprobs, e]} for e in content]
    _check_against_target(str(target_with_template), prompt_ids, ids, [e.logprob for e in content], tops, top=2)

    streamed = []
    for chunk in client.chat.completions.create(model="random-target", messages=messages, logprobs=True, stream=True, **args):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(e.top_logprobs == [] for e in streamed)  # none asked for
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=LOGPROB_TOLERANCE)
    # Without logprobs, none come back.
    assert client.chat.completions.create(model="random-target", messages=messages, **greedy()).choices[0].logprobs is None


def test_grpc_clients_get_the_same_logprobs(api, tokenizer, target_with_template):
    prompt = PROMPTS[1]
    with api.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        reply = stub.Generate(greedy_request(prompt, MAX_TOKENS, 4, logprobs=True, top_logprobs=2), timeout=120)
        assert [lp.token_id for lp in reply.logprobs] == list(reply.token_ids)
        tops = [{f"token_id:{t.token_id}": t.logprob for t in [*lp.top, lp]} for lp in reply.logprobs]
        _check_against_target(
            str(target_with_template),
            tokenizer.encode(prompt, add_special_tokens=False),
            list(reply.token_ids),
            [lp.logprob for lp in reply.logprobs],
            tops,
            top=2,
        )
        chunks = list(stub.GenerateStream(greedy_request(prompt, MAX_TOKENS, 4, logprobs=True), timeout=120))
        assert [lp.token_id for c in chunks for lp in c.logprobs] == list(reply.token_ids)
        assert all(not lp.top for c in chunks for lp in c.logprobs)
        assert not stub.Generate(greedy_request(prompt, MAX_TOKENS, 4), timeout=120).logprobs


def test_logprobs_stop_where_the_output_stops(client, tokenizer, target_with_template):
    """A stop string or the end of sequence cuts the tokens mid-round: their logprobs are cut with them."""
    expected = tokenizer.decode(target_greedy(str(target_with_template), PROMPTS[0], MAX_TOKENS), skip_special_tokens=True)
    stop = expected[len(expected) // 2 : len(expected) // 2 + 3]
    assert stop.strip()
    for stream in (False, True):
        reply = client.completions.create(
            model="random-target", prompt=PROMPTS[0], logprobs=0, stop=[stop], stream=stream, **greedy(return_tokens_as_token_ids=True)
        )
        chunks = list(reply) if stream else [reply]
        tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        assert chunks[-1].choices[0].finish_reason == "stop"
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert stop not in text and expected.startswith(text)
        # The tokens up to the one that completed the stop string, each with its logprob.
        assert tokenizer.decode(_ids(tokens), skip_special_tokens=True).startswith(text + stop[:1])
        assert stop in tokenizer.decode(_ids(tokens), skip_special_tokens=True)
        assert stop not in tokenizer.decode(_ids(tokens)[:-1], skip_special_tokens=True)


def _raw_response(api, head: bytes, body_chunks=(), timeout_s: float = 10.0) -> tuple[int, dict, float]:
    """Sends `head` (request line and headers) and then `body_chunks` on a raw socket; the status, the error body
    and the seconds from the end of the head to the status line. The socket's timeout fails a server that waits."""
    port = int(api.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head)
        started = time.monotonic()
        try:
            for chunk in body_chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):  # refused while we were still sending: what the gate does
            pass
        response = sock.makefile("rb")
        status = int(response.readline().split()[1])
        seconds = time.monotonic() - started
        length = 0
        while (line := response.readline().strip()) != b"":
            name, _, value = line.partition(b":")
            if name.lower() == b"content-length":
                length = int(value)
        return status, json.loads(response.read(length)), seconds


def _head(length_header: str, key: str | None) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{auth}{length_header}\r\n".encode()


def test_a_body_without_the_key_is_refused_401_before_it_is_read(api):
    """A 200 MB body is announced and never sent: the 401 must come without it."""
    status, body, seconds = _raw_response(api, _head("Content-Length: 209715200\r\n", None))
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and seconds < 5


def test_a_body_over_max_request_bytes_is_refused_413_before_it_is_read(api):
    status, body, seconds = _raw_response(api, _head("Content-Length: 209715200\r\n", API_KEY))
    assert status == 413 and body["error"]["code"] == "request_too_large" and seconds < 5
    assert "209715200 bytes" in body["error"]["message"] and "router.max_request_bytes" in body["error"]["message"]


def test_a_chunked_body_is_refused_413_once_it_passes_max_request_bytes(api):
    """No declared length: the gate reads up to the limit (4 MB), then refuses; 6 MB are offered."""
    chunk = b"x" * (256 * 1024)
    framed = b"%x\r\n%s\r\n" % (len(chunk), chunk)
    status, body, _ = _raw_response(api, _head("Transfer-Encoding: chunked\r\n", API_KEY), [framed] * 24 + [b"0\r\n\r\n"])
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_a_prompt_that_starts_like_an_earlier_one_reuses_its_cached_prefix(api, client):
    """Prefix caching through the services (`enable_prefix_caching`, on by default): the same prompt again
    takes the verifier's cached blocks of the first (all its full 16-token blocks: prefix_cache_hits_total,
    vLLM's name) and gives the same greedy completion; each request's usage says how many of its prompt's tokens
    the cache held (OpenAI's prompt_tokens_details.cached_tokens), over HTTP and gRPC."""
    verifier_metrics = f"http://127.0.0.1:{api.config['verifier']['metrics_port']}/metrics"
    prompt = f"Run {time.monotonic_ns()}: " + " ".join(f"The report {i} says" for i in range(40))

    def complete():
        return client.completions.create(model="random-target", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})

    hits, queries = _metric(verifier_metrics, "specfleet:prefix_cache_hits_total"), _metric(verifier_metrics, "specfleet:prefix_cache_queries_total")
    first = complete()
    second = complete()
    assert second.choices[0].text == first.choices[0].text
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > 64
    hit = _metric(verifier_metrics, "specfleet:prefix_cache_hits_total") - hits
    assert hit >= prompt_tokens - 16
    assert _metric(verifier_metrics, "specfleet:prefix_cache_queries_total") - queries >= 2 * (prompt_tokens - 1)
    assert (first.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens_details.cached_tokens) == (0, hit)
    with api.channel() as channel:
        reply = generation_pb2_grpc.GenerationStub(channel).Generate(greedy_request(prompt, 8), timeout=120)
    assert (reply.usage.prompt_tokens, reply.usage.cached_tokens) == (prompt_tokens, hit)
    # Streamed with continuous usage (vLLM's), every chunk's usage says so too, not only the last.
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model="random-target", prompt=prompt, max_tokens=8, temperature=0, stream=True, stream_options=options))
    assert [c.usage.prompt_tokens_details.cached_tokens for c in chunks] == [hit] * len(chunks)


def _hits(url: str) -> float:
    """A service's prefix cache hits, over all its label sets (a drafter service's are labelled by it)."""
    text = without_model_name(urllib.request.urlopen(url, timeout=10).read().decode())
    return sum(float(v) for v in re.findall(r"^specfleet:prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", text, re.M))


def test_a_cache_salt_shares_cached_prompts_only_among_its_own_requests(api, client):
    """vLLM's cache_salt: a salted prompt takes cached blocks at the verifier and the drafter only from earlier
    requests of the same salt, never another salt's or an unsalted one's; the output is the target's either way."""
    ports = api.config["verifier"]["metrics_port"], api.config["drafters"][0]["metrics_port"]
    services = [f"http://127.0.0.1:{port}/metrics" for port in ports]
    # About 38 blocks a request: more than a new CPU pool's 64 hold beside another's idle blocks, so the services keep
    # tenant-a's first request's blocks cached only by growing their pools within their KV budgets.
    prompt = f"Ledger {time.monotonic_ns()}: " + " ".join(f"entry {i} balances" for i in range(40))

    def complete(salt: str | None) -> tuple[str, list[float]]:
        before = [_hits(url) for url in services]
        extra = {"ignore_eos": True, "speculation": {"max_draft_tokens": 4}} | ({"cache_salt": salt} if salt is not None else {})
        text = client.completions.create(model="random-target", prompt=prompt, max_tokens=8, temperature=0, extra_body=extra).choices[0].text
        return text, [_hits(url) - b for url, b in zip(services, before)]

    runs = [complete(salt) for salt in ("tenant-a", "tenant-b", None, "tenant-a")]
    assert all(text == runs[0][0] for text, _ in runs)
    assert [hits for _, hits in runs[:3]] == [[0, 0]] * 3, "no salt takes another's blocks"
    verifier_hits, drafter_hits = runs[3][1]
    assert verifier_hits >= 512 and drafter_hits >= 512, "tenant-a's second request takes its first's blocks at both"


def _prompt_reference(path: str, prompt_ids: list[int], top: int):
    """The target's own log-probabilities of the prompt's tokens past the first, and each position's `top` best."""
    return target_logprobs(path, prompt_ids[:1], prompt_ids[1:], top)


def test_completions_echo_the_prompt_with_the_target_s_logprobs_unary_and_streaming(client, tokenizer, target_with_template):
    """echo: the text is the prompt's followed by the output; with logprobs, the prompt's tokens come first, the first
    with none (nothing precedes it), the others with the target's log-probabilities and alternatives; streamed, the
    first chunk carries the prompt."""
    prompt = PROMPTS[2]
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    args = greedy(return_tokens_as_token_ids=True)
    plain = client.completions.create(model="random-target", prompt=prompt, logprobs=2, **args).choices[0]
    echoed = client.completions.create(model="random-target", prompt=prompt, logprobs=2, echo=True, **args).choices[0]
    assert echoed.text == prompt + plain.text
    lp = echoed.logprobs
    n = len(prompt_ids)
    assert _ids(lp.tokens) == prompt_ids + _ids(plain.logprobs.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=LOGPROB_TOLERANCE)
    chosen, best_ids, best_values = _prompt_reference(str(target_with_template), prompt_ids, 2)
    assert lp.token_logprobs[1:n] == pytest.approx(chosen, abs=LOGPROB_TOLERANCE)
    for position in range(1, n):
        expected = {f"token_id:{t}": v for t, v in zip(best_ids[position - 1], best_values[position - 1])}
        expected[f"token_id:{prompt_ids[position]}"] = chosen[position - 1]
        assert set(lp.top_logprobs[position]) == set(expected), position
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]

    streamed_text, streamed_tokens = "", []
    for chunk in client.completions.create(model="random-target", prompt=prompt, logprobs=2, echo=True, stream=True, **args):
        if chunk.choices:
            streamed_text += chunk.choices[0].text
            streamed_tokens += chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else []
    assert streamed_text == echoed.text and streamed_tokens == lp.tokens
    # Without logprobs: the text alone; several prompts each echo their own.
    reply = client.completions.create(model="random-target", prompt=PROMPTS[:2], echo=True, **greedy())
    texts = [c.text for c in sorted(reply.choices, key=lambda c: c.index)]
    assert all(text.startswith(p) and c.logprobs is None for text, p, c in zip(texts, PROMPTS[:2], reply.choices))


def test_prompt_logprobs_are_the_target_s_over_http_and_grpc(api, client, tokenizer, target_with_template):
    """vLLM's prompt_logprobs: None for the first prompt token, then the token and its position's best, each with the
    target's log-probability, its rank and its text; the same over gRPC (GenerateResponse.prompt_logprobs, and the
    first chunk of a stream); without the field, none."""
    prompt = PROMPTS[1]
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    chosen, best_ids, best_values = _prompt_reference(str(target_with_template), prompt_ids, 2)
    reply = client.completions.create(model="random-target", prompt=prompt, **greedy(prompt_logprobs=2))
    entries = reply.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt_ids)
    for position, entry in enumerate(entries[1:]):
        token = str(prompt_ids[position + 1])
        assert entry[token]["logprob"] == pytest.approx(chosen[position], abs=LOGPROB_TOLERANCE)
        assert entry[token]["decoded_token"] == tokenizer.decode([prompt_ids[position + 1]])
        assert {str(t) for t in best_ids[position]} <= set(entry) and len(entry) in (2, 3)
        assert [entry[str(t)]["rank"] for t in best_ids[position]] == [1, 2]
        assert entry[token]["rank"] >= 1 + sum(v > chosen[position] + LOGPROB_TOLERANCE for v in best_values[position])
        assert (entry[token]["rank"] == 1) == (prompt_ids[position + 1] == best_ids[position][0])
    messages = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model="random-target", messages=messages, **greedy(prompt_logprobs=0))
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    assert [list(e)[0] if e else None for e in chat.model_extra["prompt_logprobs"]] == [None] + [str(t) for t in chat_ids[1:]]
    assert "prompt_logprobs" not in client.completions.create(model="random-target", prompt=prompt, **greedy()).choices[0].model_extra

    with api.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        grpc_reply = stub.Generate(greedy_request(prompt, MAX_TOKENS, 4, prompt_logprobs=1), timeout=120)
        assert [lp.token_id for lp in grpc_reply.prompt_logprobs] == prompt_ids[1:]
        assert [lp.logprob for lp in grpc_reply.prompt_logprobs] == pytest.approx(chosen, abs=LOGPROB_TOLERANCE)
        assert all(len(lp.top) == 1 and lp.rank >= 1 for lp in grpc_reply.prompt_logprobs)
        chunks = list(stub.GenerateStream(greedy_request(prompt, MAX_TOKENS, 4, prompt_logprobs=0), timeout=120))
        assert [lp.token_id for lp in chunks[0].prompt_logprobs] == prompt_ids[1:] and not any(c.prompt_logprobs for c in chunks[1:])
        assert not stub.Generate(greedy_request(prompt, MAX_TOKENS, 4), timeout=120).prompt_logprobs


GUIDED = [
    ("choice", {"structured_outputs": {"choice": ["the cat sat", "a dog ran far", "no"]}}),
    ("regex", {"structured_outputs": {"regex": "[a-f]{3} [0-9]{1,3}\\."}}),
    ("grammar", {"structured_outputs": {"grammar": 'root ::= "yes" | "no" | ("maybe " [0-9])'}}),
]


@pytest.mark.parametrize("kind, body", GUIDED, ids=[k for k, _ in GUIDED])
def test_structured_output_follows_the_guide_and_is_the_target_s_guided_output_with_drafting_on_or_off(
    api, client, tokenizer, target_with_template, kind, body
):
    """vLLM's structured_outputs, greedy: the text follows the guide and ends with end of sequence; the tokens are
    transformers' `generate` with xgrammar's mask (tests/verifier_service/test_guides.py `reference`), with drafting
    on and off, unary, streaming and over gRPC."""
    from tests.verifier_service.test_guides import reference

    prompt = PROMPTS[1]
    spec = body["structured_outputs"][kind]
    guide = Guide(kind, json.dumps(spec) if kind == "choice" else spec)
    expected = reference(str(target_with_template), tokenizer.encode(prompt, add_special_tokens=False), guide, steps=MAX_TOKENS)
    assert expected[-1] == tokenizer.eos_token_id, "the guided output completes within MAX_TOKENS"
    text = tokenizer.decode(expected[:-1])
    if kind == "choice":
        assert text in body["structured_outputs"]["choice"]
    elif kind == "regex":
        assert re.fullmatch(body["structured_outputs"]["regex"], text)
    for k in (4, 0):
        args = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"speculation": {"max_draft_tokens": k, "disabled": k == 0}, **body}}
        reply = client.completions.create(model="random-target", prompt=prompt, **args)
        assert (reply.choices[0].text, reply.choices[0].finish_reason) == (text, "stop"), k
        chunks = client.completions.create(model="random-target", prompt=prompt, stream=True, **args)
        streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert streamed == text
    with api.channel() as channel:
        request = greedy_request(prompt, MAX_TOKENS, 4, guide=common_pb2.Guide(kind=guide.kind, spec=guide.spec))
        assert list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=120).token_ids) == expected


def test_response_format_json_schema_and_json_object_give_json_that_parses(client):
    """OpenAI's response_format on chat: a json_schema's output parses and has the schema's required key with a value
    of its type (exactly the JSON without whitespace under vLLM's disable_any_whitespace); json_object's parses as an
    object (or is cut by max_tokens, as with vLLM, where it has not closed)."""
    answer = {"type": "string", "enum": ["yes", "no"]}
    schema = {"type": "object", "properties": {"answer": answer}, "required": ["answer"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Is the sky blue? Answer in JSON."}]
    reply = client.chat.completions.create(
        model="random-target", messages=messages, temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )  # fmt: skip
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert json.loads(choice.message.content)["answer"] in ("yes", "no")
    else:
        assert choice.message.content.lstrip().startswith("{"), choice.message.content
    # vLLM's disable_any_whitespace: no whitespace at all.
    compact = client.chat.completions.create(
        model="random-target", messages=messages, temperature=0, max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )  # fmt: skip
    assert compact.choices[0].message.content in ('{"answer":"yes"}', '{"answer":"no"}'), compact.choices[0].message.content
    seeded = client.chat.completions.create(model="random-target", messages=messages, seed=3, max_tokens=64, response_format={"type": "json_object"})
    content = seeded.choices[0].message.content
    if seeded.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert content.lstrip().startswith("{"), content


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}, "unit": {"type": "string", "enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}


def test_a_named_tool_choice_and_required_give_tool_calls_whose_arguments_follow_the_schema_unary_and_streaming(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    args = dict(model="random-target", messages=messages, temperature=0, max_tokens=128, tools=[WEATHER, TIME])
    named = client.chat.completions.create(**args, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = named.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", None)
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Oslo") and arguments["unit"] in ("C", "F"), arguments
    # Streamed: nothing until the call is complete, then the call whole, as the unary reply has it, with the
    # log-probabilities of every token held back until then.
    named = {"type": "function", "function": {"name": "get_weather"}}
    chunks = list(client.chat.completions.create(**args, tool_choice=named, stream=True, logprobs=True, stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0].tool_calls[0].function.arguments == call.function.arguments
    logprobs = [entry for c in chunks if c.choices and c.choices[0].logprobs for entry in c.choices[0].logprobs.content]
    assert len(logprobs) == chunks[-1].usage.completion_tokens > 0
    chunks = chunks[:-1]  # the usage chunk
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    required = client.chat.completions.create(**args, tool_choice="required", parallel_tool_calls=False)
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and isinstance(json.loads(call.function.arguments), dict)
    # A conversation that carries a tool call and its result renders and runs.
    turn = {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": call.function.model_dump()}]}
    result = {"role": "tool", "tool_call_id": call.id, "content": "18 C"}
    followed = client.chat.completions.create(
        model="random-target", messages=[*messages, turn, result], temperature=0, max_tokens=8, tools=[WEATHER], tool_choice="none"
    )
    assert followed.choices[0].message.tool_calls is None and followed.choices[0].finish_reason in ("stop", "length")


# Where the model writes a call in the hermes format: its output guided to be text, then one call.
CALLED = r'Checking\.<tool_call>\{"name":"get_weather","arguments":\{"city":"(Paris|Oslo)","unit":"(C|F)"\}\}</tool_call>'


def test_auto_tool_choice_reads_the_calls_the_model_writes_and_its_text_as_content_unary_and_streaming(client, tokenizer):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    args = dict(model="random-target", messages=messages, temperature=0, max_tokens=96, tools=[WEATHER, TIME])
    called = dict(args, extra_body={"structured_outputs": {"regex": CALLED}})
    reply = client.chat.completions.create(**called)  # tool_choice "auto": OpenAI's default where tools are given
    choice = reply.choices[0]
    assert (choice.finish_reason, choice.message.content) == ("tool_calls", "Checking."), choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    arguments = json.loads(call.function.arguments)
    assert arguments["city"] in ("Paris", "Oslo") and arguments["unit"] in ("C", "F"), arguments
    # Streamed: the text as content, never a piece of the call's tag, then the call whole.
    chunks = list(client.chat.completions.create(**called, tool_choice="auto", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    (streamed,) = [d.tool_calls for d in deltas if d.tool_calls]
    assert (streamed[0].index, streamed[0].function.name, streamed[0].function.arguments) == (0, "get_weather", call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Text without a call is the reply's content, as without tools.
    plain = client.chat.completions.create(**args, tool_choice="auto", extra_body={"structured_outputs": {"regex": "Paris is (sunny|grey)\\."}})
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content in ("Paris is sunny.", "Paris is grey.")
    assert plain.choices[0].finish_reason == "stop"
    # A parser whose tags may be special tokens keeps their text: end of sequence's here, raised by its bias and no end.
    eos = tokenizer.eos_token_id
    special = client.chat.completions.create(**{**args, "max_tokens": 3}, logit_bias={str(eos): 100}, extra_body={"ignore_eos": True})
    assert special.choices[0].message.content == tokenizer.decode([eos] * 3, skip_special_tokens=False) != ""


def test_a_thought_is_the_reply_s_reasoning_and_chat_template_kwargs_reach_the_template(client, tokenizer, target_with_template):
    messages = [{"role": "user", "content": "Where is Paris?"}]
    args = dict(model="random-target", messages=messages, temperature=0, max_tokens=64)
    # The model's output guided to open with a thought, as a reasoning model writes it.
    thought = {"structured_outputs": {"regex": r"<think>(Paris|Oslo) is a city\.</think>In France\."}}
    message = client.chat.completions.create(**args, extra_body=thought).choices[0].message
    assert message.reasoning in ("Paris is a city.", "Oslo is a city.") and message.content == "In France.", message
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**args, extra_body=thought, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == message.reasoning
    assert "".join(d.content or "" for d in deltas) == "In France."
    # chat_template_kwargs reach the template: here it opens the thought, so the output starts inside it, where a guide
    # (vLLM's way with reasoning models) leaves it alone: the random target never ends it, so all of it is the
    # unguided target's thought.
    opened = {"chat_template_kwargs": {"thinking": True}, "structured_outputs": {"regex": r"Yes\."}}
    reply = client.chat.completions.create(**args, extra_body=opened)
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=True)
    assert prompt.endswith("<assistant><think>") and reply.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    plain = target_greedy(str(target_with_template), prompt, 64)
    assert reply.choices[0].message.reasoning == tokenizer.decode(plain, skip_special_tokens=True) and not reply.choices[0].message.content
    # A prompt that closes the thought (a template's "no thinking"): the guide reads the output from its first token.
    closed = [*messages, {"role": "assistant", "content": "<think>Hmm.</think>"}]
    body = dict(add_generation_prompt=False, continue_final_message=True, structured_outputs={"regex": r"Yes\."})
    reply = client.chat.completions.create(**{**args, "messages": closed}, extra_body=body)
    assert (getattr(reply.choices[0].message, "reasoning", None), reply.choices[0].message.content) == (None, "Yes.")


def test_an_assistant_message_s_earlier_thought_reaches_the_template_under_either_name(client, tokenizer):
    """vLLM's reasoning (or reasoning_content) on an assistant message sent back in a later turn: the template reads it
    as reasoning_content (Qwen 3's renders it); on another role, or two different thoughts, it is refused by name."""
    turns = [{"role": "user", "content": "Where is Paris?"}, None, {"role": "user", "content": "And?"}]
    earlier = {"role": "assistant", "content": "In France.", "reasoning_content": "A city."}
    expected = tokenizer.apply_chat_template([turns[0], earlier, turns[2]], tokenize=False, add_generation_prompt=True)
    assert "<assistant><think>A city.</think>In France." in expected
    for key in ("reasoning", "reasoning_content"):
        turns[1] = {"role": "assistant", "content": "In France.", key: "A city."}
        reply = client.chat.completions.create(model="random-target", messages=turns, max_tokens=1)
        assert reply.usage.prompt_tokens == len(tokenizer.encode(expected, add_special_tokens=False)), key
    refused = [
        [{"role": "user", "content": "hi", "reasoning": "Hm."}],
        [{"role": "assistant", "content": "hi", "reasoning": "Hm.", "reasoning_content": "Other."}],
        [{"role": "assistant", "content": "hi", "reasoning": 3}],
    ]
    for messages in refused:
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="random-target", messages=messages, max_tokens=1)
        assert err.value.body["param"] == "messages" and "messages[0].reasoning" in err.value.body["message"], err.value.body


TEMPLATE_REFUSALS = [
    ({"continue_final_message": True}, "continue_final_message"),
    ({"add_generation_prompt": False, "continue_final_message": True, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
]


@pytest.mark.parametrize("fields, param", TEMPLATE_REFUSALS, ids=["both-prompt-ends", "template-argument"])
def test_chat_template_options_that_conflict_are_refused_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="random-target", messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body=fields)
    assert err.value.body["param"] == param, err.value.body


TOOL_REFUSALS = [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools", "tools[0]"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
]


@pytest.mark.parametrize("fields, param, says", TOOL_REFUSALS, ids=[str(i) for i in range(len(TOOL_REFUSALS))])
def test_tool_choices_specfleet_cannot_serve_are_refused_naming_the_field(client, fields, param, says):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="random-target", messages=[{"role": "user", "content": "hi"}], max_tokens=4, **fields)
    assert err.value.body["param"] == param and says in err.value.body["message"], err.value.body
