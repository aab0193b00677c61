"""The router's front door (router/frontdoor.py) without a transport: typed params in, typed events out, typed errors.

The requests run on a router built in this process over the default cluster's real verifier and
drafter (a second router beside the cluster's own), its scheduler on an event loop of its own thread.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import math
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
import tokenizers

from router.api import (
    Completion,
    Delta,
    ErrorKind,
    Finished,
    GenerationError,
    GenerationParams,
    SpeculationOptions,
    SpeculationStats,
    DrafterStats,
    TokenLogprobs,
)
from router.frontdoor import FrontDoor, interleave
from router.grpc_api import params_of
from router.openai_schema import ChatRequest, CompletionRequest
from router.openai_schema import params_of as params_of_body
from router.tokens_api import TokenizeRequest
from specfleet.guides import Guide, GuideCompiler
from router.validation import validate
from router.request import Limits
from specfleet.config import RequestLimitsConfig
from specfleet.tokenizer import load_tokenizer
from specfleet.v1 import generation_pb2
from tests.helpers import PROMPTS, target_greedy

REPO = pathlib.Path(__file__).resolve().parents[2]
LONG = {"max_tokens": 900, "stop_at_eos": False, "speculation": SpeculationOptions(disabled=True)}  # far longer than any test waits


@dataclasses.dataclass
class Door:
    front_door: FrontDoor
    loop: asyncio.AbstractEventLoop

    def run(self, coroutine, timeout_s: float = 300):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)


@pytest.fixture(scope="module")
def door(cluster):
    from router.server import build
    from specfleet import config as config_mod

    cfg = config_mod.load(cluster.config_path)
    cfg.router.speculation.pin_cost_model = True  # no start-up profiling: it would only cost time here
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="frontdoor-test-loop", daemon=True)
    thread.start()

    async def start():
        front_door, scheduler, transports = await build(cfg)
        scheduler.start()
        return front_door, transports

    front_door, transports = asyncio.run_coroutine_threadsafe(start(), loop).result(300)
    door = Door(front_door, loop)
    yield door

    async def stop():
        await front_door.scheduler.stop()
        for transport in transports:
            await transport.close()

    door.run(stop())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=30)
    loop.close()


async def _until_idle(front_door: FrontDoor, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while front_door.scheduler.running or front_door.scheduler.waiting:
        assert time.monotonic() < deadline, "the scheduler still runs a request nobody reads"
        await asyncio.sleep(0.05)


# --- validation: no scheduler needed -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(random_family):
    return load_tokenizer(str(random_family["target"]))


@pytest.fixture(scope="module")
def limits(tokenizer):
    requests = RequestLimitsConfig(default_max_tokens=64, max_tokens_limit=2048, num_draft_tokens=4, max_draft_tokens=16)
    return Limits(requests, vocab_size=len(tokenizer), max_context=1024, max_prompt_chars=10_000)


REFUSED = [
    (dict(request_id="a\nb"), "request_id"),
    (dict(domain="d" * 129), "domain"),
    (dict(prompt="hi", prompt_token_ids=[5]), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(prompt="word " * 3000), "prompt"),  # over max_prompt_chars: refused before tokenizing
    (dict(prompt_token_ids=[5, 10**9]), "prompt_token_ids"),
    (dict(prompt_token_ids=[5] * 1024), "prompt"),  # no room left in the context
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=2049), "max_tokens"),
    (dict(max_tokens=1024), "max_tokens"),  # past the context after the prompt
    (dict(temperature=-1.0), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=1e39), "temperature"),  # finite, but infinite as the float32 the servers get
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1e-50), "top_p"),  # 0 as a float32
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2**31), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=math.nan), "min_p"),
    (dict(seed=-1), "seed"),
    (dict(seed=2**64), "seed"),
    (dict(stop=[""]), "stop"),
    (dict(stop=["x"] * 17), "stop"),
    (dict(speculation=SpeculationOptions(max_draft_tokens=17)), "speculation.max_draft_tokens"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(top_logprobs=2), "top_logprobs"),
    (dict(allowed_token_ids=[5, -1]), "allowed_token_ids"),
    (dict(allowed_token_ids=list(range(4097))), "allowed_token_ids"),
    (dict(allowed_token_ids=[0], stop_token_ids=[0], min_tokens=2), "min_tokens"),  # every allowed token held back
    (dict(bad_words=[" "]), "bad_words"),
    (dict(bad_words=["x"] * 65), "bad_words"),
    (dict(bad_words=["word " * 40]), "bad_words"),  # more tokens than a bad word may have
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    (dict(priority=1), "priority"),  # router.priority_scheduling is off
    (dict(cache_salt=""), "cache_salt"),  # set, it names a tenant
    (dict(cache_salt="t" * 257), "cache_salt"),
]


@pytest.mark.parametrize("fields,field", REFUSED, ids=[f"{f}-{i}" for i, (_, f) in enumerate(REFUSED)])
def test_bad_params_are_refused_naming_the_field(tokenizer, limits, fields, field):
    params = GenerationParams(**{"prompt": "The quick brown fox", **fields}) if "prompt_token_ids" not in fields else GenerationParams(**fields)
    with pytest.raises(GenerationError) as err:
        validate(params, tokenizer, limits)
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT
    assert err.value.field == field and err.value.message.startswith(f"{field}: ")


def test_valid_params_become_the_request_asked_for(tokenizer, limits):
    prompt_ids = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    seeded = validate(
        GenerationParams(prompt="The quick brown fox", temperature=0.7, top_p=0.9, top_k=8, seed=11, stop=["\n"], request_id="mine"),
        tokenizer,
        limits,
    )
    assert seeded.prompt_ids == prompt_ids and seeded.max_tokens == limits.requests.default_max_tokens
    assert (seeded.sampling.seed, seeded.sampling.drafter_invariant, seeded.sampling.top_k) == (11, True, 8)
    assert seeded.sampling.temperature == pytest.approx(0.7) and seeded.stop == ["\n"] and seeded.stop_at_eos
    # The client's label is echoed; the sessions are named by the router, unguessably.
    assert seeded.request_id == "mine" and seeded.session_id != "mine" and len(seeded.session_id) == 32
    assert seeded.max_draft_tokens == limits.requests.num_draft_tokens
    plain = validate(
        GenerationParams(prompt_token_ids=prompt_ids, speculation=SpeculationOptions(disabled=True, max_draft_tokens=3)), tokenizer, limits
    )
    assert plain.prompt_ids == prompt_ids and plain.request_id and not plain.sampling.drafter_invariant and plain.max_draft_tokens == 0
    # The server's default max_tokens is cut to what the context holds; a client's is refused (above).
    long_prompt = [5] * 1000
    assert validate(GenerationParams(prompt_token_ids=long_prompt), tokenizer, limits).max_tokens == 24
    # vLLM's allowed_token_ids sorted, each once; a bad word as written first and after a space, read after the prompt.
    limited = validate(GenerationParams(prompt_token_ids=prompt_ids, allowed_token_ids=[9, 3, 9], bad_words=["fox", " fox"]), tokenizer, limits)
    words = (tuple(tokenizer.encode("fox", add_special_tokens=False)), tuple(tokenizer.encode(" fox", add_special_tokens=False)))
    assert limited.sampling.allowed_token_ids == (3, 9) and limited.sampling.bad_words == tuple(dict.fromkeys(words))
    assert limited.sampling.output_start == len(prompt_ids) and len(words[1]) == 1
    with pytest.raises(GenerationError, match="bad_words: word 1 is 513 characters; at most 512"):  # refused untokenized
        validate(GenerationParams(prompt_token_ids=prompt_ids, bad_words=["fox", "w" * 513]), tokenizer, limits)
    # vLLM's truncate_prompt_tokens: the prompt's last tokens; -1 keeps what fits beside max_tokens, and a prompt longer
    # than the context's characters is read (truncated) rather than refused.
    assert validate(GenerationParams(prompt_token_ids=prompt_ids, truncate_prompt_tokens=2), tokenizer, limits).prompt_ids == prompt_ids[-2:]
    fitted = validate(GenerationParams(prompt_token_ids=long_prompt + [7], max_tokens=1000, truncate_prompt_tokens=-1), tokenizer, limits)
    assert fitted.prompt_ids == (long_prompt + [7])[-24:] and fitted.max_tokens == 1000
    text = validate(GenerationParams(prompt="word " * 3000, truncate_prompt_tokens=-1), tokenizer, limits)
    assert len(text.prompt_ids) == 1024 - limits.requests.default_max_tokens
    # vLLM's priority, where the server admits by it.
    by_priority = dataclasses.replace(limits, requests=dataclasses.replace(limits.requests, priority_scheduling=True))
    assert validate(GenerationParams(prompt_token_ids=prompt_ids, priority=-3), tokenizer, by_priority).priority == -3
    with pytest.raises(GenerationError, match="priority: must fit in 32 bits"):
        validate(GenerationParams(prompt_token_ids=prompt_ids, priority=2**31), tokenizer, by_priority)
    # vLLM's cache_salt: a tenant's name, up to 256 characters, carried to the request's sessions.
    assert validate(GenerationParams(prompt_token_ids=prompt_ids, cache_salt="t" * 256), tokenizer, limits).cache_salt == "t" * 256


def test_a_text_prompt_gets_the_tokenizer_s_special_tokens_unless_asked_not_to(random_family, tmp_path, limits):
    """vLLM's add_special_tokens: a text prompt encoded as the tokenizer encodes it, a BOS first where it adds one (as
    vLLM's completions and transformers' generate), unless the request says not to (a chat's rendered template, which
    wrote its own); gRPC's default is a completion's. /tokenize counts a prompt as the endpoint it stands for does."""
    path = tmp_path / "bos"
    shutil.copytree(random_family["target"], path)
    backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    bos = backend.token_to_id("<|endoftext|>")
    backend.post_processor = tokenizers.processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)])
    backend.save(str(path / "tokenizer.json"))
    with_bos = load_tokenizer(path)
    plain = with_bos.encode("The fox", add_special_tokens=False)
    assert validate(GenerationParams(prompt="The fox"), with_bos, limits).prompt_ids == [bos, *plain]
    assert validate(GenerationParams(prompt="The fox", add_special_tokens=False), with_bos, limits).prompt_ids == plain
    assert params_of(generation_pb2.GenerateRequest(prompt="x")).add_special_tokens
    assert not params_of(generation_pb2.GenerateRequest(prompt="x", add_special_tokens=False)).add_special_tokens
    completion, chat = CompletionRequest(model="m", prompt="x"), ChatRequest(model="m", messages=[{"role": "user", "content": "x"}])
    assert params_of_body(completion, 4, "x", 0, 0).add_special_tokens and not params_of_body(chat, 4, "x", 0, 0).add_special_tokens
    chat.add_special_tokens = True
    assert params_of_body(chat, 4, "x", 0, 0).add_special_tokens
    assert TokenizeRequest(model="m", prompt="x").special_tokens() and not TokenizeRequest(model="m", messages=[{"role": "user"}]).special_tokens()
    assert not TokenizeRequest(model="m", prompt="x", add_special_tokens=False).special_tokens()


def test_a_guide_is_compiled_on_admission_and_refused_where_the_verifier_cannot_compile_guides(tokenizer, limits):
    """A guide that does not compile is refused naming it, before anything is submitted; so is every guide where the
    verifier has no xgrammar (the front door then holds no compiler: ModelInfo.structured_output false)."""
    guides = GuideCompiler(tokenizer, limits.vocab_size, limits.eos_token_id)
    spec = validate(GenerationParams(prompt="The quick", guide=Guide("regex", "[a-z]+")), tokenizer, limits, guides)
    assert spec.sampling.guide == Guide("regex", "[a-z]+") and spec.sampling.output_start == len(spec.prompt_ids)
    for guides, says in ((guides, "the regex does not compile"), (None, "pip install xgrammar")):
        with pytest.raises(GenerationError) as err:
            validate(GenerationParams(prompt="The quick", guide=Guide("regex", "[a-z")), tokenizer, limits, guides)
        assert err.value.field == "guide" and says in err.value.message, err.value.message
    with pytest.raises(GenerationError, match="min_tokens: cannot be combined with structured output"):
        compiler = GuideCompiler(tokenizer, limits.vocab_size, limits.eos_token_id)
        validate(GenerationParams(prompt="The quick", guide=Guide("regex", "[a-z]+"), min_tokens=2), tokenizer, limits, compiler)
    from specfleet.v1 import common_pb2

    for can, compiles in ((True, True), (False, False)):
        door = FrontDoor(None, tokenizer, limits, limits.eos_token_id, common_pb2.ModelInfo(structured_output=can))
        assert (door.guides is not None) == compiles


# --- generation through the front door --------------------------------------------------------------------------


def test_a_request_streams_deltas_then_one_finished_with_the_target_s_tokens(door, random_family, tokenizer):
    params = GenerationParams(prompt=PROMPTS[0], max_tokens=24, speculation=SpeculationOptions(max_draft_tokens=3), logprobs=True, top_logprobs=2)

    async def collect():
        return [event async for event in door.front_door.generate(params, via="test")]

    events = door.run(collect())
    assert all(type(e) is Delta for e in events[:-1]) and type(events[-1]) is Finished
    ids = [t for e in events for t in e.token_ids]
    assert ids == target_greedy(str(random_family["target"]), PROMPTS[0], 24)
    assert "".join(e.text for e in events) == tokenizer.decode(ids, skip_special_tokens=True)
    final = events[-1]
    assert final.finish_reason == ("eos" if tokenizer.eos_token_id in ids else "length")
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(tokenizer.encode(PROMPTS[0], add_special_tokens=False)), len(ids))
    assert final.speculation.rounds >= 1 and 0 <= final.speculation.accepted_tokens <= final.speculation.draft_tokens
    logprobs = [lp for e in events for lp in e.logprobs]
    assert all(type(lp) is TokenLogprobs and len(lp.top) == 2 and lp.logprob <= 0 for lp in logprobs)
    assert [lp.token_id for lp in logprobs] == ids


def test_complete_returns_the_whole_output_as_streaming_would(door, random_family):
    params = GenerationParams(prompt=PROMPTS[1], max_tokens=16, request_id="frontdoor-complete", speculation=SpeculationOptions(max_draft_tokens=2))

    async def both():
        generation = await door.front_door.submit(params, via="test")
        streamed = [e async for e in door.front_door.generate(params, via="test")]
        return await generation.complete(), streamed

    result, streamed = door.run(both())
    assert type(result) is Completion and result.request_id == "frontdoor-complete"
    assert result.token_ids == [t for e in streamed for t in e.token_ids] == target_greedy(str(random_family["target"]), PROMPTS[1], 16)
    assert result.text == "".join(e.text for e in streamed) and result.finish_reason == streamed[-1].finish_reason
    assert result.usage == streamed[-1].usage and not result.logprobs


def test_a_consumer_that_stops_reading_cancels_its_request(door):
    metrics = door.front_door.scheduler.context.metrics
    cancelled = metrics.requests_cancelled

    async def leave_early():
        events = door.front_door.generate(GenerationParams(prompt=PROMPTS[2], **LONG), via="test")
        first = await anext(events)
        await events.aclose()  # the consumer goes away after one round
        await _until_idle(door.front_door)
        return first

    assert type(door.run(leave_early())) is Delta
    assert metrics.requests_cancelled == cancelled + 1


def test_cancel_stops_a_request_and_releases_its_sessions(door, cluster):
    from tests.operations import wait_released

    async def cancel_after_a_round():
        generation = await door.front_door.submit(GenerationParams(prompt=PROMPTS[3], **LONG), via="test")
        events = generation.events()
        await anext(events)
        generation.cancel("the test is done with it")
        await _until_idle(door.front_door)
        return generation

    generation = door.run(cancel_after_a_round())
    assert generation.state.cancelled and len(generation.state.output_ids) < 900
    held = wait_released(cluster, generation.state.spec.session_id)
    assert generation.state.spec.session_id not in held["verifier"] | held["drafter"], held


def test_interleave_raises_the_first_failure_and_cancels_the_others(door):
    async def scenario():
        long = await door.front_door.submit(GenerationParams(prompt=PROMPTS[4], **LONG), via="test")
        late = await door.front_door.submit(GenerationParams(prompt=PROMPTS[5], max_tokens=8), deadline=time.monotonic(), via="test")
        with pytest.raises(GenerationError) as err:
            async for _ in interleave([long, late], "a sibling failed"):
                pass
        await _until_idle(door.front_door)
        return err.value, long

    err, long = door.run(scenario())
    assert err.kind is ErrorKind.DEADLINE_EXCEEDED and "deadline" in err.message
    assert long.state.cancelled


def test_submit_all_is_all_or_nothing(door):
    metrics = door.front_door.scheduler.context.metrics
    cancelled = metrics.requests_cancelled

    async def scenario():
        with pytest.raises(GenerationError) as err:
            await door.front_door.submit_all([GenerationParams(prompt=PROMPTS[6], **LONG), GenerationParams(prompt="hi", top_p=2.0)], via="test")
        await _until_idle(door.front_door)
        return err.value

    err = door.run(scenario())
    assert err.kind is ErrorKind.INVALID_ARGUMENT and err.field == "top_p"
    assert metrics.requests_cancelled == cancelled + 1  # the first, admitted before the second was refused


def test_a_full_queue_refuses_with_overloaded(door):
    scheduler = door.front_door.scheduler
    config = scheduler.context.config
    scheduler.context.config = dataclasses.replace(config, settings=dataclasses.replace(config.settings, max_queued=0))
    try:
        with pytest.raises(GenerationError) as err:
            door.run(door.front_door.submit(GenerationParams(prompt="hi", max_tokens=2)))
    finally:
        scheduler.context.config = config
    assert err.value.kind is ErrorKind.OVERLOADED and "router.max_queued" in err.value.message


def test_draining_refuses_new_requests_and_waits_for_those_in_flight(door):
    front_door = door.front_door

    async def scenario():
        generation = await front_door.submit(GenerationParams(prompt=PROMPTS[7], max_tokens=16), via="test")
        drain = asyncio.create_task(front_door.drain())
        await asyncio.sleep(0)
        with pytest.raises(GenerationError) as err:
            await front_door.submit(GenerationParams(prompt="hi", max_tokens=2))
        assert not drain.done()
        result = await generation.complete()  # the request in flight finishes
        await asyncio.wait_for(drain, 30)
        return err.value, result

    try:
        err, result = door.run(scenario())
    finally:
        front_door.draining = False
    assert err.kind is ErrorKind.SHUTTING_DOWN
    assert result.finish_reason and result.usage.completion_tokens >= 1


# --- the adapters --------------------------------------------------------------------------------------------------

FORBIDDEN = {
    # The core and the HTTP API know nothing of gRPC or protobuf, nor of each other's adapters.
    "router/api.py": ("grpc", "google.protobuf", "specfleet.v1", "router.grpc_api", "router.openai", "router.server", "fastapi", "pydantic"),
    "router/frontdoor.py": ("grpc", "google.protobuf", "specfleet.v1", "router.grpc_api", "router.openai", "router.server", "fastapi", "pydantic"),
    "router/openai_api.py": ("grpc", "google.protobuf", "specfleet.v1", "router.grpc_api", "router.server"),
    "router/openai_schema.py": ("grpc", "google.protobuf", "specfleet.v1", "router.grpc_api", "router.server"),
    "router/openai_errors.py": ("grpc", "google.protobuf", "specfleet.v1", "router.grpc_api", "router.server"),
    "router/openai_guides.py": ("grpc", "google.protobuf", "specfleet.v1", "router.grpc_api", "router.server"),
    "router/openai_tools.py": ("grpc", "google.protobuf", "specfleet.v1", "router.grpc_api", "router.server", "fastapi", "pydantic"),
    "router/grpc_api.py": ("router.openai", "fastapi", "pydantic", "router.server"),
}


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize("path", sorted(FORBIDDEN))
def test_protobuf_and_grpc_stay_at_the_grpc_edge(path):
    imported = _imports(REPO / path)
    bad = sorted(name for name in imported for prefix in FORBIDDEN[path] if name == prefix or name.startswith(prefix))
    assert not bad, f"{path} imports {bad}"


def test_the_router_serves_grpc_without_the_http_api_s_packages():
    """router.server imports fastapi, uvicorn and pydantic only when the HTTP API is on: unset, a warning and gRPC
    alone; set, a start-up error naming what is missing."""
    script = """
import asyncio, importlib.abc, logging, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("fastapi", "uvicorn", "pydantic", "starlette"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
from router import frontdoor, grpc_api, server
from specfleet import config
cfg = config.Config()
cfg.router.http_port = None
assert asyncio.run(server.start_http(cfg, "127.0.0.1", None, "", None)) is None
cfg.router.http_port = 8123
try:
    asyncio.run(server.start_http(cfg, "127.0.0.1", None, "", None))
except server.StartupError as err:
    print("refused:", err)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert result.returncode == 0, result.stderr
    missing = "(fastapi|uvicorn|pydantic|starlette)"
    assert re.search(f"HTTP API off: it needs {missing}", result.stdout), result.stdout
    assert re.search(f"refused: router.http_port: the HTTP API needs {missing}, which is not installed", result.stdout), result.stdout


def test_the_http_api_reports_speculation_as_the_grpc_api_s_json():
    """The OpenAI responses' `speculation` is the gRPC SpeculationStats in protobuf's JSON form (zero fields left out)."""
    from google.protobuf import json_format

    from router.grpc_api import speculation_proto
    from router.openai_schema import speculation_json

    cases = [
        SpeculationStats(),
        SpeculationStats(
            rounds=3,
            draft_tokens=8,
            accepted_tokens=5,
            drafters=[DrafterStats("a", 2, 8, 5), DrafterStats("b")],
            domain="code",
            draft_wall_ms=12.345678,
            draft_compute_ms=0.1,
            verify_wall_ms=1e-9,
            verify_compute_ms=3.0,
            draft_queue_ms=0.25,
            verify_queue_ms=7e-5,
            router_ms=1.5,
        ),
    ]
    for stats in cases:
        assert speculation_json(stats) == json_format.MessageToDict(speculation_proto(stats), preserving_proto_field_name=True)


def test_each_error_kind_has_its_grpc_status_and_http_status():
    import grpc

    from router.grpc_api import STATUS
    from router.openai_schema import ApiError

    assert set(STATUS) == set(ErrorKind)
    expected = {
        ErrorKind.INVALID_ARGUMENT: (grpc.StatusCode.INVALID_ARGUMENT, 400, None),
        ErrorKind.OVERLOADED: (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "queue_full"),
        ErrorKind.SHUTTING_DOWN: (grpc.StatusCode.UNAVAILABLE, 503, "shutting_down"),
        ErrorKind.UNAVAILABLE: (grpc.StatusCode.UNAVAILABLE, 503, "unavailable"),
        ErrorKind.DEADLINE_EXCEEDED: (grpc.StatusCode.DEADLINE_EXCEEDED, 504, "deadline_exceeded"),
        ErrorKind.INTERNAL: (grpc.StatusCode.INTERNAL, 500, "internal"),
    }
    for kind, (status, http, code) in expected.items():
        api = ApiError.of(GenerationError(kind, "why", "speculation.max_draft_tokens" if kind is ErrorKind.INVALID_ARGUMENT else None))
        assert (STATUS[kind], api.status, api.code) == (status, http, code), kind
    assert ApiError.of(GenerationError(ErrorKind.INVALID_ARGUMENT, "x", "speculation.max_draft_tokens")).param == "speculation"
