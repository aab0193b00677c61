"""A Hugging Face checkpoint read without transformers: config.json and safetensors files.

Importing transformers' model classes costs a service process about 3.6 s of CPU at start-up
(more than importing torch), and `llama.forward` needs only the tensors and a few config
fields. So a checkpoint whose config.json states every field the pass reads, and whose weights
are safetensors, is read here directly; anything else (a field left to a family's default,
pytorch_model.bin, sliding-window attention whose layer types transformers derives) returns
None, and `loading.load_model` reads it with transformers instead. Both give the same tensors.
"""

from __future__ import annotations

import json
import math
import pathlib
from types import SimpleNamespace
from typing import Callable

import torch

# Fields the pass and its checks read with no default of ours (`llama.from_weights`, `check_supported`,
# `context_limit`): left out of config.json, they take a family default that only transformers knows.
REQUIRED = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
)


def read_config(path: pathlib.Path) -> SimpleNamespace | None:
    """config.json as attributes, or None when the pass would need a default only transformers knows."""
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if any(key not in raw for key in REQUIRED):
        return None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if "rope_theta" not in raw and "rope_theta" not in rope:
        return None
    kind = raw["model_type"]
    if kind == "qwen3" and "head_dim" not in raw:
        return None  # Qwen3's default head_dim (128) is not hidden_size / heads
    if kind == "mistral" and "sliding_window" not in raw:
        return None  # Mistral's default window (4096) bounds the context
    if kind in ("qwen2", "qwen3") and raw.get("use_sliding_window") and "layer_types" not in raw:
        return None  # which layers slide is derived by transformers
    return SimpleNamespace(**raw)


def weight_files(path: pathlib.Path) -> list[pathlib.Path] | None:
    """The safetensors files holding the weights, or None when there are none."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    single = path / "model.safetensors"
    return [single] if single.exists() else None


def read_checkpoint(
    path: pathlib.Path, dtype: torch.dtype, device: torch.device, cut: Callable[[str], tuple[slice, ...] | None] | None = None
) -> tuple[SimpleNamespace, dict[str, torch.Tensor], int] | None:
    """(config, tensors by name in `dtype` on `device`, the checkpoint's parameter count), or None when
    transformers must read it. With `cut`, a tensor it gives a slice of is read as that slice alone (a
    tensor-parallel rank's share, `parallel.slicer`)."""
    config, files = read_config(path), weight_files(path)
    if config is None or files is None:
        return None
    from safetensors import safe_open

    weights, parameters = {}, 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                part = cut(name) if cut is not None else None
                stored = f.get_slice(name)
                weights[name] = (f.get_tensor(name) if part is None else stored[part]).to(device=device, dtype=dtype).contiguous()
                # Buffers some checkpoints store (rotary inv_freq) are not parameters; a tied output layer is the embedding.
                if name.endswith((".weight", ".bias")) and not (config.tie_word_embeddings and name == "lm_head.weight"):
                    parameters += math.prod(stored.get_shape())
    if config.tie_word_embeddings:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    elif "lm_head.weight" not in weights:
        raise ValueError(f"{path}: config.json says the output layer is not tied to the embedding, and no lm_head.weight is stored")
    return config, weights, parameters
