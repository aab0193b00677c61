"""One all-reduce and one message between two CPU ranks: gloo (torch.distributed) against shared memory
(`specfleet/engine/shared_memory.py`), each rank on a core of its own.

    PYTHONPATH=. .venv/bin/python scripts/tp_collectives.py [--calls 200]

Prints one JSON object per tensor shape and way: microseconds a call, the mean of `--calls` after 20 of warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from specfleet.engine.shared_memory import SharedMemory

SHAPES = [(8, 1, 256), (8, 1, 1024), (1, 512, 1024)]
# A decode pass's message for 8 sessions: what `runner.forward_batch` sends the other ranks.
MESSAGE = ("pass", [], ([[1]] * 8, [[256]] * 8, [0] * 8, [256] * 8, [1] * 8, [None] * 8, True, None))


def timed(call, calls: int) -> float:
    for _ in range(20):
        call()
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls * 1e6


def rank_main(rank: int, port: int, shm: str, calls: int) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shared = SharedMemory.create(shm, 2) if rank == 0 else None
    dist.barrier()  # rank 0's file exists
    shared = shared or SharedMemory.attach(shm, 1, 2)
    dist.barrier()
    rows = []
    for shape in SHAPES:
        x = torch.randn(shape)
        rows.append({"what": f"all-reduce {'x'.join(map(str, shape))}", "gloo_us": timed(lambda: dist.all_reduce(x), calls)})
        rows[-1]["shared_memory_us"] = timed(lambda: shared.all_reduce(x), calls)
    box = [MESSAGE]
    gloo = timed(lambda: dist.broadcast_object_list(box, src=0), calls)
    exchange = (lambda: shared.send(MESSAGE)) if rank == 0 else shared.receive
    rows.append({"what": "message (a decode pass of 8 sessions)", "gloo_us": gloo, "shared_memory_us": timed(exchange, calls)})
    shared.close()
    if rank == 0:
        for row in rows:
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--shm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.port, args.shm, args.calls)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shm = f"/dev/shm/specfleet-tp-bench-{os.getpid()}"
    common = ["--port", str(port), "--shm", shm, "--calls", str(args.calls)]
    other = subprocess.Popen([sys.executable, __file__, "--rank", "1", *common])
    rank_main(0, port, shm, args.calls)
    other.wait()


if __name__ == "__main__":
    main()
