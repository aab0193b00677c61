"""The bundled demo models served end to end: lossless with expertise routing and fusion on, for every domain."""

from __future__ import annotations

import json

import pytest

from router.domains import DomainClassifier
from tools.bench.workload import DOMAINS
from specfleet.config import DEMO_MODELS, RoutingConfig
from specfleet.v1 import generation_pb2, generation_pb2_grpc
from tests.harness import Cluster, free_port
from tests.helpers import greedy_request, target_greedy

WORKLOADS = DEMO_MODELS.parent.parent / "tools" / "bench" / "workloads"
MAX_TOKENS = 32
# What the router's exemplar classifier reads: every specialist's exemplars, under its speciality.
EXEMPLARS = {
    d.name: [json.loads(line)["text"] for line in (d / "exemplars.jsonl").read_text().splitlines() if line.strip()]
    for d in (DEMO_MODELS / "drafters").iterdir()
    if (d / "exemplars.jsonl").exists() and d.name != "general"
}


def prompts(domain: str, n: int, offset: int = 0, chars: int = 300) -> list[str]:
    lines = (WORKLOADS / f"{domain}.jsonl").read_text().splitlines()
    return [json.loads(line)["text"][-chars:] for line in lines[offset : offset + n]]


def demo_config(**router) -> dict:
    drafters = sorted(d for d in (DEMO_MODELS / "drafters").iterdir() if (d / "config.json").exists())
    models = []
    for d in drafters:
        model = {"name": d.name, "path": str(d), "specialities": [] if d.name == "general" else [d.name]}
        if (d / "exemplars.jsonl").exists():
            model["exemplars_file"] = str(d / "exemplars.jsonl")
        models.append(model)
    return {
        "verifier": {"model": str(DEMO_MODELS / "target"), "address": f"127.0.0.1:{free_port()}"},
        "drafters": [{"name": "demo", "address": f"127.0.0.1:{free_port()}", "models": models}],
        # Never falling back to plain decoding: see tests/harness.py's cluster_config.
        "router": {"port": free_port(), "default_drafter": "general", "remeasure_every": 0, **router},
    }


@pytest.fixture(scope="module")
def demo_cluster(tmp_path_factory):
    # k as asked every round (no adaptive speculation), so that a request drafts in any round it has a drafter for.
    config = demo_config(fusion_width=2, fusion_below=0.9, adaptive_speculation=False)
    # Every prompt verified and drafted for in the round it arrives (no chunked prefill, which holds a request back
    # while 28 prompts of one test arrive at once), so that a request's first round is the one that scores its
    # prompt, as the scoring test counts on; tests/e2e/test_call_limits.py covers chunked prefill.
    config["verifier"]["max_prefill_tokens"] = 0
    config["drafters"][0]["max_prefill_tokens"] = 0
    cluster = Cluster(config, tmp_path_factory.mktemp("demo"), "demo").start(timeout_s=300)
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("domain", DOMAINS)
def test_greedy_with_routing_and_fusion_equals_target(demo_cluster, domain):
    target = str(DEMO_MODELS / "target")
    with demo_cluster.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        texts = prompts(domain, 3)
        futures = [stub.Generate.future(greedy_request(p, MAX_TOKENS, 4), timeout=300) for p in texts]
        accepted = 0
        for prompt, future in zip(texts, futures):
            reply = future.result()
            assert list(reply.token_ids) == target_greedy(target, prompt, MAX_TOKENS)
            accepted += reply.speculation.accepted_tokens
    # drafts were used: per domain, not per request, since one request may spend all its rounds on a
    # continuation no drafter predicts (the target repeating a markup line) while routing explores
    assert accepted > 0


def test_the_exemplars_or_the_specialists_scoring_the_prompt_find_its_domain(demo_cluster):
    """The default domain prior: a prompt the exemplars place clearly (router.exemplar_margin) takes their label and
    drafts in its first round; each specialist scores any other, in the request's first round, which decodes it
    plainly (no drafter is chosen before the domain is known), and the best one's speciality is the domain. Two
    tokens leave room to draft in the first round only."""
    classifier = DomainClassifier(EXEMPLARS)
    with demo_cluster.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        margin = RoutingConfig().exemplar_margin  # the cluster's: the default
        cases = [(domain, text, classifier.sure(text, margin)) for domain in DOMAINS for text in prompts(domain, 4, offset=3)]
        futures = [stub.Generate.future(greedy_request(text, 2, 1), timeout=300) for _, text, _ in cases]
        replies = [future.result() for future in futures]
    placed = [(case, reply) for case, reply in zip(cases, replies) if case[2]]
    scored = [(case, reply) for case, reply in zip(cases, replies) if not case[2]]
    assert len(placed) >= 8 and len(scored) >= 8, [case[2] for case in cases]
    outcome = [(sure, r.speculation.domain, r.speculation.draft_tokens) for (_, _, sure), r in placed]
    assert all(domain == sure and drafted >= 1 for sure, domain, drafted in outcome), outcome  # two drafters with fusion
    # Scoring is drafting time that drafts nothing.
    assert all(r.speculation.draft_tokens == 0 and r.speculation.draft_wall_ms > 0 for _, r in scored), [
        (r.speculation.draft_tokens, r.speculation.draft_wall_ms) for _, r in scored
    ]
    guessed = [(domain, reply.speculation.domain) for (domain, _, _), reply in zip(cases, replies)]
    assert sum(1 for domain, guess in guessed if guess == domain) >= 0.8 * len(cases), guessed


def test_a_request_that_never_drafts_is_not_scored(demo_cluster):
    """Speculation off: no drafter will draft for the request, so no specialist prefills and scores its prompt (the
    drafters spend nothing on it) and its output is the target's, also in rounds it shares with requests that draft
    (a round of requests that never draft is not routed at all)."""
    target = str(DEMO_MODELS / "target")
    text = prompts("de", 1)[0]
    request = generation_pb2.GenerateRequest(prompt=text, max_tokens=8, temperature=0.0, speculation=generation_pb2.SpeculationOptions(disabled=True))
    with demo_cluster.channel() as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        # Three requests that draft, streaming, so that every lane holds one while the request that never drafts runs.
        streams = [stub.GenerateStream(greedy_request(p, 128, 4, stop_at_eos=False), timeout=300) for p in prompts("code", 3)]
        for stream in streams:
            next(stream)
        replies = [stub.Generate(request, timeout=300) for _ in range(2)]
        for stream in streams:
            list(stream)
    for reply in replies:
        assert list(reply.token_ids) == target_greedy(target, text, 8)
        spec = reply.speculation
        assert spec.draft_tokens == 0 and spec.draft_wall_ms == 0 and spec.domain == "", spec
