"""The decoder forward pass of every model specfleet serves: a Llama-family transformer in plain tensor code.

Families: Llama (1, 2, 3.x with its `llama3` RoPE scaling), Mistral, Qwen2/2.5
(QKV bias) and Qwen3 (an RMSNorm on each head's queries and keys). They differ
only in those few places, so one forward serves them all; anything else is
refused at load naming the family (`check_supported`). The whole pass stays in this one file, a
little over 400 lines, so that it reads top to bottom as gpt-fast's model.py does.

Why not call the Hugging Face module: for the small models a drafter runs (and
on CPU even for the target) its per-call overhead (cache objects, mask
builders, hooks, a module call per projection) costs more than the arithmetic;
measured interleaved on the demo target, one decode step took 12.4 ms through
`LlamaForCausalLM.forward` and 8.7 ms here. Weights still come from any Hugging
Face checkpoint of a supported family, loaded by `transformers`.

One pass serves many sessions with ragged contexts: B sessions, each feeding
n_b new tokens (N = max n_b) at its own positions, after its own kv_b cached
positions. Every session's keys and values live in blocks of one KV pool
[layers, 2, KV, C, D] (`kv.KVPool`, C positions on one token axis), where its
place says where its positions lie: a range of the axis (its blocks are
consecutive) or a list of indices. The pass writes the new tokens' KV at
positions [kv_b, kv_b + n_b) of each session in place. Linear layers run on all
B x N rows at once. Attention runs per session over its [0, kv_b + n_b) (a view
of a range, or those positions gathered), or batched: one call per layer over
the sessions' positions gathered into [B, KV, T, D], with a mask for the
ragged lengths and patterns. `attend` [n_b, n_b] says which new tokens see
which (causal for a chain, ancestors for a tree); every new token sees the
whole cached prefix.

Several models of one shape run in one pass when stacked (`stack.py`): every
weight then has a leading [G] dimension, the pass's rows are sorted by model
(`Runs`), and each linear layer runs once per model on that model's rows (a
slice, nothing gathered); embeddings, norms, RoPE and attention run once for
all rows. A row's result is its own model's: no operation mixes rows.

Shapes: B sessions, N new tokens per session (padded), E hidden size, H query
heads, KV key/value heads, D head dim, V vocabulary, T cached + new positions,
C positions of the pool, G stacked models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specfleet.engine import attention, cpu_kernels, cpu_pass
from specfleet.engine.cpu_linear import Bf16Weight, CpuWeight, StackedWeights

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# RoPE variants computed here (`rope_frequencies`); the others (yarn, dynamic, longrope, ...) are refused.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass
class Layer:
    """One decoder layer's weights. On a CPU `LoadedModel.prepare` may replace qkv, out, gate_up and down (and the
    model's lm_head) with `cpu_linear.CpuWeight`s, the same weights laid out for the CPU's kernels."""

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
    sin: torch.Tensor  # [max positions, D], float32, its first half negated (`_rotate`)
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    # How attention runs (`attention.ATTENTION_MODES`): per session, batched, on the CPU kernel, or auto.
    attention: str = "auto"
    # Tensor parallelism (`parallel.Group`), or None: this rank's heads (heads, kv_heads above), intermediate
    # width and vocabulary slice, the others' partial sums added by all-reduces, their scores gathered.
    parallel: object | None = None
    vocab: int = 0  # rows of the whole output layer, when lm_head is this rank's slice of it
    # Every layer in one call on a CPU (`cpu_pass.prepare`, once its weights are laid out), or None.
    cpu_pass: object | None = None

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
            f"model_type {config.model_type!r} is not supported; specfleet runs Llama-family decoders ({', '.join(SUPPORTED_MODEL_TYPES)})"
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
    return from_weights(hf_model.config, {name: t.detach() for name, t in hf_model.state_dict().items()})


def from_weights(config, weights: dict[str, torch.Tensor]) -> LlamaModel:
    """The model from a Hugging Face config (attributes as its config.json names them) and its
    checkpoint's tensors by name (a tied lm_head.weight is the embedding's tensor)."""
    check_supported(config)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = []
    for i in range(config.num_hidden_layers):
        w = lambda name: weights.get(f"model.layers.{i}.{name}")  # noqa: E731
        bias = None
        if w("self_attn.q_proj.bias") is not None:
            bias = torch.cat([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"), w("self_attn.v_proj.bias")])
        layers.append(
            Layer(
                input_norm=w("input_layernorm.weight"),
                qkv=torch.cat([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"), w("self_attn.v_proj.weight")]),
                qkv_bias=bias,
                out=w("self_attn.o_proj.weight"),
                out_bias=w("self_attn.o_proj.bias"),
                q_norm=w("self_attn.q_norm.weight"),
                k_norm=w("self_attn.k_norm.weight"),
                mlp_norm=w("post_attention_layernorm.weight"),
                gate_up=torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]),
                down=w("mlp.down_proj.weight"),
            )
        )
    inv_freq = rope_frequencies(config, head_dim)
    freqs = torch.outer(torch.arange(config.max_position_embeddings).float(), inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    embed = weights["model.embed_tokens.weight"]
    return LlamaModel(
        embed=embed,
        layers=layers,
        norm=weights["model.norm.weight"],
        lm_head=weights["lm_head.weight"],
        cos=angles.cos().to(embed.device),
        sin=torch.cat([-freqs.sin(), freqs.sin()], dim=-1).to(embed.device),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        eps=config.rms_norm_eps,
    )


@dataclass
class Runs:
    """Which stacked model each row of a pass is: rows [start, end) of run (g, start, end) are model g's."""

    runs: list[tuple[int, int, int]]  # (model, first row, end), in row order, covering every row
    members: torch.Tensor  # [B] long on the model's device: each row's model

    @staticmethod
    def of(members: list[int], device: torch.device) -> "Runs":
        """The runs of rows whose models are `members`, in row order (equal models adjacent)."""
        runs: list[tuple[int, int, int]] = []
        for row, g in enumerate(members):
            if runs and runs[-1][0] == g:
                runs[-1] = (g, runs[-1][1], row + 1)
            else:
                runs.append((g, row, row + 1))
        return Runs(runs, torch.tensor(members, dtype=torch.long, device=device))


def _linear(
    x: torch.Tensor, weight: torch.Tensor | CpuWeight | Bf16Weight | StackedWeights, bias: torch.Tensor | None, runs: Runs | None
) -> torch.Tensor:
    if isinstance(weight, (CpuWeight, Bf16Weight)):  # laid out for a CPU's kernels (`cpu_linear.py`)
        return weight(x, bias)
    if isinstance(weight, StackedWeights):  # a stack's, each model's rows through its own
        return weight(x, bias, runs)
    if runs is None:
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(x[lo:hi], weight[g], None if bias is None else bias[g]) for g, lo, hi in runs.runs])


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, runs: Runs | None) -> torch.Tensor:
    """RMSNorm over the last dimension; stacked, each row scales by its own model's weight."""
    if runs is None:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    scale = weight[runs.members].view(x.shape[0], *[1] * (x.dim() - 2), x.shape[-1])
    return F.rms_norm(x, (x.shape[-1],), None, eps) * scale


def _add_norm(model: LlamaModel, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor | None, runs: Runs | None, kernels: bool):
    """The residual stream x + delta (x where delta is None), and its RMSNorm by `weight` (None where no norm
    follows). On the CPU kernels (`kernels`: the pass takes them) one call does both, x updated in place (the pass's
    own tensor)."""
    if weight is not None and kernels:
        return x, cpu_kernels.add_rms_norm(x, delta, weight, model.eps)
    if delta is not None:
        x = x + delta
    return x, None if weight is None else _norm(x, weight, model.eps, runs)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE: x * cos + [-x2, x1] * sin for x's halves x1, x2, as [x2, x1] * [-sin1, sin2] (the model's `sin`), the same
    products in fewer ops (a pass's small ops cost more than their arithmetic on a CPU)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


@torch.inference_mode()
def forward(
    model: LlamaModel,
    input_ids: torch.Tensor,  # [B, N] long
    positions: torch.Tensor,  # [B, N] long
    kv: torch.Tensor,  # the KV pool, [layers, 2, KV, C, D] (`kv.KVPool`)
    places: list[int | torch.Tensor],  # each session's `Session.place()`: a range's start, or its positions' indices
    kv_lens: list[int],  # kv_b
    new_lens: list[int],  # n_b; the session's place holds kv_b + n_b positions
    attends: list[torch.Tensor | None],  # per session [n_b, n_b] bool, or None when n_b == 1
    logits: bool = True,
    plan: attention.BatchPlan | None = None,
    runs: Runs | None = None,
) -> torch.Tensor | None:
    """Logits [B, N, V] (row b valid for its first n_b positions), or None with logits=False.

    With `runs`, `model` is a stack (`stack.py`) and row b runs model `runs.members[b]`.

    With `plan` (a CUDA graph's static one, `graphs.py`), attention is batched as it says and
    places, lengths and patterns are not read.

    Writes each session's new keys and values at its positions [kv_b, kv_b + n_b) (batched:
    all sessions in one indexed write per layer).
    """
    batch, width = input_ids.shape
    H, D = model.heads, model.head_dim
    input_ids, positions = input_ids.to(model.device), positions.to(model.device)
    rows = _real_rows(model, new_lens, width, plan, runs)
    if rows is not None:  # the projections and norms run on the real rows alone, [R, E]
        x = model.embed[input_ids.view(-1)[rows]]
    else:
        x = model.embed[input_ids] if runs is None else model.embed[runs.members[:, None], input_ids]  # [B, N, E]
    # The norms and the gate on the CPU kernels: a float32 model on a CPU, one model's rows (a stack's rows scale by
    # each member's own norm weights, on torch's operations).
    kernels = runs is None and attention.kernels_serve(model)
    layout = attention.layout(model, plan, places, kv_lens, new_lens, attends, width, kv)
    # On the kernel RoPE is rotated and the new KV written in one call a layer, except where queries and keys are
    # normed first (Qwen3): there torch rotates them, and writes them as the other modes do.
    fused = layout.kind == "kernel" and model.layers[0].q_norm is None
    if not fused:
        cos = model.cos[positions].to(model.dtype).unsqueeze(1)  # [B, 1, N, D]
        sin = model.sin[positions].to(model.dtype).unsqueeze(1)
    elif positions.numel() and int(positions.max()) >= model.cos.shape[0]:  # the kernel reads the table unchecked
        raise IndexError(f"position {int(positions.max())} is past the model's {model.cos.shape[0]}")
    x, h = _add_norm(model, x, None, model.layers[0].input_norm, runs, kernels)
    if fused and kernels and cpu_pass.serves(model.cpu_pass, x.numel() // x.shape[-1]):
        # Every layer in one call: the same kernels on the same rows as the calls below (cpu_pass.py).
        cpu_pass.run_layers(model.cpu_pass, x, h, positions, kv, layout.where, rows, logits)
    else:
        for i, layer in enumerate(model.layers):
            qkv = _linear(h, layer.qkv, layer.qkv_bias, runs)  # [B, N, (H + 2 KV) D]
            if rows is not None:
                qkv = _padded(qkv, rows, batch, width)
            if fused:  # rotated, written and attended in two calls
                q = cpu_kernels.rope_write(qkv.contiguous(), positions, model.cos, model.sin, kv[i], layout.where)
                attn = cpu_kernels.attend(q.transpose(1, 2), kv[i], layout.where)  # [B, N, H, D]
            else:
                attn = _attend(model, layer, kv[i], qkv, cos, sin, layout, i, runs)
            attn = attn.reshape(batch, width, H * D) if rows is None else attn.reshape(batch * width, H * D).index_select(0, rows)
            x, h = _add_norm(model, x, _row_parallel(model, attn, layer.out, layer.out_bias, runs), layer.mlp_norm, runs, kernels)
            x, h = _mlp(model, layer, x, h, i, logits, runs, kernels)
    if not logits:
        return None
    scores = _linear(h, model.lm_head, None, runs)
    scores = scores if model.parallel is None else model.parallel.gather_vocab(scores, model.vocab)
    return scores if rows is None else _padded(scores, rows, batch, width)


def _real_rows(model: LlamaModel, new_lens: list[int] | None, width: int, plan, runs: Runs | None) -> torch.Tensor | None:
    """Where a ragged pass's real rows lie among its B x N padded ones (row b * N + j for j < n_b), or None where no
    row pads (or a CUDA graph's static pass, or a stack's, whose rows go by session). A verify pass with one session's
    draft of k tokens beside sessions decoding one each would otherwise run every projection on B x (k + 1) rows."""
    if plan is not None or runs is not None or new_lens is None or sum(new_lens) == len(new_lens) * width:
        return None
    return torch.tensor([b * width + j for b, n in enumerate(new_lens) for j in range(n)], dtype=torch.long, device=model.device)


def _padded(packed: torch.Tensor, rows: torch.Tensor, batch: int, width: int) -> torch.Tensor:
    """[B, N, F] from a pass's real rows [R, F] (`_real_rows`), its padding rows zero."""
    out = packed.new_zeros(batch * width, packed.shape[-1])
    return out.index_copy_(0, rows, packed).view(batch, width, -1)


def _attend(model: LlamaModel, layer: Layer, pool_layer, qkv, cos, sin, layout: attention.Layout, i: int, runs: Runs | None) -> torch.Tensor:
    """Layer i's attention on torch's operations (the kernel's too where queries and keys are normed first):
    its new tokens' queries and keys rotated, their KV written into the pool, [B, N, H, D] out."""
    batch, width = qkv.shape[:2]
    H, KV, D = model.heads, model.kv_heads, model.head_dim
    if layer.q_norm is None:  # q and k rotated together
        qk = _rotate(qkv[..., : (H + KV) * D].view(batch, width, H + KV, D).transpose(1, 2), cos, sin)
        q, k = qk[:, :H], qk[:, H:]  # [B, H, N, D], [B, KV, N, D]
    else:
        q, k = qkv[..., : H * D].view(batch, width, H, D), qkv[..., H * D : (H + KV) * D].view(batch, width, KV, D)
        q = _rotate(_norm(q, layer.q_norm, model.eps, runs).transpose(1, 2), cos, sin)
        k = _rotate(_norm(k, layer.k_norm, model.eps, runs).transpose(1, 2), cos, sin)
    v = qkv[..., (H + KV) * D :].view(batch, width, KV, D).transpose(1, 2)
    new_kv = torch.stack([k, v], dim=1)  # [B, 2, KV, N, D]
    if layout.kind == "batched":
        plan = layout.plan  # one indexed write for every session: [2, KV, C, D] at the new tokens' indices
        pool_layer[:, :, plan.write_index] = new_kv[plan.write_b, :, :, plan.write_j].permute(1, 2, 0, 3)
        return attention.attend_batched(q, pool_layer, plan).transpose(1, 2)
    attention.write_new(pool_layer, new_kv, layout.places, layout.kv_lens, layout.new_lens, layout.writes)
    if layout.kind == "kernel":
        return cpu_kernels.attend(q, pool_layer, layout.where)
    # Per session, as few tensor ops as possible: at 32 sessions and 16 layers this loop runs 512 times a pass,
    # and each op costs about a microsecond of dispatch.
    outs = []
    for b in range(batch):
        kv_len, n, place = layout.kv_lens[b], layout.new_lens[b], layout.places[b]
        # 4-D operands, [1, KV, T, D]: the 3-D form falls back to a slower kernel on CPU.
        if layout.views[b] is not None:  # a range of the token axis: a view
            keys, values = layout.views[b][i]
        else:  # scattered blocks: gathered by index
            keys, values = pool_layer[:, None, :, place[: kv_len + n]]
        out = F.scaled_dot_product_attention(q[b : b + 1, :, :n], keys, values, attn_mask=layout.masks[b], enable_gqa=KV != H)
        outs.append(out if n == width else F.pad(out, (0, 0, 0, width - n)))
    return torch.cat(outs).transpose(1, 2)  # [B, N, H, D]


def _mlp(model: LlamaModel, layer: Layer, x: torch.Tensor, h: torch.Tensor, i: int, logits: bool, runs: Runs | None, kernels: bool):
    """Layer i's MLP on its normed input h, added to the residual stream x, and the stream normed for what follows
    (layer i + 1, or the output layer: nothing where the pass wants no logits)."""
    gate_up = _linear(h, layer.gate_up, None, runs)
    if kernels:
        gated = cpu_kernels.silu_mul(gate_up.contiguous())
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        gated = F.silu(gate) * up
    following = model.layers[i + 1].input_norm if i + 1 < len(model.layers) else model.norm if logits else None
    return _add_norm(model, x, _row_parallel(model, gated, layer.down, None, runs), following, runs, kernels)


def _row_parallel(model: LlamaModel, x: torch.Tensor, weight, bias: torch.Tensor | None, runs: Runs | None) -> torch.Tensor:
    """A projection whose input is split by columns over the ranks (`parallel.py`): each rank's partial sum, all-reduced,
    then the bias once. One rank: the projection."""
    if model.parallel is None:
        return _linear(x, weight, bias, runs)
    out = model.parallel.all_reduce(_linear(x, weight, None, runs))
    return out if bias is None else out + bias
