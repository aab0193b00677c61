"""Small randomly initialised models, so `specfleet serve` runs even without the bundled demo models.

`ensure_random_family(dir)` writes a byte-level BPE tokenizer, a target and
drafters that share it. They are useful for exercising the system and for
tests, not for speed: a random drafter's proposals are rarely accepted, so
the family also holds drafters derived from the target (an exact copy and a
perturbed copy) whose acceptance is high or partial by construction.
"""

from __future__ import annotations

import pathlib

import torch

# Text to train the tiny tokenizer on: enough to cover bytes and common English merges.
_TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "def main(argv):\n    return 0\n\nif __name__ == '__main__':\n    main(None)\n",
    "name: specfleet\nversion: 1\nitems:\n  - drafter\n  - verifier\n",
    "Speculative decoding lets a small model propose tokens that a large model verifies in one pass.",
    "".join(chr(c) for c in range(32, 127)),
]

FAMILY = ("target", "drafter-copy", "drafter-noisy", "drafter-random")


def _train_tokenizer(out: pathlib.Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TOKENIZER_TEXT, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(str(out))
    return fast


def _save(model, tokenizer, out: pathlib.Path) -> None:
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


def ensure_random_family(root: str | pathlib.Path, seed: int = 0, head_dim: int = 16) -> dict[str, pathlib.Path]:
    """Create (once) and return the paths of a random target and three drafters.

    head_dim: width of every attention head (each model has hidden / head_dim query heads and
    half as many key/value heads). The benchmark harness asks for 32: vLLM's CPU attention
    refuses 16-wide heads.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    root = pathlib.Path(root)
    paths = {name: root / name for name in FAMILY}
    if all((p / "config.json").exists() for p in paths.values()):
        return paths
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(root / "tokenizer", vocab_size=384)
    vocab = len(tokenizer)

    def config(layers: int, hidden: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=hidden * 2,
            num_hidden_layers=layers,
            num_attention_heads=hidden // head_dim,
            num_key_value_heads=max(1, hidden // head_dim // 2),
            head_dim=head_dim,
            max_position_embeddings=1024,
            # Peaked logits, so that greedy decoding has clear winners rather than near-ties.
            initializer_range=0.3,
            tie_word_embeddings=True,
            eos_token_id=tokenizer.eos_token_id,
            bos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.eos_token_id,
        )

    torch.manual_seed(seed)
    target = LlamaForCausalLM(config(layers=2, hidden=64)).eval()
    _save(target, tokenizer, paths["target"])
    _save(target, tokenizer, paths["drafter-copy"])
    noisy = LlamaForCausalLM(config(layers=2, hidden=64)).eval()
    noisy.load_state_dict(target.state_dict())
    with torch.no_grad():
        for param in noisy.parameters():
            param.add_(torch.randn_like(param) * param.std() * 0.02)
    _save(noisy, tokenizer, paths["drafter-noisy"])
    torch.manual_seed(seed + 1)
    _save(LlamaForCausalLM(config(layers=1, hidden=32)).eval(), tokenizer, paths["drafter-random"])
    return paths
