"""The verifier in the router's process (specfleet/colocated.py): the router's transport over the verifier's core
answers as the gRPC service would, refusals included. `specfleet serve` runs this way by default, so the end-to-end
tests run through it (tests/e2e/test_lossless.py, test_openai_api.py, ...); tests/specfleet/test_cli.py: which
processes `serve` starts."""

from __future__ import annotations

import asyncio

import pytest

from router import messages
from router.transport import InProcessDrafter, InProcessVerifier, TransportError
from specfleet import config as config_mod
from specfleet.colocated import RecordDrafter, RecordVerifier
from specfleet.sampling import SamplingParams
from tests.helpers import load_target, target_greedy
from verifier_service.server import load_core

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def verifier(random_family):
    core = load_core(config_mod.VerifierConfig(model=str(random_family["target"])), threads=1)
    yield InProcessVerifier(RecordVerifier(core), "127.0.0.1:50061")
    core.close()


def _session(session_id: str, prefix_length: int, new_token_ids: list[int]) -> messages.VerifySession:
    return messages.VerifySession(
        sync=messages.SessionSync(session_id, prefix_length, new_token_ids), tree=messages.TokenTree([], [], []), sampling=SamplingParams()
    )


def test_the_core_in_process_verifies_as_the_target_decodes(verifier, random_family):
    path = str(random_family["target"])
    prompt = load_target(path)[1].encode(PROMPT, add_special_tokens=False)
    expected = target_greedy(path, PROMPT, 3)

    async def decode() -> list[int]:
        out, new = [], prompt
        for _ in range(3):
            reply = await verifier.verify([_session("in-process", len(prompt) + len(out) - len(new), new)], timeout_s=30)
            new = reply.sessions[0].token_ids
            out += new
        await verifier.release(["in-process"])
        return out

    assert asyncio.run(decode()) == expected
    assert asyncio.run(verifier.info(timeout_s=5)).path == path
    assert verifier.address == "127.0.0.1:50061" and verifier.in_process


def test_a_request_the_core_refuses_is_a_refusal_not_a_dead_replica(verifier):
    """The scheduler answers a refused call INTERNAL (a router bug) and a failed one by moving the request to another
    replica: the in-process transport must tell them apart as gRPC's status codes do."""
    with pytest.raises(TransportError) as err:
        asyncio.run(verifier.verify([_session("", 0, [1, 2])], timeout_s=30))
    assert err.value.invalid_argument and "INVALID_ARGUMENT: sync.session_id is required" in str(err.value)


def test_the_core_in_process_keeps_the_verifiers_call_limits(random_family):
    """A call over verifier.max_call_sessions is refused in process as over gRPC, before any pass."""
    core = load_core(config_mod.VerifierConfig(model=str(random_family["target"]), max_call_sessions=1), threads=1)
    try:
        verifier = InProcessVerifier(RecordVerifier(core), "127.0.0.1:50062")
        with pytest.raises(TransportError) as err:
            asyncio.run(verifier.verify([_session("a", 0, [1, 2]), _session("b", 0, [3])], timeout_s=30))
        assert err.value.invalid_argument and "2 sessions" in str(err.value)
    finally:
        core.close()


def test_the_record_path_carries_every_field_both_ways():
    """Each field of the router's VerifySession reaches the verifier's item, and each of its result the router's
    VerifiedSession: a field added to either side and forgotten here would be dropped without a word."""
    import dataclasses

    from specfleet.batching import BatchStats
    from specfleet.engine.prompt_logprobs import PromptLogprobs
    from verifier_service.verifier import VerifyItem, VerifyResult

    class Core:  # the core's record methods, recording what reaches its batch queue
        def check_size(self, sessions, tokens):
            self.size = (sessions, tokens)

        def validated(self, items):
            return items

        async def verify_items(self, items):
            self.items = items
            prompt = PromptLogprobs(1, [-2.0], [3], [1], [-0.25])
            result = VerifyResult(
                "s", True, False, [0], [7, 8], [-0.5, -0.25], [7, 3], [-0.5, -1.5], prompt, lookup_proposed=3, lookup_accepted=2, cached_tokens=16
            )
            return [result], BatchStats(compute_ms=3.0, batch_size=4, queue_ms=0.5, passes=2, shared_ms=1.25)

    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=123, drafter_invariant=True)
    proposal = type("Proposal", (), {"token_ids": [7, 9], "probs": [0.75, 0.25]})()
    session = messages.VerifySession(
        sync=messages.SessionSync("s", 3, [1, 2], "tenant"),
        tree=messages.TokenTree([7], [-1], [proposal]),
        sampling=sampling,
        logprobs=True,
        top_logprobs=1,
        prompt_logprobs=True,
        prompt_top_logprobs=4,
        plain_steps=2,  # with a tree the verifier refuses it (`validated`); this core only records what reaches it
        lookup_tokens=3,
        max_tokens=7,
    )
    core = Core()
    reply = asyncio.run(RecordVerifier(core).call([session]))
    (item,) = core.items
    assert core.size == (1, 3 + 2 + 1)
    own = {"lookup_confidences", "forced"}  # set by the verifier on its own chains (lookup, forced text), never by a caller
    assert all(getattr(item, f.name) != VerifyItem.__dataclass_fields__[f.name].default for f in dataclasses.fields(VerifyItem) if f.name not in own)
    assert item == VerifyItem("s", 3, [1, 2], sampling, [7], [-1], [([7, 9], [0.75, 0.25])], True, 1, 4, 2, 3, 7, "tenant")
    (verified,) = reply.sessions
    prompt = messages.PromptLogprobs([-2.0], [3], [1], [-0.25])
    assert verified == messages.VerifiedSession(True, False, [0], [7, 8], [-0.5, -0.25], [7, 3], [-0.5, -1.5], 3, 2, prompt, 16)
    assert (reply.compute_ms, reply.batch_size, reply.queue_ms, reply.passes, reply.shared_ms) == (3.0, 4, 0.5, 2, 1.25)


# --- a drafter service in the router's process ------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafter_core(random_family):
    from drafter_service.server import load_core as load_drafter

    svc = config_mod.DrafterServiceConfig(name="d", models=[config_mod.DraftModelConfig(name="m", path=str(random_family["drafter-noisy"]))])
    core = load_drafter(svc, threads=1)
    yield core
    core.close()


def _draft(session_id: str, tokens: list[int], model: str = "m") -> messages.DraftSession:
    return messages.DraftSession(sync=messages.SessionSync(session_id, 0, tokens), model=model, num_draft_tokens=4, sampling=SamplingParams())


def test_the_drafter_in_process_drafts_what_it_drafts_over_its_messages(drafter_core):
    """The same draft, proposals and confidences through the records as through the contract's messages."""
    from router import transport

    prompt = [5, 9, 17, 33, 2, 8]
    drafter = InProcessDrafter("d", RecordDrafter(drafter_core), "127.0.0.1:50063")
    by_record = asyncio.run(drafter.draft([_draft("by-record", prompt)], timeout_s=30)).sessions[0]
    by_message = transport.draft_response(asyncio.run(drafter_core.draft(transport.draft_request([_draft("by-message", prompt)])))).sessions[0]
    assert by_record.known and len(by_record.token_ids) == 4
    assert (by_record.token_ids, by_record.confidences) == (by_message.token_ids, by_message.confidences)
    assert [(list(p.token_ids), list(p.probs)) for p in by_record.proposals] == [(list(p.token_ids), list(p.probs)) for p in by_message.proposals]
    assert drafter.name == "d" and drafter.in_process and asyncio.run(drafter.info(timeout_s=5)).models[0].name == "m"


def test_a_draft_the_core_refuses_is_a_refusal(drafter_core):
    drafter = InProcessDrafter("d", RecordDrafter(drafter_core), "127.0.0.1:50063")
    with pytest.raises(TransportError) as err:
        asyncio.run(drafter.draft([_draft("s", [1, 2], model="absent")], timeout_s=30))
    assert err.value.invalid_argument and "unknown draft model 'absent'" in str(err.value)


def test_the_drafter_record_path_carries_every_field_both_ways():
    import dataclasses

    from drafter_service.drafter import DraftItem, DraftResult
    from specfleet.batching import BatchStats

    class Core:  # the core's record methods, recording what reaches its batch queue
        def check_size(self, sessions, tokens):
            self.size = (sessions, tokens)

        def validated(self, items):
            return items

        async def draft_items(self, items):
            self.items = items
            return [DraftResult("s", True, [7, 8], [([7, 9], [0.75, 0.25]), ([8], [1.0])], [0.75, 1.0], -1.5, 3)], BatchStats(2.0, 1, 0.25)

    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=123, drafter_invariant=True)
    session = messages.DraftSession(messages.SessionSync("s", 3, [1, 2], "tenant"), "m", 2, sampling, 0.25, True, "g")
    core = Core()
    reply = asyncio.run(RecordDrafter(core).call([session]))
    ((model, item),) = core.items
    assert core.size == (1, 3 + 2 + 2)
    assert model == "m" and item == DraftItem("s", 3, [1, 2], 2, sampling, 0.25, True, "g", "tenant")
    assert all(getattr(item, f.name) != f.default for f in dataclasses.fields(DraftItem) if f.default is not dataclasses.MISSING)
    (drafted,) = reply.sessions
    assert (drafted.known, drafted.token_ids, drafted.confidences) == (True, [7, 8], [0.75, 1.0])
    assert (drafted.context_log_prob, drafted.context_tokens) == (-1.5, 3)
    assert [(list(p.token_ids), list(p.probs)) for p in drafted.proposals] == [([7, 9], [0.75, 0.25]), ([8], [1.0])]
    assert (reply.compute_ms, reply.queue_ms) == (2.0, 0.25)
