"""The verifier in the router's process (specfleet/colocated.py): the router's transport over the verifier's core
answers as the gRPC service would, refusals included. `specfleet serve` runs this way by default, so the end-to-end
tests run through it (tests/e2e/test_lossless.py, test_openai_api.py, ...); tests/specfleet/test_cli.py: which
processes `serve` starts."""

from __future__ import annotations

import asyncio

import pytest

from router import messages
from router.transport import InProcessVerifier, TransportError
from specfleet import config as config_mod
from specfleet.sampling import SamplingParams
from tests.helpers import load_target, target_greedy
from verifier_service.server import load_core

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def verifier(random_family):
    core = load_core(config_mod.VerifierConfig(model=str(random_family["target"])), threads=1)
    yield InProcessVerifier(core, "127.0.0.1:50061")
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
    assert verifier.address == "127.0.0.1:50061 (in process)"


def test_a_request_the_core_refuses_is_a_refusal_not_a_dead_replica(verifier):
    """The scheduler answers a refused call INTERNAL (a router bug) and a failed one by moving the request to another
    replica: the in-process transport must tell them apart as gRPC's status codes do."""
    with pytest.raises(TransportError) as err:
        asyncio.run(verifier.verify([_session("", 0, [1, 2])], timeout_s=30))
    assert err.value.invalid_argument and "INVALID_ARGUMENT: sync.session_id is required" in str(err.value)
