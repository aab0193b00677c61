"""Models of one shape in one forward pass: what a drafter service hosting several specialists runs.

A drafter service that hosts several draft models (the demo family: eight
one-layer drafters, one per domain) would run one forward pass per model at
every draft step. On a small model a pass's fixed cost (dispatching some forty
tensor ops, then sampling) outweighs its arithmetic, so a step for requests
routed to m specialists, or fused from m drafters, would cost m passes. Stacked,
it is one: every weight gains a leading [G] dimension, the rows are sorted by
model, each linear layer runs once per model on its contiguous rows (`llama.Runs`),
and embeddings, norms, RoPE, attention and sampling run once for all of them.

A row's logits come from its own model's weights and its own cache (no operation
mixes rows), so each proposal is still drawn from, and carries, its model's own
distribution. Prefills (new prompts, long catch-ups, prompt scoring) of several
members share passes the same way (`Stack.prefill`). The members still work alone
too: their weights become views of the stack, and they share the stack's KV pool,
where every member's sessions take their blocks.

Shapes: G stacked models, B sessions of a pass, V' the token maps' length.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable

import torch

from specfleet.engine import cpu_linear, cpu_pass, runner
from specfleet.engine.kv import KVPool, Session
from specfleet.engine.llama import Layer, LlamaModel, Runs
from specfleet.engine.loading import LoadedModel

log = logging.getLogger(__name__)

_MODEL_TENSORS = ("embed", "norm", "lm_head")
_LAYER_TENSORS = tuple(f.name for f in dataclasses.fields(Layer))


@dataclass
class Stack:
    """Same-shape models as one: `model`'s weights are [G, ...], `pool` holds every member's sessions."""

    members: list[LoadedModel]
    model: LlamaModel
    pool: KVPool
    token_maps: torch.Tensor | None  # [G, V'] int64 on the CPU, or None when the members have none
    max_context: int  # positions a session may use (the members share it)
    graphs: None = None  # a stack's passes run eagerly (`runner.forward_batch` reads this)

    def next_token_logits(self, sessions: list[Session], members: list[int]) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
        """Logits [B, V'] after each session's last token, row b from model members[b], in one pass,
        and the function from positions along them ([B] or [B, K], rows as given) to vocabulary ids."""
        if len(set(members)) == 1:  # one member's rows: its own pass, no per-run slicing
            alone = self.members[members[0]]
            return runner.next_token_logits(alone, sessions), alone.global_ids
        order = sorted(range(len(sessions)), key=members.__getitem__)
        device = self.model.device
        runs = Runs.of([members[b] for b in order], device)
        logits = runner.next_token_logits(self, [sessions[b] for b in order], runs)
        back = torch.empty(len(order), dtype=torch.long)
        back[order] = torch.arange(len(order))
        logits = logits[back.to(device)]
        row_members = torch.tensor(members, dtype=torch.long)

        def global_ids(local: torch.Tensor) -> torch.Tensor:
            if self.token_maps is None:
                return local
            return self.token_maps[row_members.view(-1, *[1] * (local.dim() - 1)), local.cpu()]

        return logits, global_ids

    def prepare(self) -> None:
        """Before serving, once: on a CPU with `linear: auto`, the members' bfloat16 kernel for passes of few rows,
        where every weight is a bfloat16 value (`cpu_linear.lay_out_stack`); otherwise the checkpoints' layout."""
        first = self.members[0]
        if first.linear != "auto" or self.model.device.type != "cpu" or self.model.dtype != torch.float32:
            return
        rows = cpu_linear.lay_out_stack(self)
        for member in self.members:  # a member's own passes (one model's rows) take its copies
            member.model.cpu_pass = cpu_pass.prepare(member.model)
        if rows:
            log.info(
                "stack of %s: bfloat16 copies for the kernel, serving up to %s rows per weight shape",
                ", ".join(m.name for m in self.members),
                ", ".join(f"{r} ({'x'.join(map(str, shape))})" for shape, r in rows.items()),
            )

    def prefill(
        self, sessions: list[Session], members: list[int], keep_last: int = 1, score: bool = False, ends: list[int] | None = None
    ) -> list[tuple[float, int]]:
        """`runner.prefill` of sessions of several members (session b is model members[b]'s), in shared passes."""
        return runner.prefill(self, sessions, keep_last, score, members=members, ends=ends)


def same_shape(a: LoadedModel, b: LoadedModel) -> bool:
    """Whether two loaded models can share a stack: every weight of the same shape, the same
    positions and RoPE, dtype, device and attention; neither replays CUDA graphs."""
    ma, mb = a.model, b.model
    if a.graphs is not None or b.graphs is not None or a.max_context != b.max_context or a.vocab_size != b.vocab_size:
        return False
    if a.kv_block_size != b.kv_block_size:
        return False
    if (a.token_map is None) != (b.token_map is None) or (a.token_map is not None and len(a.token_map) != len(b.token_map)):
        return False
    scalars = ("heads", "kv_heads", "head_dim", "eps", "attention", "dtype", "device", "num_layers")
    if any(getattr(ma, name) != getattr(mb, name) for name in scalars):
        return False
    pairs = [(getattr(ma, n), getattr(mb, n)) for n in _MODEL_TENSORS]
    pairs += [(getattr(la, n), getattr(lb, n)) for la, lb in zip(ma.layers, mb.layers) for n in _LAYER_TENSORS]
    if any((x is None) != (y is None) or (x is not None and x.shape != y.shape) for x, y in pairs):
        return False
    return torch.equal(ma.cos, mb.cos) and torch.equal(ma.sin, mb.sin)


def stack_models(models: list[LoadedModel]) -> list[Stack]:
    """Stack every group of two or more same-shape models (`same_shape`); a model with no twin stays alone.

    Call before any session is created: the members' KV pools are replaced by their stack's."""
    groups: list[list[LoadedModel]] = []
    for loaded in models:
        group = next((g for g in groups if same_shape(g[0], loaded)), None)
        if group is None:
            groups.append([loaded])
        else:
            group.append(loaded)
    return [_stack(group) for group in groups if len(group) > 1]


def _stack(members: list[LoadedModel]) -> Stack:
    first = members[0].model

    def stacked(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
        return None if tensors[0] is None else torch.stack(tensors)

    layers = [Layer(**{n: stacked([getattr(m.model.layers[i], n) for m in members]) for n in _LAYER_TENSORS}) for i in range(first.num_layers)]
    # Tied embeddings (the output layer is the embedding's storage) stay one tensor.
    tied = all(m.model.lm_head.data_ptr() == m.model.embed.data_ptr() and m.model.lm_head.shape == m.model.embed.shape for m in members)
    tensors = {n: stacked([getattr(m.model, n) for m in members]) for n in _MODEL_TENSORS if not (tied and n == "lm_head")}
    if tied:
        tensors["lm_head"] = tensors["embed"]
    model = LlamaModel(
        **tensors,
        layers=layers,
        cos=first.cos,
        sin=first.sin,
        heads=first.heads,
        kv_heads=first.kv_heads,
        head_dim=first.head_dim,
        eps=first.eps,
        attention=first.attention,
    )
    # Prefix caching keys each member's blocks by its model (the sessions' namespace: drafter_service/server.py).
    pool = KVPool(model, members[0].kv_block_size, prefix_caching=all(m.prefix_caching for m in members))
    for g, loaded in enumerate(members):
        # Views of the stack: the weights are held once.
        for n in _MODEL_TENSORS:
            setattr(loaded.model, n, getattr(model, n)[g])
        for own, shared in zip(loaded.model.layers, model.layers):
            for n in _LAYER_TENSORS:
                if getattr(shared, n) is not None:
                    setattr(own, n, getattr(shared, n)[g])
        loaded.pool = pool
    token_maps = None if members[0].token_map is None else torch.stack([m.token_map for m in members])
    return Stack(members, model, pool, token_maps, members[0].max_context)
