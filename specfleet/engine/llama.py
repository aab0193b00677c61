"""The decoder forward pass of every model specfleet serves: a Llama-family transformer in plain tensor code.

Families: Llama (1, 2, 3.x with its `llama3` RoPE scaling), Mistral, Qwen2/2.5
(QKV bias) and Qwen3 (an RMSNorm on each head's queries and keys). They differ
only in those few places, so one forward serves them all; anything else is
refused at load naming the family (`check_supported`).

Why not call the Hugging Face module: for the small models a drafter runs (and
on CPU even for the target) its per-call overhead (cache objects, mask
builders, hooks, a module call per projection) costs more than the arithmetic;
measured interleaved on the demo target, one decode step took 12.4 ms through
`LlamaForCausalLM.forward` and 8.7 ms here. Weights still come from any Hugging
Face checkpoint of a supported family, loaded by `transformers`.

One pass serves many sessions with ragged contexts: B sessions, each feeding
n_b new tokens (N = max n_b) at its own positions, after its own kv_b cached
positions. Each session's keys and values live in its own buffer
[layers, 2, KV, capacity, D]; the pass writes the new tokens' KV at
[kv_b, kv_b + n_b) in place, and attention runs per session over
[0, kv_b + n_b) of that buffer, so nothing is padded or copied to batch the
caches. Linear layers run on all B x N rows at once. `attend` [n_b, n_b]
says which new tokens see which (causal for a chain, ancestors for a tree);
every new token sees the whole cached prefix.

Shapes: B sessions, N new tokens per session (padded), E hidden size, H query
heads, KV key/value heads, D head dim, V vocabulary, T cached + new positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# per-session: one attention call per session and layer over its own buffer, nothing padded or copied
#   (measured faster on CPU: docs/ARCHITECTURE.md, "Batching shapes and the forward pass").
# batched: one call per layer for all sessions, over their buffers stacked to the longest context with
#   an additive mask (padding, ragged lengths, tree patterns); B times fewer attention launches, for GPUs.
ATTENTION_MODES = ("per-session", "batched")
# RoPE variants computed here (`rope_frequencies`); the others (yarn, dynamic, longrope, ...) are refused.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class Layer:
    input_norm: torch.Tensor  # [E]
    qkv: torch.Tensor  # [(H + 2 KV) D, E]: q, k and v projections stacked
    qkv_bias: torch.Tensor | None  # [(H + 2 KV) D]
    out: torch.Tensor  # [E, H D]
    out_bias: torch.Tensor | None  # [E] (Llama with attention_bias)
    q_norm: torch.Tensor | None  # [D]: Qwen3 normalises each head's queries and keys before RoPE
    k_norm: torch.Tensor | None  # [D]
    mlp_norm: torch.Tensor  # [E]
    gate_up: torch.Tensor  # [2 I, E]: gate and up projections stacked
    down: torch.Tensor  # [E, I]


@dataclass
class LlamaModel:
    embed: torch.Tensor  # [V, E]
    layers: list[Layer]
    norm: torch.Tensor  # [E]
    lm_head: torch.Tensor  # [V, E]
    cos: torch.Tensor  # [max positions, D], float32
    sin: torch.Tensor  # [max positions, D], float32
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    # How attention runs (`ATTENTION_MODES`): per session, or one call per layer for the whole batch.
    attention: str = "per-session"

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def _rope(config) -> dict:
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def check_supported(config) -> None:
    """Raise ValueError naming what is unsupported, before any weights load."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {config.model_type!r} is not supported; specfleet runs Llama-family decoders "
            f"({', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    rope = _rope(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not supported")
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        raise ValueError("only SiLU-gated MLPs without bias are supported")


def context_limit(config) -> int:
    """Positions a session may use: the model's, or fewer when its attention slides.

    The pass attends to the whole cached prefix, which equals a sliding window only while
    the context fits in it (Mistral's 4096; Qwen2/3 with use_sliding_window), so longer
    contexts are refused rather than computed wrongly.
    """
    limit = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    if config.model_type == "mistral":
        slides = window is not None
    else:
        slides = bool(window) and "sliding_attention" in (getattr(config, "layer_types", None) or [])
    return min(limit, int(window)) if slides else limit


def rope_frequencies(config, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [D / 2], float32, computed as transformers computes them (same numbers)."""
    rope = _rope(config)
    theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "linear":
        return inv_freq / rope["factor"]
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between blended.
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        original = rope.get("original_max_position_embeddings", config.max_position_embeddings)
        low_wavelen, high_wavelen = original / low, original / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def from_hf(hf_model) -> LlamaModel:
    """Take the weights out of a loaded Hugging Face Llama-family causal LM."""
    config = hf_model.config
    check_supported(config)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = []
    for block in hf_model.model.layers:
        attn, mlp = block.self_attn, block.mlp
        bias = None
        if attn.q_proj.bias is not None:
            bias = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach()
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        layers.append(
            Layer(
                input_norm=block.input_layernorm.weight.detach(),
                qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
                qkv_bias=bias,
                out=attn.o_proj.weight.detach(),
                out_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
                q_norm=None if q_norm is None else q_norm.weight.detach(),
                k_norm=None if k_norm is None else k_norm.weight.detach(),
                mlp_norm=block.post_attention_layernorm.weight.detach(),
                gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
                down=mlp.down_proj.weight.detach(),
            )
        )
    inv_freq = rope_frequencies(config, head_dim)
    freqs = torch.outer(torch.arange(config.max_position_embeddings).float(), inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    embed = hf_model.model.embed_tokens.weight.detach()
    return LlamaModel(
        embed=embed,
        layers=layers,
        norm=hf_model.model.norm.weight.detach(),
        lm_head=hf_model.lm_head.weight.detach(),
        cos=angles.cos().to(embed.device),
        sin=angles.sin().to(embed.device),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        eps=config.rms_norm_eps,
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


@torch.inference_mode()
def forward(
    model: LlamaModel,
    input_ids: torch.Tensor,  # [B, N] long
    positions: torch.Tensor,  # [B, N] long
    kv_buffers: list[torch.Tensor],  # per session [layers, 2, KV, capacity >= kv_b + n_b, D]
    kv_lens: list[int],  # kv_b
    new_lens: list[int],  # n_b
    attends: list[torch.Tensor | None],  # per session [n_b, n_b] bool, or None when n_b == 1
    logits: bool = True,
) -> torch.Tensor | None:
    """Logits [B, N, V] (row b valid for its first n_b positions), or None with logits=False.

    Writes each session's new keys and values into its buffer at [kv_b, kv_b + n_b).
    With model.attention == "batched", every buffer must hold max(kv_b + n_b) positions,
    zero past what was written (`runtime.Session.reserve` makes them so).
    """
    batch, width = input_ids.shape
    H, KV, D = model.heads, model.kv_heads, model.head_dim
    input_ids, positions = input_ids.to(model.device), positions.to(model.device)
    x = model.embed[input_ids]  # [B, N, E]
    cos = model.cos[positions].to(model.dtype).unsqueeze(1)  # [B, 1, N, D]
    sin = model.sin[positions].to(model.dtype).unsqueeze(1)
    batched = model.attention == "batched" and batch > 1
    if batched:
        total = max(k + n for k, n in zip(kv_lens, new_lens))
        bias = _batch_bias(model, total, width, kv_lens, new_lens, attends)
    else:
        masks = _session_masks(model, kv_lens, new_lens, attends)
    for i, layer in enumerate(model.layers):
        h = F.rms_norm(x, (x.shape[-1],), layer.input_norm, model.eps)
        qkv = F.linear(h, layer.qkv, layer.qkv_bias)  # [B, N, (H + 2 KV) D]
        q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
        q, k = q.view(batch, width, H, D), k.view(batch, width, KV, D)
        if layer.q_norm is not None:
            q = F.rms_norm(q, (D,), layer.q_norm, model.eps)
            k = F.rms_norm(k, (D,), layer.k_norm, model.eps)
        q = _rotate(q.transpose(1, 2), cos, sin)  # [B, H, N, D]
        k = _rotate(k.transpose(1, 2), cos, sin)  # [B, KV, N, D]
        v = v.view(batch, width, KV, D).transpose(1, 2)
        new_kv = torch.stack([k, v], dim=1)  # [B, 2, KV, N, D]
        if batched:
            for b in range(batch):
                kv_buffers[b][i][:, :, kv_lens[b] : kv_lens[b] + new_lens[b]] = new_kv[b, :, :, : new_lens[b]]
            cache = torch.stack([buf[i, :, :, :total] for buf in kv_buffers])  # [B, 2, KV, T, D]
            attn = F.scaled_dot_product_attention(q, cache[:, 0], cache[:, 1], attn_mask=bias, enable_gqa=KV != H)
        else:
            # Per session, as few tensor ops as possible: at 32 sessions and 16 layers this loop
            # runs 512 times a pass, and each op costs about a microsecond of dispatch.
            outs = []
            for b in range(batch):
                kv_len, n = kv_lens[b], new_lens[b]
                cache = kv_buffers[b][i]  # [2, KV, capacity, D]
                cache[:, :, kv_len : kv_len + n] = new_kv[b, :, :, :n]
                # 4-D operands: the 3-D form falls back to a slower kernel on CPU.
                keys, values = cache[:, None, :, : kv_len + n].unbind(0)
                out = F.scaled_dot_product_attention(q[b : b + 1, :, :n], keys, values, attn_mask=masks[b], enable_gqa=KV != H)
                outs.append(out if n == width else F.pad(out, (0, 0, 0, width - n)))
            attn = torch.cat(outs)  # [B, H, N, D]
        x = x + F.linear(attn.transpose(1, 2).reshape(batch, width, H * D), layer.out, layer.out_bias)
        h = F.rms_norm(x, (x.shape[-1],), layer.mlp_norm, model.eps)
        gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
        x = x + F.linear(F.silu(gate) * up, layer.down)
    if not logits:
        return None
    return F.linear(F.rms_norm(x, (x.shape[-1],), model.norm, model.eps), model.lm_head)


def _session_masks(model, kv_lens, new_lens, attends) -> list[torch.Tensor | None]:
    """Per session: [n_b, kv_b + n_b] additive, every cached position visible; None means "all visible"."""
    masks = []
    for kv_len, n, attend in zip(kv_lens, new_lens, attends):
        if attend is None:
            masks.append(None)
            continue
        # Additive, in the model's dtype: SDPA would convert a boolean mask on every layer.
        mask = torch.zeros(n, kv_len + n, dtype=model.dtype, device=model.device)
        mask[:, kv_len:].masked_fill_(~attend.to(model.device), float("-inf"))
        masks.append(mask)
    return masks


def _batch_bias(model, total, width, kv_lens, new_lens, attends) -> torch.Tensor:
    """[B, 1, N, T] additive, built once a pass for batched attention over buffers stacked to T positions.

    Row i of session b sees its cached prefix and its own pattern among the new tokens, nothing
    past its end; a padding row (i >= n_b) sees position 0 only, so that no row is all -inf (NaN).
    """
    bias = torch.full((len(kv_lens), width, total), float("-inf"), dtype=model.dtype, device=model.device)
    for b, (kv_len, n, attend) in enumerate(zip(kv_lens, new_lens, attends)):
        bias[b, :n, :kv_len] = 0
        if attend is None:
            bias[b, :n, kv_len : kv_len + n] = 0
        else:
            bias[b, :n, kv_len : kv_len + n].masked_fill_(attend.to(model.device), 0)
        bias[b, n:, 0] = 0
    return bias.unsqueeze(1)
