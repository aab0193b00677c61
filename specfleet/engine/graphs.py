"""CUDA graphs of batched forward passes, one per (sessions, tokens, positions) bucket; eager outside them.

A pass of B sessions x N new tokens runs as the graph of the smallest configured bucket (B',
N') with B <= B' and N <= N', over T' = the next power of two >= the pass's longest context (at
least MIN_POSITIONS); a pass longer than MAX_POSITIONS, or than the model's context, runs
eagerly. Every bucket is captured at start-up
(`capture_all`, after the pool is sized for the cache budget), so no request waits for a
capture; a bucket missing then (the pool grew past its budget) is captured on first use. Every
input is copied into the graph's static tensors: token ids, positions, where each new token's
KV goes, which positions of the pool attention reads and the mask. The padding (sessions past
B, tokens past n_b) writes its KV into the pool's scratch block and sees position 0 alone, so
it touches no session, and the rows handed back are the real ones. The graph runs the same
`llama.forward` code as an eager batched pass; a graph changes no output (scripts/device-check compares
greedy tokens with and without graphs on the GPU).

When the pool grows its tensor is replaced, and every graph (which holds the old one) is
dropped and captured again on next use.
"""

from __future__ import annotations

import logging
import time

import torch

from specfleet.engine import attention, llama

log = logging.getLogger(__name__)

# The shortest T' a graph attends over: shorter contexts pad to it. Below it a graph's attention
# costs little beside its projections, and each power of two under it would be one more capture.
MIN_POSITIONS = 64
# The longest T' a graph attends over: its padded reads ([B', T'] positions of every layer) grow
# with it, and a pass that long costs enough for a graph's launch savings not to matter.
MAX_POSITIONS = 8192


class CudaGraphs:
    def __init__(self, loaded, sizes: list[tuple[int, int]]):
        self.loaded = loaded
        self.sizes = sorted((int(b), int(n)) for b, n in sizes)
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._generation = -1
        self._memory = None

    def bucket(self, batch: int, width: int, total: int) -> tuple[int, int, int] | None:
        """The smallest configured (B', N') that holds the pass, with T' positions, or None (eager)."""
        fits = [(b, n) for b, n in self.sizes if batch <= b and width <= n]
        if not fits:
            return None
        b, n = min(fits, key=lambda size: size[0] * size[1])
        if total > self.positions()[-1]:
            return None
        return b, n, min(max(MIN_POSITIONS, 1 << (total - 1).bit_length()), self.positions()[-1])

    def positions(self) -> list[int]:
        """Every T' a pass can get: powers of two from MIN_POSITIONS, then the longest (the model's context or MAX_POSITIONS)."""
        limit, t, found = min(self.loaded.max_context, MAX_POSITIONS), MIN_POSITIONS, []
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

    def run(self, ids_rows, pos_rows, places, kv_lens, new_lens, attends, logits: bool) -> torch.Tensor | None:
        """Logits [B, N, V] as `llama.forward` gives them, or None when no bucket holds the pass."""
        batch, width = len(ids_rows), len(ids_rows[0])
        total = max(k + n for k, n in zip(kv_lens, new_lens))
        key = self.bucket(batch, width, total)
        if key is None or not logits:
            return None
        return self._graph(key).replay(ids_rows, pos_rows, places, kv_lens, new_lens, attends)

    def release(self) -> None:
        """Drop every graph."""
        self._graphs.clear()
        self._memory = None

    def _graph(self, key: tuple[int, int, int]) -> "_Graph":
        """The bucket's graph, captured if the pool's tensor is new to it."""
        pool = self.loaded.pool
        if pool.generation != self._generation:
            if self._graphs:
                log.warning("the KV pool grew to %d blocks: its CUDA graphs are captured again on use", pool.blocks)
            self._graphs.clear()
            self._generation = pool.generation
        graph = self._graphs.get(key)
        if graph is None:
            if self._memory is None:
                self._memory = _Graph.memory_pool()
            graph = self._graphs[key] = _Graph(self.loaded.model, pool.kv, *key, self._memory)
            log.debug("captured a CUDA graph for %d sessions x %d tokens over %d positions", *key)
        return graph


class _Graph:
    def __init__(self, model, kv: torch.Tensor, sessions: int, tokens: int, positions: int, memory):
        device = model.device
        self.model, self.kv, self.sessions, self.tokens = model, kv, sessions, tokens
        long = dict(dtype=torch.long, device=device)
        self.ids = torch.zeros(sessions, tokens, **long)
        self.positions = torch.zeros(sessions, tokens, **long)
        # Until the first replay every row writes into the pool's scratch block (index 0) and reads it alone.
        rows = sessions * tokens
        self.plan = attention.BatchPlan(
            write_b=torch.arange(sessions, **long).repeat_interleave(tokens),
            write_j=torch.arange(tokens, **long).repeat(sessions),
            write_index=torch.zeros(rows, **long),
            read_index=torch.zeros(sessions, positions, **long),
            bias=attention.ragged_bias(model, [0] * sessions, [0] * sessions, [None] * sessions, tokens, positions).unsqueeze(1),
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

    def replay(self, ids_rows, pos_rows, places, kv_lens, new_lens, attends) -> torch.Tensor:
        batch, width = len(ids_rows), len(ids_rows[0])
        S, N, plan = self.sessions, self.tokens, self.plan
        pad_b, pad_n = S - batch, N - width
        ids = [row + [0] * pad_n for row in ids_rows] + [[0] * N] * pad_b
        pos = [row + [0] * pad_n for row in pos_rows] + [[0] * N] * pad_b
        device = self.ids.device
        to_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        self.ids.copy_(to_tensor(ids))
        self.positions.copy_(to_tensor(pos))
        # Each session's positions [0, T') on the pool's token axis; padding (past its length, or past B) at 0.
        total = plan.read_index.shape[1]
        read = attention.read_index(places, [k + n for k, n in zip(kv_lens, new_lens)], total, S, device)
        # Token j of row b writes where its position lies, read[b, kv_len + j]; padding tokens into the scratch block.
        lens = torch.tensor([list(kv_lens) + [0] * pad_b, list(new_lens) + [0] * pad_b], dtype=torch.long).to(device)
        j = torch.arange(N, device=device)
        columns = (lens[0][:, None] + j).clamp(max=total - 1)
        write = torch.where(j < lens[1][:, None], read.gather(1, columns), 0)
        plan.read_index.copy_(read)
        plan.write_index.copy_(write.view(-1))
        bias = attention.ragged_bias(self.model, list(kv_lens) + [0] * pad_b, list(new_lens) + [0] * pad_b, list(attends) + [None] * pad_b, N, total)
        plan.bias.copy_(bias.unsqueeze(1))
        self.graph.replay()
        return self.out[:batch, :width].clone()
