"""CUDA graphs of batched forward passes, one per (sessions, tokens, positions) bucket; eager outside them.

A pass of B sessions x N new tokens runs as the graph of the smallest configured bucket (B',
N') with B <= B' and N <= N', over T' = the next power of two >= the pass's longest context (at
least MIN_POSITIONS, at most the pool's slot). Every bucket is captured at start-up
(`capture_all`, after the pool is sized for the cache budget), so no request waits for a
capture; a bucket missing then (the pool grew past its budget) is captured on first use. Every
input is copied into the graph's static tensors: token ids, positions, where each new token's
KV goes, which slots attention reads and the mask. The padding (sessions past B, tokens past
n_b) writes its KV into a scratch slot of the pool held by the graphs and sees position 0
alone, so it touches no session, and the rows handed back are the real ones. The graph runs the
same `llama.forward` code as an eager batched pass, over gathered slots (the graph's shapes
cannot depend on where slots lie); a graph changes no output (scripts/device-check compares
greedy tokens with and without graphs on the GPU).

When the pool grows its tensor is replaced, and every graph (which holds the old one) is
dropped and captured again on next use.
"""

from __future__ import annotations

import logging
import time

import torch

from specfleet.engine import llama

log = logging.getLogger(__name__)

# The shortest T' a graph attends over: shorter contexts pad to it. Below it a graph's attention
# costs little beside its projections, and each power of two under it would be one more capture.
MIN_POSITIONS = 64


class CudaGraphs:
    def __init__(self, loaded, sizes: list[tuple[int, int]]):
        self.loaded = loaded
        self.sizes = sorted((int(b), int(n)) for b, n in sizes)
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._generation = -1
        self._scratch: int | None = None
        self._memory = None

    def bucket(self, batch: int, width: int, total: int) -> tuple[int, int, int] | None:
        """The smallest configured (B', N') that holds the pass, with T' positions, or None (eager)."""
        fits = [(b, n) for b, n in self.sizes if batch <= b and width <= n]
        if not fits:
            return None
        b, n = min(fits, key=lambda size: size[0] * size[1])
        return b, n, min(max(MIN_POSITIONS, 1 << (total - 1).bit_length()), self.loaded.pool.positions)

    def positions(self) -> list[int]:
        """Every T' a pass can get: powers of two from MIN_POSITIONS, then the pool's slot."""
        limit, t, found = self.loaded.pool.positions, MIN_POSITIONS, []
        while t < limit:
            found.append(t)
            t *= 2
        return found + [limit]

    def capture_all(self) -> int:
        """Capture every (B', N', T') bucket now; how many graphs there are."""
        started = time.perf_counter()
        for b, n in self.sizes:
            for t in self.positions():
                self._graph((b, n, t))
        log.info(
            "captured %d CUDA graphs (sessions x tokens %s, positions %s) in %.1fs",
            len(self._graphs),
            self.sizes,
            self.positions(),
            time.perf_counter() - started,
        )
        return len(self._graphs)

    def run(self, ids_rows, pos_rows, slots, kv_lens, new_lens, attends, logits: bool) -> torch.Tensor | None:
        """Logits [B, N, V] as `llama.forward` gives them, or None when no bucket holds the pass."""
        batch, width = len(ids_rows), len(ids_rows[0])
        total = max(k + n for k, n in zip(kv_lens, new_lens))
        key = self.bucket(batch, width, total)
        if key is None or not logits:
            return None
        return self._graph(key).replay(ids_rows, pos_rows, slots, kv_lens, new_lens, attends)

    def release(self) -> None:
        """Drop every graph and give the scratch slot back to the pool."""
        self._graphs.clear()
        if self._scratch is not None:
            self.loaded.pool.release(self._scratch)
            self._scratch = None
        self._memory = None

    def _graph(self, key: tuple[int, int, int]) -> "_Graph":
        """The bucket's graph, captured if the pool's tensor is new to it."""
        pool = self.loaded.pool
        if self._scratch is None:
            self._scratch = pool.acquire()  # may grow the pool: before the generation is read
        if pool.generation != self._generation:
            if self._graphs:
                log.warning("the KV pool grew to %d slots: its CUDA graphs are captured again on use", pool.slots)
            self._graphs.clear()
            self._generation = pool.generation
        graph = self._graphs.get(key)
        if graph is None:
            if self._memory is None:
                self._memory = _Graph.memory_pool()
            graph = self._graphs[key] = _Graph(self.loaded.model, pool.kv, *key, self._scratch, self._memory)
            log.debug("captured a CUDA graph for %d sessions x %d tokens over %d positions", *key)
        return graph


class _Graph:
    def __init__(self, model, kv: torch.Tensor, sessions: int, tokens: int, positions: int, scratch: int, memory):
        device = model.device
        self.model, self.kv, self.sessions, self.tokens, self.scratch = model, kv, sessions, tokens, scratch
        long = dict(dtype=torch.long, device=device)
        self.ids = torch.zeros(sessions, tokens, **long)
        self.positions = torch.zeros(sessions, tokens, **long)
        # Until the first replay every row writes into the scratch slot and reads it alone.
        rows = sessions * tokens
        self.plan = llama._BatchPlan(
            write_b=torch.arange(sessions, **long).repeat_interleave(tokens),
            write_j=torch.arange(tokens, **long).repeat(sessions),
            write_slot=torch.full((rows,), scratch, **long),
            write_pos=torch.arange(tokens, **long).repeat(sessions),
            keys=torch.full((sessions,), scratch, **long),
            rows=None,
            total=positions,
            bias=llama.ragged_bias(model, [0] * sessions, [0] * sessions, [None] * sessions, tokens, positions).unsqueeze(1),
        )
        self.out: torch.Tensor | None = None
        self.graph = self._capture(memory)

    @staticmethod
    def memory_pool():
        """One memory pool shared by a model's graphs."""
        return torch.cuda.graph_pool_handle()

    def _forward(self) -> torch.Tensor:
        return llama.forward(self.model, self.ids, self.positions, self.kv, None, None, None, None, plan=self.plan)

    def _capture(self, memory) -> torch.cuda.CUDAGraph:
        """The pass captured as a graph whose replay leaves its logits in self.out."""
        device = self.ids.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the capture (kernel selection, workspace)
                self._forward()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=memory):
            self.out = self._forward()
        return graph

    def replay(self, ids_rows, pos_rows, slots, kv_lens, new_lens, attends) -> torch.Tensor:
        batch, width = len(ids_rows), len(ids_rows[0])
        S, N, plan = self.sessions, self.tokens, self.plan
        pad_b, pad_n = S - batch, N - width
        ids = [row + [0] * pad_n for row in ids_rows] + [[0] * N] * pad_b
        pos = [row + [0] * pad_n for row in pos_rows] + [[0] * N] * pad_b
        write_slot = [slots[b] if b < batch and j < new_lens[b] else self.scratch for b in range(S) for j in range(N)]
        write_pos = [kv_lens[b] + j if b < batch and j < new_lens[b] else j for b in range(S) for j in range(N)]
        device = self.ids.device
        to_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        self.ids.copy_(to_tensor(ids))
        self.positions.copy_(to_tensor(pos))
        plan.write_slot.copy_(to_tensor(write_slot))
        plan.write_pos.copy_(to_tensor(write_pos))
        plan.keys.copy_(to_tensor(list(slots) + [self.scratch] * pad_b))
        bias = llama.ragged_bias(self.model, list(kv_lens) + [0] * pad_b, list(new_lens) + [0] * pad_b, list(attends) + [None] * pad_b, N, plan.total)
        plan.bias.copy_(bias.unsqueeze(1))
        self.graph.replay()
        return self.out[:batch, :width].clone()
