"""The drafter's batched proposals on real models: the all-greedy fast path equals the general one,
a session's later calls draft what a fresh session would from the whole context, and draft
models stacked into one pass draft exactly what each drafts alone."""

from __future__ import annotations

import os

import pytest
import torch

from drafter_service.drafter import STEP_CATCH_UP, DraftItem, DraftModel, draft_batch, stack_draft_models
from drafter_service.server import load_core
from specfleet.config import DEMO_MODELS
from specfleet.config.fields import build
from specfleet.config.services import DrafterServiceConfig
from specfleet.engine import SessionStore, cpu_kernels, load_model
from specfleet.engine.cpu_linear import Bf16Weight, CpuWeight, StackedWeights, available
from specfleet.engine.stack import same_shape
from specfleet.sampling import SamplingParams

# SPECFLEET_TEST_DEVICE=cuda runs the stacking tests on a GPU (scripts/device-check sets it).
DEVICE = os.environ.get("SPECFLEET_TEST_DEVICE", "cpu")
TOLERANCE = 1e-5 if DEVICE == "cpu" else 1e-4

CONTEXTS = [[5, 17, 42, 9, 33], [7, 7, 7], [101, 3, 250, 8, 19, 44, 2], [60]]


@pytest.fixture(scope="module")
def drafter_path(random_family):
    return random_family["drafter-noisy"]


def draft(path, items):
    model = DraftModel(load_model("d", path, use_token_map=True), SessionStore(1 << 30, 100), proposal_top_k=8)
    return draft_batch({"d": model}, [("d", item) for item in items])


def test_greedy_fast_path_equals_the_general_path(drafter_path):
    greedy = [DraftItem(f"g{i}", 0, c, num_draft_tokens=4, sampling=SamplingParams()) for i, c in enumerate(CONTEXTS)]
    fast = draft(drafter_path, greedy)
    # One sampled session in the batch sends every session down the general path.
    sampled = DraftItem("s", 0, CONTEXTS[0], num_draft_tokens=4, sampling=SamplingParams(temperature=1.0, seed=1))
    general = draft(drafter_path, greedy + [sampled])[: len(greedy)]
    for a, b in zip(fast, general):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 4
        assert a.proposals == b.proposals == [([t], [1.0]) for t in a.token_ids]
        assert a.confidences == pytest.approx(b.confidences, abs=1e-6)
        assert all(0 < c <= 1 for c in a.confidences)


def test_later_calls_catch_up_and_draft_as_a_fresh_session_would(drafter_path):
    """The next call brings what was committed since: nothing, a few tokens (fed in the first
    draft step) or more than STEP_CATCH_UP (prefilled first), all in one batch."""
    model = DraftModel(load_model("d", drafter_path, use_token_map=True), SessionStore(1 << 30, 100), proposal_top_k=8)
    contexts = CONTEXTS + [[9, 8, 7, 6, 5, 4]]
    committed = [[], [11], [12, 13, 14], list(range(30, 30 + STEP_CATCH_UP)), list(range(50, 50 + STEP_CATCH_UP + 5))]
    greedy = SamplingParams()
    draft_batch({"d": model}, [("d", DraftItem(f"s{i}", 0, c, num_draft_tokens=4, sampling=greedy)) for i, c in enumerate(contexts)])
    # Keep each context, drop the previous drafts, add the committed tokens.
    later = draft_batch(
        {"d": model},
        [("d", DraftItem(f"s{i}", len(c), new, num_draft_tokens=4, sampling=greedy)) for i, (c, new) in enumerate(zip(contexts, committed))],
    )
    fresh = draft(
        drafter_path, [DraftItem(f"f{i}", 0, c + new, num_draft_tokens=4, sampling=greedy) for i, (c, new) in enumerate(zip(contexts, committed))]
    )
    for a, b in zip(later, fresh):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 4
        assert a.confidences == pytest.approx(b.confidences, abs=1e-5)


def stacked_and_alone(paths: dict[str, object], items: list[tuple[str, DraftItem]], calls: int = 3, prepare: bool = False):
    """Draft `items` for `calls` rounds (each later round commits two of the previous drafts and
    drafts again) with the models stacked (with prepare, each stack prepared as a service prepares it) and
    with each model in its own passes; both results."""

    def load():
        return {
            name: DraftModel(
                load_model(name, path, use_token_map=True, device=DEVICE, linear="auto" if prepare else "plain"), SessionStore(1 << 30, 100), 8
            )
            for name, path in paths.items()
        }

    stacked, alone = load(), load()
    stacks = stack_draft_models(stacked)
    for stack in stacks if prepare else []:
        stack.prepare()
    runs = []
    for models in (stacked, alone):
        rounds, lengths = [], {}
        for call in range(calls):
            tagged = []
            for name, item in items:
                key = (name, item.session_id)
                if call == 0:
                    tagged.append((name, item))
                    lengths[key] = item.prefix_length + len(item.new_token_ids)
                else:
                    kept = rounds[-1][len(tagged)].token_ids[:2]
                    tagged.append(
                        (
                            name,
                            DraftItem(item.session_id, lengths[key], kept, item.num_draft_tokens, item.sampling, lockstep_group=item.lockstep_group),
                        )
                    )
                    lengths[key] += len(kept)
            rounds.append(draft_batch(models, tagged))
        runs.append(rounds)
    return stacks, runs[0], runs[1]


def assert_same_drafts(stacked_rounds, alone_rounds):
    for stacked, alone in zip(stacked_rounds, alone_rounds):
        for a, b in zip(stacked, alone):
            assert a.token_ids == b.token_ids and a.token_ids
            assert [ids for ids, _ in a.proposals] == [ids for ids, _ in b.proposals]
            for (_, pa), (_, pb) in zip(a.proposals, b.proposals):
                assert pa == pytest.approx(pb, abs=TOLERANCE)
            assert a.confidences == pytest.approx(b.confidences, abs=TOLERANCE)
            assert a.context_tokens == b.context_tokens
            assert a.context_log_prob == pytest.approx(b.context_log_prob, abs=TOLERANCE)


def test_stacked_models_draft_what_each_drafts_alone(random_family):
    """The random family's two same-shape drafters stack (the one-layer drafter stays alone); one call
    mixes all three models, greedy, sampled and drafter-invariant sessions, fresh prompts, catch-ups
    and a lockstep group, and every draft, proposal and confidence is what the model drafts alone."""
    paths = {name: random_family[name] for name in ("drafter-copy", "drafter-noisy", "drafter-random")}
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.8, top_k=20, seed=7)
    raced = SamplingParams(temperature=1.0, seed=3, drafter_invariant=True)
    long_prompt = list(range(40, 40 + 3 * STEP_CATCH_UP))
    items = [
        ("drafter-copy", DraftItem("a", 0, CONTEXTS[0], 4, greedy)),
        ("drafter-noisy", DraftItem("a", 0, CONTEXTS[0], 4, greedy)),
        ("drafter-noisy", DraftItem("b", 0, long_prompt, 3, sampled, score_context=True)),
        ("drafter-copy", DraftItem("b", 0, long_prompt, 2, greedy, score_context=True)),
        ("drafter-copy", DraftItem("c", 0, CONTEXTS[2], 4, raced)),
        ("drafter-random", DraftItem("c", 0, CONTEXTS[2], 4, sampled)),
        ("drafter-copy", DraftItem("d", 0, CONTEXTS[1], 4, greedy, lockstep_group="d")),
        ("drafter-noisy", DraftItem("d", 0, CONTEXTS[1], 4, greedy, lockstep_group="d")),
    ]
    stacks, stacked, alone = stacked_and_alone(paths, items)
    assert [[m.name for m in s.members] for s in stacks] == [["drafter-copy", "drafter-noisy"]]
    assert_same_drafts(stacked, alone)


def test_the_demo_drafters_stack_with_their_own_token_maps():
    """The bundled family's eight drafters form one stack; each keeps its own 2,048-id token map, so
    a row's proposals are its own model's vocabulary ids."""
    names = ["general", "en", "de", "fr", "es", "it", "code", "structured"]
    paths = {name: DEMO_MODELS / "drafters" / name for name in names}
    sampled = SamplingParams(temperature=1.0, seed=11)
    prompt = [200 + 37 * i % 9000 for i in range(30)]
    items = [
        (name, DraftItem(f"r{i % 3}", 0, prompt[i:], 4, sampled if i % 2 else SamplingParams(), score_context=i < 5)) for i, name in enumerate(names)
    ]
    stacks, stacked, alone = stacked_and_alone(paths, items)
    assert len(stacks) == 1 and len(stacks[0].members) == len(names)
    assert_same_drafts(stacked, alone)
    maps = {m.name: set(m.token_map.tolist()) for m in stacks[0].members}
    for (name, _), result in zip(items, stacked[0]):
        assert set(result.token_ids) <= maps[name]
        assert all(set(ids) <= maps[name] for ids, _ in result.proposals)


@pytest.mark.skipif(DEVICE != "cpu" or cpu_kernels.library() is None, reason="the bfloat16 kernel is a CPU's, built by a C++ compiler")
def test_a_stack_of_bfloat16_drafters_on_the_kernel_drafts_what_each_drafts_alone():
    """The demo drafters' checkpoints hold bfloat16 values: a prepared stack runs its passes of few rows on the
    bfloat16 kernel (csrc/bf16_linear.cpp), each member's rows through its own copy, and a member's own passes
    through its own too; every draft and proposal is what the model drafts alone on F.linear."""
    names = ["general", "en", "code", "structured"]
    paths = {name: DEMO_MODELS / "drafters" / name for name in names}
    prompt = [300 + 41 * i % 9000 for i in range(24)]
    items = [
        (name, DraftItem(f"r{i}", 0, prompt[i:], 4, SamplingParams(temperature=0.7, seed=5) if i % 2 else SamplingParams()))
        for i, name in enumerate(names)
    ]
    items.append(("code", DraftItem("solo", 0, prompt, 3, SamplingParams())))
    stacks, stacked, alone = stacked_and_alone(paths, items, prepare=True)
    [stack] = stacks
    assert isinstance(stack.model.lm_head, StackedWeights) and isinstance(stack.model.layers[0].gate_up, StackedWeights)
    assert all(isinstance(m.model.lm_head, Bf16Weight) and m.model.lm_head.rows > 0 for m in stack.members)
    assert_same_drafts(stacked, alone)
    # A call whose rows are one member's runs that member's own pass, on its own copies.
    solo, solo_alone = stacked_and_alone(paths, items[-1:], prepare=True)[1:]
    assert_same_drafts(solo, solo_alone)


def test_a_service_prepares_its_stacks_for_the_kernel():
    """`load_core` prepares each stack: the demo drafters' stack takes the bfloat16 kernel where it is built."""
    names = ("general", "code", "en")
    models = [{"name": n, "path": str(DEMO_MODELS / "drafters" / n)} for n in names]
    svc = build(DrafterServiceConfig, {"name": "d", "device": DEVICE, "models": models}, "drafters[0]")
    core = load_core(svc)
    try:
        kernel = DEVICE == "cpu" and cpu_kernels.library() is not None
        assert {name: isinstance(m.loaded.model.lm_head, Bf16Weight) for name, m in core.models.items()} == dict.fromkeys(names, kernel)
    finally:
        core.close()


def test_models_of_different_shapes_do_not_stack(random_family):
    copy = load_model("a", random_family["drafter-copy"])
    assert same_shape(copy, load_model("b", random_family["drafter-noisy"]))
    assert not same_shape(copy, load_model("c", random_family["drafter-random"]))
    assert not same_shape(copy, load_model("d", random_family["drafter-noisy"], use_token_map=False, attention="per-session"))


def test_stacking_keeps_tied_embeddings_one_tensor(random_family):
    """Without token maps the random family's output layer is its embedding: stacked, it stays one tensor."""
    models = {n: DraftModel(load_model(n, random_family[n]), SessionStore(1 << 30, 10), 8) for n in ("drafter-copy", "drafter-noisy")}
    [stack] = stack_draft_models(models)
    assert stack.model.lm_head is stack.model.embed
    for m in models.values():
        assert m.loaded.model.lm_head.data_ptr() == m.loaded.model.embed.data_ptr()


def test_a_service_lays_out_its_unstacked_models_for_the_cpu_and_leaves_a_stacks_members(random_family):
    """`linear: auto` (the default): a draft model that runs alone gets its weights laid out for the CPU's kernels
    (specfleet/engine/cpu_linear.py); a stack's members are views of the stack's weights and stay as they are."""
    names = ("drafter-copy", "drafter-noisy", "drafter-random")  # the first two have one shape and stack
    svc = build(DrafterServiceConfig, {"name": "d", "models": [{"name": n, "path": str(random_family[n])} for n in names]}, "drafters[0]")
    assert svc.linear == "auto"
    core = load_core(svc)
    try:
        laid_out = {name: isinstance(m.loaded.model.lm_head, CpuWeight) for name, m in core.models.items()}
        assert laid_out == {"drafter-copy": False, "drafter-noisy": False, "drafter-random": available(torch.float32)}
    finally:
        core.close()


def test_stacked_models_share_a_prefix_cache_only_within_each_model(random_family):
    """Prefix caching in a stack's one pool: a block is known by its model too (the store's namespace), so a
    prompt another member cached is computed again, one its own model cached is taken, and every draft and
    proposal is what the model drafts alone."""
    paths = {name: random_family[name] for name in ("drafter-copy", "drafter-noisy")}
    prompt = list(range(40, 88))  # 47 positions prefilled: two full blocks of 16
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=7)
    runs = {}
    for stacked in (True, False):
        models = {
            name: DraftModel(
                load_model(name, path, use_token_map=True, device=DEVICE, prefix_caching=True), SessionStore(1 << 30, 100, namespace=name.encode()), 8
            )
            for name, path in paths.items()
        }
        if stacked:
            stack_draft_models(models)
        first = draft_batch(models, [("drafter-copy", DraftItem("a", 0, prompt, 4, sampled))])
        second = draft_batch(
            models, [("drafter-noisy", DraftItem("b", 0, prompt, 4, sampled)), ("drafter-copy", DraftItem("c", 0, prompt, 4, sampled))]
        )
        runs[stacked] = (first + second, {name: m.loaded.pool for name, m in models.items()})
    pools = runs[True][1]
    assert pools["drafter-copy"] is pools["drafter-noisy"] and pools["drafter-copy"].prefix_caching
    assert pools["drafter-copy"].hits == 32, "c takes a's two blocks; b, another model, takes none"
    for stacked_result, alone_result in zip(runs[True][0], runs[False][0]):
        assert stacked_result.token_ids == alone_result.token_ids
        for (ids, probs), (alone_ids, alone_probs) in zip(stacked_result.proposals, alone_result.proposals):
            assert ids == alone_ids
            torch.testing.assert_close(torch.tensor(probs), torch.tensor(alone_probs), atol=TOLERANCE, rtol=0)


def test_a_salted_session_takes_only_its_own_salt_s_cached_blocks(random_family):
    """vLLM's cache_salt at a drafter: of four sessions of one prompt, the third (the first's salt) takes the first's
    two blocks and the fourth (unsalted) the second's; each drafts what the first drafts."""
    name = "drafter-copy"
    model = DraftModel(load_model(name, random_family[name], use_token_map=True, device=DEVICE, prefix_caching=True), SessionStore(1 << 30, 100), 8)
    prompt = list(range(40, 88))
    drafts, hits = [], []
    for sid, salt in [("a", "x"), ("b", ""), ("c", "x"), ("d", "")]:
        before = model.loaded.pool.hits
        (result,) = draft_batch({name: model}, [(name, DraftItem(sid, 0, prompt, 4, SamplingParams(), cache_salt=salt))])
        drafts.append(result.token_ids)
        hits.append(model.loaded.pool.hits - before)
    assert hits == [0, 0, 32, 32]
    assert all(d == drafts[0] for d in drafts)


def test_a_long_prompt_is_prefilled_in_chunks_beside_drafting_sessions(drafter_path):
    """max_prefill_tokens 64: a 300-token prompt drafts nothing while its prefill goes on, 64 positions a call, and
    its result says it is prefilling; the short sessions beside it draft every call, and once it is in it drafts what an unchunked session drafts."""
    model = DraftModel(load_model("d", drafter_path, use_token_map=True), SessionStore(1 << 30, 100), proposal_top_k=8)
    greedy = SamplingParams()
    prompt = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    calls, kv_lens = 0, []
    while True:
        items = [("d", DraftItem("long", 0 if calls == 0 else len(prompt), prompt if calls == 0 else [], num_draft_tokens=4, sampling=greedy))]
        items += [("d", DraftItem(f"short{calls}-{i}", 0, c, num_draft_tokens=4, sampling=greedy)) for i, c in enumerate(CONTEXTS)]
        long, *short = draft_batch({"d": model}, items, max_prefill_tokens=64)
        calls += 1
        assert all(len(r.token_ids) == 4 and not r.prefilling for r in short)  # never held up
        kv_lens.append(model.store.get("long").kv_len)
        # Said so, while it prefills: the router does not score a drafter for a call it had no context in.
        assert long.prefilling == (not long.token_ids)
        if long.token_ids:
            break
        assert calls < 10
    # Each call prefills what the budget leaves after the short sessions' catch-ups (none: they are fed in step 1).
    assert kv_lens[:-1] == [64 * (i + 1) for i in range(len(kv_lens) - 1)] and calls == 5
    assert long.token_ids == draft(drafter_path, [DraftItem("fresh", 0, prompt, num_draft_tokens=4, sampling=greedy)])[0].token_ids
