"""How a pass's sessions attend over the KV pool (`ATTENTION_MODES`): the mode a pass takes and what it builds once
for every layer (`layout`), the batched mode's gathers and masks (also a CUDA graph's static plan, graphs.py), the
per-session mode's views and masks, the kernel's places (`cpu_kernels.AttendPlan`), and where a pass's new keys and
values go. The layers' arithmetic is llama.py's; these functions read a model's `attention`, `device`, `dtype`,
`heads` and whether its layers norm queries and keys."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specfleet.engine import cpu_kernels

# auto: batched on a GPU; on a CPU the kernel where it is built and the model is float32, else per session
#   (there gathering every session's keys and values into one padded tensor costs more than the per-session
#   calls it saves: docs/benchmarks/engine-forward-pass.md).
# per-session: one attention call per session and layer over its own positions (a view where its blocks
#   are consecutive), nothing padded.
# batched: one call per layer for all sessions, their positions gathered from the KV pool, with an
#   additive mask (padding, ragged lengths, tree patterns).
# kernel: one call per layer for all sessions on a CPU, each reading its own positions where they lie
#   (csrc/attention.cpp, `cpu_kernels.attend`): nothing gathered, padded or masked.
ATTENTION_MODES = ("auto", "per-session", "batched", "kernel")


@dataclass
class Layout:
    """How one pass's sessions attend (`layout`), built once a pass and read by every layer."""

    kind: str  # "kernel", "batched" or "per-session"
    places: list
    kv_lens: list[int]
    new_lens: list[int]
    plan: BatchPlan | None = None  # batched: where the pass writes and reads, and its mask
    where: cpu_kernels.AttendPlan | None = None  # kernel: the sessions' places and patterns for csrc/attention.cpp
    writes: tuple | None = None  # several sessions' new KV in one indexed write (`_writes`)
    masks: list | None = None  # per session: its additive mask, or None
    views: list | None = None  # per session: its keys and values over every layer as a view, or None (scattered)


def layout(model, plan, places, kv_lens, new_lens, attends, width: int, kv: torch.Tensor) -> Layout:
    """The pass's attention mode (`ATTENTION_MODES`) and what it needs. A CUDA graph's static `plan` is batched, its
    places, lengths and patterns not read."""
    if plan is not None:
        return Layout("batched", places, kv_lens, new_lens, plan=plan)
    several = len(places) > 1
    if attends_on_kernel(model):
        where = cpu_kernels.AttendPlan(places, kv_lens, new_lens, attends, width, kv, model.heads)
        # The kernel writes the new KV itself but where queries and keys are normed before RoPE (llama.forward).
        torch_writes = several and model.layers[0].q_norm is not None
        return Layout("kernel", places, kv_lens, new_lens, where=where, writes=_writes(model, places, kv_lens, new_lens) if torch_writes else None)
    if several and runs_batched(model):
        return Layout("batched", places, kv_lens, new_lens, plan=batch_plan(model, places, kv_lens, new_lens, attends, width))
    return Layout(
        "per-session",
        places,
        kv_lens,
        new_lens,
        writes=_writes(model, places, kv_lens, new_lens) if several else None,
        masks=_session_masks(model, kv_lens, new_lens, attends),
        # Each consecutive session's keys and values as a view over every layer, [layers, 2, 1, KV, T, D].
        views=[kv[:, :, None, :, p : p + k + n] if isinstance(p, int) else None for p, k, n in zip(places, kv_lens, new_lens)],
    )


def kernels_serve(model) -> bool:
    """Whether this model's passes may take the compiled CPU kernels (`cpu_kernels`): a float32 model on a CPU, and
    the kernels built on this machine."""
    return model.device.type == "cpu" and model.dtype == torch.float32 and cpu_kernels.library() is not None


def kernel_attends(model) -> bool:
    """Whether the attention kernel can attend for the model: the kernels serve it and take its head size
    (`cpu_kernels.takes_head_dim`)."""
    return kernels_serve(model) and cpu_kernels.takes_head_dim(model.head_dim)


def attends_on_kernel(model) -> bool:
    """Whether a pass attends through `cpu_kernels.attend`: asked for, or `auto` where the kernel can."""
    return model.attention == "kernel" or (model.attention == "auto" and kernel_attends(model))


def write_new(pool_layer: torch.Tensor, new_kv: torch.Tensor, places, kv_lens, new_lens, writes) -> None:
    """The pass's new keys and values into one layer of the pool: one session's as a slice, several in one indexed
    write (`_writes`)."""
    if writes is None:
        pool_layer[:, :, _positions(places[0], kv_lens[0], new_lens[0])] = new_kv[0, :, :, : new_lens[0]]
    else:
        pool_layer[:, :, writes[2]] = new_kv[writes[0], :, :, writes[1]].permute(1, 2, 0, 3)


def runs_batched(model) -> bool:
    """Whether a pass of several sessions attends in one call per layer."""
    if model.attention != "auto":
        return model.attention == "batched"
    return model.device.type != "cpu"


def _positions(place: int | torch.Tensor, kv_len: int, n: int) -> slice | torch.Tensor:
    """Where positions [kv_len, kv_len + n) of a session lie on the pool's token axis: a range, or indices."""
    return slice(place + kv_len, place + kv_len + n) if isinstance(place, int) else place[kv_len : kv_len + n]


def _writes(model, places, kv_lens, new_lens) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(b, j, index) of every new token of the pass: token j of session b goes to `index` on the pool's token axis.
    Built on the host and copied once where every session's blocks are consecutive: on a GPU each tensor op per
    session is a kernel launch, and a pass of 64 sessions would spend more on them than on its layers."""
    device = model.device
    rows = [(b, j) for b, n in enumerate(new_lens) for j in range(n)]
    if all(isinstance(p, int) for p in places):
        index = [places[b] + kv_lens[b] + j for b, j in rows]
        b_j_index = torch.tensor([[b for b, _ in rows], [j for _, j in rows], index], dtype=torch.long).to(device)
        return b_j_index[0], b_j_index[1], b_j_index[2]
    index = torch.cat(
        [torch.arange(p + k, p + k + n, device=device) if isinstance(p, int) else p[k : k + n] for p, k, n in zip(places, kv_lens, new_lens)]
    )
    b_j = torch.tensor([[b for b, _ in rows], [j for _, j in rows]], dtype=torch.long).to(device)
    return b_j[0], b_j[1], index


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


@dataclass
class BatchPlan:
    """How one pass's sessions attend in one call per layer (built once a pass, used by every layer)."""

    write_b: torch.Tensor  # [R]: the pass's new tokens (b, j), R = sum of n_b ...
    write_j: torch.Tensor
    write_index: torch.Tensor  # ... and where their KV goes on the pool's token axis
    read_index: torch.Tensor  # [B, T]: what row b reads at t (padding reads the pool's scratch, masked)
    bias: torch.Tensor  # [B, 1, N, T] additive


def batch_plan(model, places, kv_lens, new_lens, attends, width) -> BatchPlan:
    """Where the pass writes and reads on the pool's token axis, and its mask (`ragged_bias`)."""
    device = model.device
    total = max(k + n for k, n in zip(kv_lens, new_lens))
    write_b, write_j, write_index = _writes(model, places, kv_lens, new_lens)
    return BatchPlan(
        write_b=write_b,
        write_j=write_j,
        write_index=write_index,
        read_index=read_index(places, [k + n for k, n in zip(kv_lens, new_lens)], total, len(places), device),
        bias=ragged_bias(model, kv_lens, new_lens, attends, width, total).unsqueeze(1),
    )


def read_index(places: list, lengths: list[int], total: int, rows: int, device: torch.device) -> torch.Tensor:
    """[rows, total] long: row b's positions [0, lengths[b]) on the pool's token axis (`places`), the rest
    (and rows past the places) 0, the first position of the pool's scratch block, which the mask hides.
    Ranges from their starts and lengths, copied once (no tensor op per session); scattered blocks by their indices."""
    pad = [0] * (rows - len(places))
    starts = [p if isinstance(p, int) else 0 for p in places] + pad
    bounds = torch.tensor([starts, list(lengths) + pad], dtype=torch.long).to(device)
    t = torch.arange(total, device=device)
    read = torch.where(t < bounds[1, :, None], bounds[0, :, None] + t, 0)
    for b, (place, length) in enumerate(zip(places, lengths)):
        if not isinstance(place, int):
            read[b, :length] = place[:length]
    return read


def ragged_bias(model, kv_lens, new_lens, attends, width: int, total: int) -> torch.Tensor:
    """[B, N, T] additive: row i of session b sees its cached prefix and its own pattern among the new
    tokens, nothing past its end; a padding row (i >= n_b) sees position 0, so that no row is all -inf.
    The patterns (`attends`, on the host) are laid out on the host and copied once with the lengths."""
    device, batch = model.device, len(kv_lens)
    pattern = torch.zeros(batch, width, width, dtype=torch.bool)
    for b, (n, attend) in enumerate(zip(new_lens, attends)):
        if attend is None:
            pattern[b, :n, :n] = True
        else:
            pattern[b, :n, :n] = attend
    pattern = pattern.to(device)
    lens = torch.tensor([list(kv_lens), list(new_lens)], dtype=torch.long).to(device)
    t = torch.arange(total, device=device)
    offset = t - lens[0][:, None, None]  # [B, 1, T]: position relative to the first new token
    new = pattern.gather(2, offset.clamp(0, width - 1).expand(batch, width, total)) & (offset >= 0) & (offset < width)
    visible = (offset < 0) | new  # [B, N, T]
    padding = torch.arange(width, device=device) >= lens[1][:, None]  # [B, N]
    visible[:, :, 0] |= padding
    return torch.zeros(batch, width, total, dtype=model.dtype, device=device).masked_fill_(~visible, float("-inf"))


def attend_batched(q: torch.Tensor, pool_layer: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
    """[B, H, N, D]: one SDPA call for every session of the pass over its positions, gathered from the pool.

    With grouped queries (H = G x KV heads) the G query heads of each key/value head attend as G x N rows of one
    head: SDPA then sees as many query heads as key heads, which every fused kernel that takes a mask serves, where
    `enable_gqa` with a mask may leave them (torch versions differ) for the math kernel, which repeats every key and
    value G times."""
    keys, values = pool_layer[:, :, plan.read_index].transpose(1, 2).unbind(0)  # [B, KV, T, D] each
    batch, heads, width, dim = q.shape
    groups = heads // keys.shape[1]
    if groups == 1:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=plan.bias)
    rows = q.reshape(batch, keys.shape[1], groups * width, dim)  # row g * N + i: query head kv * G + g, token i
    out = F.scaled_dot_product_attention(rows, keys, values, attn_mask=plan.bias.repeat(1, 1, groups, 1))
    return out.reshape(batch, heads, width, dim)
