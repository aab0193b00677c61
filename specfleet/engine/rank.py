"""A tensor-parallel rank other than 0: its process, started by rank 0 (`parallel.launch`: a child process, or a
Ray actor, `ray_ranks.py`), and its loop.

It joins the group, loads its slices of the model (`load_model(group=...)`), then runs what rank 0 sends
(`serve`) until rank 0 says stop, or exits once rank 0 is gone.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time

import torch.distributed as dist

from specfleet.engine import parallel, runner
from specfleet.engine.loading import LoadedModel, configure_torch, load_model, resolve_device


def serve(loaded: LoadedModel) -> None:
    """Run rank 0's messages until it says stop: ("prepare", max cache bytes, max sessions): `LoadedModel.prepare`;
    ("pass", KV copies, the pass's inputs): replay the copies (`kv.KVPool.replay`), then `runner.execute` the pass."""
    group = loaded.model.parallel
    while True:
        kind, *args = group.receive()
        if kind == "stop":
            return
        if kind == "prepare":
            loaded.prepare(*args)
        elif kind == "pass":
            ops, call = args
            loaded.pool.replay(ops)
            runner.execute(loaded, *runner.on_device(call, loaded.model.device))


def _die_with_parent(parent: int) -> None:
    """Exit once rank 0, the parent (its pid, as rank 0 gave it), is gone, however it went: a rank alone serves
    nothing and holds a device. Rank 0 names itself because it may die before this runs, and the pid this process
    would read as its parent's is then the one it was handed to.

    Polled rather than Linux's parent-death signal, which follows the thread that started the process, and
    rank 0 may start its ranks from a thread that ends (a Ray actor's, a loader's)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    if os.getppid() != parent:
        os._exit(0)
    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def main(argv: list[str]) -> int:
    """A child process of rank 0 (`parallel.launch`), from its spec as JSON and rank 0's pid."""
    _die_with_parent(int(argv[1]))
    # Rank 0 stops it (a stop message, or by going away): a signal to the process group is rank 0's to handle.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    spec = json.loads(argv[0])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{spec['rank']} %(levelname)s %(message)s")
    return run(spec)


def run(spec: dict) -> int:
    """Join the group, load this rank's slices and `serve`, from its spec (`load_model`'s keywords, rank, size, where
    the group meets, threads); a child process's or a Ray actor's (`ray_ranks.RankActor`)."""
    rank, size, where, threads = spec.pop("rank"), spec.pop("size"), spec.pop("where"), spec.pop("threads")
    configure_torch(threads)
    device = resolve_device(spec["device"])
    # A Ray actor sees only its own GPU (Ray sets CUDA_VISIBLE_DEVICES); a child process sees the node's.
    group = parallel.join(rank, size, where, device if where.get("own_device") else parallel.rank_device(device, rank))
    serve(load_model(**spec, group=group))
    if group.distributed:
        dist.destroy_process_group()
    return 0
