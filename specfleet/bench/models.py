"""The random model family the harness uses when the demo models are not built.

Like `specfleet.random_models` (same tokenizer, same construction: a target, an
exact copy, a perturbed copy and an unrelated small drafter), but with 32-wide
attention heads: vLLM's CPU attention supports head sizes 32, 64, 80, ... and
refuses the 16-wide heads of the test family ("Unsupported CPU attention
configuration: head_dim=16"). Numbers measured on it say nothing about speed.
"""

from __future__ import annotations

import pathlib

FAMILY = ("target", "drafter-copy", "drafter-noisy", "drafter-random")


def ensure_bench_random_family(root: str | pathlib.Path, seed: int = 0) -> dict[str, pathlib.Path]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specfleet.random_models import _save, _train_tokenizer

    root = pathlib.Path(root)
    paths = {name: root / name for name in FAMILY}
    if all((p / "config.json").exists() for p in paths.values()):
        return paths
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(root / "tokenizer", vocab_size=384)

    def config(layers: int, hidden: int, heads: int, kv_heads: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=hidden // heads,
            max_position_embeddings=1024,
            initializer_range=0.3,  # peaked logits: clear greedy winners rather than near-ties
            tie_word_embeddings=True,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )

    torch.manual_seed(seed)
    target = LlamaForCausalLM(config(layers=2, hidden=64, heads=2, kv_heads=1)).eval()
    _save(target, tokenizer, paths["target"])
    _save(target, tokenizer, paths["drafter-copy"])
    noisy = LlamaForCausalLM(config(layers=2, hidden=64, heads=2, kv_heads=1)).eval()
    noisy.load_state_dict(target.state_dict())
    with torch.no_grad():
        for param in noisy.parameters():
            param.add_(torch.randn_like(param) * param.std() * 0.02)
    _save(noisy, tokenizer, paths["drafter-noisy"])
    torch.manual_seed(seed + 1)
    _save(LlamaForCausalLM(config(layers=1, hidden=32, heads=1, kv_heads=1)).eval(), tokenizer, paths["drafter-random"])
    return paths
