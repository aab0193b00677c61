"""The ranks of one node talking through shared memory: rank 0's messages, and CPU ranks' all-reduce and gather.

Why not gloo between CPU ranks: on this project's CI machine a gloo all-reduce of a decode step's hidden
states between two processes costs about 40 times what it costs through shared memory, and rank 0's message
for a pass about 60 times (docs/benchmarks/tensor-parallel.md: scripts/tp_collectives.py). vLLM's CPU backend makes the same
choice. GPUs keep NCCL (`parallel.Group`); their messages come here too.

The file (/dev/shm) holds a flag per rank per purpose, each on its own cache line, and two slots of every
buffer. A collective's n-th call uses slot n % 2: each rank writes its part there and raises its flag to n,
waits until every rank's flag is n, then reads every part. A rank can only be writing slot n % 2 again at call
n + 2, after every rank raised its flag to n + 1, which each does only once it has read call n's parts: so no
part is overwritten before all have read it, with no second barrier. Every rank sums the parts in rank order,
so all ranks hold the same sums, bit for bit. A message works the same way, rank 0 writing and the others
acknowledging. Waiting spins briefly, then yields the core, then sleeps (a rank idle between passes wakes
within a millisecond).
"""

from __future__ import annotations

import mmap
import os
import pickle
import time

import numpy as np
import torch

LINE = 64  # bytes: one flag per cache line
# Bytes a collective's part or a message may take in one go; larger ones go in pieces (collectives) or are refused.
PART_BYTES = 4 << 20
MESSAGE_BYTES = 4 << 20
_SPINS = 2000  # checks before yielding the core
_YIELD_S = 0.01  # then yields the core for this long before sleeping (between passes of a busy service)


class SharedMemory:
    """One node's ranks over a file in /dev/shm that rank 0 creates (`create`) and the others open (`attach`)."""

    def __init__(self, path: str, rank: int, size: int, fd: int):
        self.path, self.rank, self.size = path, rank, size
        self._flag_bytes = 3 * size * LINE  # reduce flags, message acknowledgements, then message sequence (rank 0's)
        total = self._flag_bytes + 2 * size * PART_BYTES + 2 * MESSAGE_BYTES
        self._map = mmap.mmap(fd, total)
        os.close(fd)
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=self._flag_bytes // 8)
        self._parts = torch.frombuffer(self._map, dtype=torch.uint8, count=2 * size * PART_BYTES, offset=self._flag_bytes).view(2, size, PART_BYTES)
        self._messages = np.frombuffer(self._map, dtype=np.uint8, count=2 * MESSAGE_BYTES, offset=self._flag_bytes + 2 * size * PART_BYTES)
        self._calls = 0  # collectives so far
        self._sent = 0  # messages so far

    @staticmethod
    def create(path: str, size: int) -> "SharedMemory":
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 3 * size * LINE + 2 * size * PART_BYTES + 2 * MESSAGE_BYTES)
        return SharedMemory(path, 0, size, fd)

    @staticmethod
    def attach(path: str, rank: int, size: int) -> "SharedMemory":
        return SharedMemory(path, rank, size, os.open(path, os.O_RDWR))

    def _flag(self, kind: int, rank: int) -> int:
        return (kind * self.size + rank) * LINE // 8

    def _wait(self, ready, timeout_s: float | None = None) -> None:
        spins, since = 0, None
        while not ready():
            spins += 1
            if spins < _SPINS:
                continue
            since = since or time.monotonic()
            if timeout_s is not None and time.monotonic() - since > timeout_s:
                raise TimeoutError(f"the other ranks did not answer within {timeout_s} s")
            if time.monotonic() - since < _YIELD_S:
                os.sched_yield()
            else:
                time.sleep(0.0005)

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """[size, n] of x's dtype: every rank's flattened x (n elements, at most PART_BYTES), once all have written."""
        self._calls += 1
        slot, nbytes = self._calls % 2, x.numel() * x.element_size()
        self._parts[slot, self.rank, :nbytes].copy_(x.reshape(-1).view(torch.uint8))
        flags, calls = self._flags, self._calls
        flags[self._flag(0, self.rank)] = calls
        self._wait(lambda: all(flags[self._flag(0, r)] >= calls for r in range(self.size)))
        return self._parts[slot, :, :nbytes].view(x.dtype)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (x contiguous), the parts added in rank order on every rank."""
        flat = x.view(-1)
        step = PART_BYTES // x.element_size()
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            torch.sum(self._exchange(piece), dim=0, out=piece)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., size * m]: every rank's x [..., m] side by side along the last dimension, in rank order."""
        rows = x.reshape(-1, x.shape[-1])
        out = torch.empty(rows.shape[0], self.size, x.shape[-1], dtype=x.dtype)
        step = max(1, PART_BYTES // (x.shape[-1] * x.element_size()))
        for start in range(0, rows.shape[0], step):
            piece = rows[start : start + step].contiguous()
            out[start : start + step] = self._exchange(piece).view(self.size, *piece.shape).transpose(0, 1)
        return out.view(*x.shape[:-1], self.size * x.shape[-1])

    def send(self, message, timeout_s: float | None = None) -> None:
        """Rank 0: a message for every other rank (a picklable object of at most MESSAGE_BYTES pickled); waits at most
        timeout_s (None: as long as it takes) for them to have read the one before the last."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) + 8 > MESSAGE_BYTES:
            raise ValueError(f"a tensor-parallel message of {len(data)} bytes exceeds the {MESSAGE_BYTES} shared for it")
        flags, sent = self._flags, self._sent + 1
        # Its slot last held message sent - 2: every rank must have read that one.
        self._wait(lambda: all(flags[self._flag(1, r)] >= sent - 2 for r in range(1, self.size)), timeout_s)
        base = (sent % 2) * MESSAGE_BYTES
        self._messages[base : base + 8] = np.frombuffer(len(data).to_bytes(8, "little"), dtype=np.uint8)
        self._messages[base + 8 : base + 8 + len(data)] = np.frombuffer(data, dtype=np.uint8)
        self._sent = sent
        flags[self._flag(2, 0)] = sent

    def receive(self):
        """The next message of rank 0, once it is there."""
        flags, wanted = self._flags, self._sent + 1
        self._wait(lambda: flags[self._flag(2, 0)] >= wanted)
        base = (wanted % 2) * MESSAGE_BYTES
        length = int.from_bytes(self._messages[base : base + 8].tobytes(), "little")
        message = pickle.loads(self._messages[base + 8 : base + 8 + length].tobytes())
        self._sent = wanted
        flags[self._flag(1, self.rank)] = wanted
        return message

    def close(self) -> None:
        """Rank 0: remove the file (the ranks' mappings stay valid until they exit)."""
        if self.rank == 0:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
