"""The ranks' shared memory (specfleet/engine/shared_memory.py), two ranks as two threads: sums and gathers in
pieces larger than its buffers, the same on every rank, and rank 0's messages in order across slot reuse."""

from __future__ import annotations

import threading

import torch

from specfleet.engine import shared_memory
from specfleet.engine.shared_memory import SharedMemory


def test_two_ranks_sum_gather_and_message_through_shared_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(shared_memory, "PART_BYTES", 64)  # 16 floats: every collective below goes in pieces
    path = str(tmp_path / "shm")
    ranks = [SharedMemory.create(path, 2)]
    ranks.append(SharedMemory.attach(path, 1, 2))
    inputs = [torch.randn(3, 50, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    results: dict[int, list] = {0: [], 1: []}

    def run(rank: int) -> None:
        me = ranks[rank]
        for step in range(3):  # the same slots again and again
            x = inputs[rank] * (step + 1)
            results[rank].append(me.all_reduce(x.clone()))
            results[rank].append(me.all_gather(x[:, :7]))
        if rank == 0:
            for i in range(5):
                me.send(("message", i, list(range(i))))
        else:
            results[rank].append([me.receive() for _ in range(5)])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for step in range(3):
        expected = (inputs[0] + inputs[1]) * (step + 1)
        torch.testing.assert_close(results[0][2 * step], expected)
        assert torch.equal(results[0][2 * step], results[1][2 * step])  # bit for bit on every rank
        gathered = torch.cat([inputs[0][:, :7], inputs[1][:, :7]], dim=1) * (step + 1)
        assert torch.equal(results[0][2 * step + 1], gathered) and torch.equal(results[1][2 * step + 1], gathered)
    assert results[1][-1] == [("message", i, list(range(i))) for i in range(5)]
    ranks[0].close()
    assert not (tmp_path / "shm").exists()
