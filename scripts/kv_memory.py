"""KV memory of 64 sessions of mixed lengths: what the paged pool holds against what their tokens need
and what fixed slots of the model's context took (issue 28's measurement, at the engine).

    PYTHONPATH=. .venv/bin/python scripts/kv_memory.py [--sessions 64] [--seed 0]

Two models: the demo target (512 positions) and a small random Llama whose config allows 16,384
positions (2 layers, 2 KV heads of 32, float32, the issue's). Every session is prefilled through
`runner.prefill`, then decodes 8 steps in batched passes (growing block by block), and then rolls back
3 tokens (a rejected draft). Prints one JSON object per model.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import tempfile

import torch

from specfleet.engine import ForwardItem, Session, forward_batch, load_model, prefill

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "demo"
OLD_SLOT_CAP = 8192  # positions of a slot before the paged pool: the model's context, at most this


def long_model(directory: pathlib.Path, layers: int = 2, hidden: int = 128) -> pathlib.Path:
    """A random Llama allowing 16,384 positions (heads of 32 or wider, half as many KV heads), with the demo tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=12288, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).eval().save_pretrained(directory)
    shutil.copytree(DEMO / "tokenizer", directory, dirs_exist_ok=True)
    return directory


def measure(path: pathlib.Path, sessions: int, longest: int, seed: int) -> dict:
    loaded = load_model("m", path)
    model, pool = loaded.model, loaded.pool
    per_position = model.num_layers * 2 * model.kv_heads * model.head_dim * pool.kv.element_size()
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, longest, (sessions,), generator=gen).tolist()
    held = [Session(token_ids=torch.randint(1, loaded.vocab_size, (n,), generator=gen).tolist()) for n in lengths]
    prefill(loaded, held, keep_last=1)
    for _ in range(8):
        logits = forward_batch(loaded, [ForwardItem(s, [s.token_ids[-1]], [len(s.token_ids) - 1]) for s in held])
        for b, s in enumerate(held):
            s.commit([0])
            s.token_ids.append(int(logits[b, 0].argmax()))
    for s in held:
        s.truncate(len(s.token_ids) - 3)
    positions = sum(s.kv_len for s in held)
    rounded = sum(-(-s.kv_len // pool.block_size) * pool.block_size for s in held)
    held_bytes = sum(s.kv_bytes() for s in held)
    slots = sessions * min(loaded.max_context, OLD_SLOT_CAP) * per_position
    return {
        "model": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else "random Llama, 16,384 positions",
        "context": loaded.max_context,
        "sessions": sessions,
        "lengths": [min(lengths), max(lengths)],
        "positions_cached": positions,
        "needed_mb": round(positions * per_position / 2**20, 2),
        "held_mb": round(held_bytes / 2**20, 2),
        "held_over_needed": round(held_bytes / (positions * per_position), 3),
        "held_over_block_rounding": round(held_bytes / (rounded * per_position), 3),
        "pool_allocated_mb": round(pool.kv.numel() * pool.kv.element_size() / 2**20, 2),
        "fixed_slots_mb": round(slots / 2**20, 2),
        "fixed_slots_over_needed": round(slots / (positions * per_position), 1),
        "relocations": pool.relocations,
        "scattered_sessions": sum(not isinstance(s.place(), int) for s in held),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(json.dumps(measure(DEMO / "target", args.sessions, 400, args.seed)))
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(measure(long_model(pathlib.Path(tmp) / "long"), args.sessions, 4000, args.seed)))


if __name__ == "__main__":
    main()
