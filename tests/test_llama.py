"""specfleet's own forward pass against transformers' on the same weights.

Ragged batches, cached prefixes, chains and trees, grouped-query attention and
QKV bias (Qwen2): every logit our pass gives must be the one the reference
gives for that token's own path through the tree.
"""

from __future__ import annotations

import pytest
import torch

from specfleet import runtime
from specfleet.runtime import ForwardItem, Session, forward_batch, load_model, prefill


def _save(tmp_path, config, name):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(tmp_path / name)
    # The tokenizer only has to load; reuse the demo one.
    from specfleet.runtime import load_tokenizer

    load_tokenizer("models/demo/tokenizer").save_pretrained(tmp_path / name)
    return model


def _configs():
    from transformers import LlamaConfig, Qwen2Config

    common = dict(vocab_size=8192, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128)
    return {
        "llama-gqa": LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common),
        "qwen2-bias": Qwen2Config(num_attention_heads=4, num_key_value_heads=4, **common),
    }


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias"])
def test_forward_matches_transformers(tmp_path, name):
    reference = _save(tmp_path, _configs()[name], name)
    loaded = load_model(name, tmp_path / name)
    gen = torch.Generator().manual_seed(1)
    prompt_a = torch.randint(0, 8192, (9,), generator=gen).tolist()
    prompt_b = torch.randint(0, 8192, (4,), generator=gen).tolist()

    # Session a: a chain of 3 after its prompt; session b: a tree after its prompt.
    #   b's root r, nodes 0 -> 1 and 0 -> 2 (siblings), 3 a second child of the root.
    a, b = Session(token_ids=list(prompt_a)), Session(token_ids=list(prompt_b))
    prefill(loaded, [a, b], keep_last=1)
    chain = [11, 12, 13]
    tree_tokens, tree_parents = [21, 22, 23, 24], [-1, 0, 0, -1]
    attend = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 0, 0, 1]], dtype=torch.bool
    )
    root_a, root_b = len(prompt_a) - 1, len(prompt_b) - 1
    logits = forward_batch(
        loaded,
        [
            ForwardItem(a, [prompt_a[-1], *chain], list(range(root_a, root_a + 4))),
            ForwardItem(b, [prompt_b[-1], *tree_tokens], [root_b, root_b + 1, root_b + 2, root_b + 2, root_b + 1], attend),
        ],
    )

    def ref_logits(ids):
        with torch.no_grad():
            return reference(torch.tensor([ids])).logits[0, -1]

    for i in range(4):
        torch.testing.assert_close(logits[0, i], ref_logits(prompt_a + chain[:i]), atol=2e-4, rtol=1e-4)
    paths = {0: [], 1: [21], 2: [21, 22], 3: [21, 23], 4: [24]}
    for row, path in paths.items():
        torch.testing.assert_close(logits[1, row], ref_logits(prompt_b + path), atol=2e-4, rtol=1e-4)

    # Keep b's accepted path root -> 0 -> 2 and continue from it: the cache must hold exactly that path.
    b.commit([0, 1, 3])
    b.token_ids += [21, 23]
    next_logits = forward_batch(loaded, [ForwardItem(b, [31], [len(b.token_ids)])])
    torch.testing.assert_close(next_logits[0, 0], ref_logits(prompt_b + [21, 23, 31]), atol=2e-4, rtol=1e-4)


def test_prefill_passes_group_similar_lengths_and_match_transformers(tmp_path, monkeypatch):
    """Sessions of similar lengths share one prefill pass; each one's cache and scores are what its
    own full-context forward gives, and a very different length gets a pass of its own."""
    reference = _save(tmp_path, _configs()["llama-gqa"], "llama-gqa")
    loaded = load_model("llama-gqa", tmp_path / "llama-gqa")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 8192, (n,), generator=gen).tolist() for n in (11, 12, 13, 13, 40)]
    sessions = [Session(token_ids=list(p)) for p in prompts]
    passes = []
    monkeypatch.setattr(runtime, "forward_batch", lambda lm, items, **kw: passes.append(len(items)) or forward_batch(lm, items, **kw))
    scores = prefill(loaded, sessions, keep_last=1, score=True)
    monkeypatch.undo()
    assert sorted(passes) == [1, 4]
    step = forward_batch(loaded, [ForwardItem(s, [s.token_ids[-1]], [len(s.token_ids) - 1]) for s in sessions])
    for b, prompt in enumerate(prompts):
        with torch.inference_mode():
            ref = reference(torch.tensor([prompt])).logits[0].float()
        assert torch.allclose(step[b, 0], ref[-1], atol=1e-4)
        ref_score = ref[:-1].log_softmax(-1).gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).sum()
        assert scores[b][1] == len(prompt) - 1 and abs(scores[b][0] - float(ref_score)) < 1e-3


def test_unsupported_architecture_is_refused_by_name(tmp_path):
    from transformers import GPT2Config

    _save(tmp_path, GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=8192), "gpt2")
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        load_model("gpt2", tmp_path / "gpt2")
