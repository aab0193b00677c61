"""Tensor parallelism: one model split over several processes (ranks), one device each, on one node.

Megatron's split, as vLLM and SGLang run it: each rank holds a slice of every layer's attention heads (q, k and
v projections by rows, the output projection by columns) and of the MLP's intermediate width (gate and up by
rows, down by columns), and its heads' KV cache. A layer's output projection and its down projection each give
a partial sum that one all-reduce completes, so every rank holds the whole hidden state between layers. The
output layer is split by vocabulary: each rank scores its slice and the slices are gathered. Embeddings, norms
and RoPE are whole on every rank.

Rank 0 is the service: it holds the sessions, their block tables and the prefix cache, and before every pass
sends the others what the pass runs (`Group.send`: token ids, positions, where each session's blocks lie, its
attention pattern) with the KV copies its pool made since the last pass (`kv.KVPool.log`: a relocated session,
a tree's accepted path, growth). The others (`rank.serve`) replay the copies on their own KV and run the same
pass, so every rank runs the same shapes in the same order, CUDA graphs included. Collectives run on NCCL
between GPUs and through shared memory between CPUs (`shared_memory.py`, where rank 0's messages go too).

Rank 0 starts the others (`launch`: a Python process each, `rank.main`, loading its own slices of the
checkpoint; under Ray, an actor each in its placement group, `ray_ranks.py`) and dies with them: a rank that
exits makes rank 0 exit, so the supervisor (`specfleet serve`, or Ray) restarts the whole group and the router
moves the replica's requests on meanwhile; a rank whose rank 0 is gone exits too (`rank.main` watches its
parent; Ray ends the actors an actor created when it dies); a rank 0 whose own load fails ends the others
(`Group.abandon`). The embedding stays whole on every rank (a 70B Llama's is 2 GB in bf16).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from specfleet.engine.shared_memory import SharedMemory

log = logging.getLogger(__name__)

# How long ranks wait for each other to start (each loads its slices of the checkpoint meanwhile).
START_TIMEOUT = datetime.timedelta(minutes=10)


def check_divisible(config, size: int) -> None:
    """Raise ValueError naming `tensor_parallel_size` where the model's heads or widths cannot be split `size` ways."""
    if size == 1:
        return
    heads, kv_heads, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    # Fewer key/value heads than ranks: each rank keeps the one its query heads read (vLLM replicates them too).
    if heads % size or (kv_heads % size and size % kv_heads) or inter % size:
        raise ValueError(
            f"tensor_parallel_size {size} does not split the model: it must divide its {heads} attention heads and its "
            f"intermediate size {inter}, and divide its {kv_heads} key/value heads or be a multiple of them"
        )


def kv_heads_of(kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """[first, end) of the key/value heads rank `rank` holds: its share, or the one head its query heads read."""
    if kv_heads >= size:
        share = kv_heads // size
        return rank * share, (rank + 1) * share
    head = rank * kv_heads // size
    return head, head + 1


def slicer(config, rank: int, size: int) -> Callable[[str], tuple[slice, ...] | None]:
    """For a checkpoint tensor's name: the slice of it rank `rank` holds, or None where it holds all of it.

    The output layer (lm_head) is whole here: it is split by vocabulary after a draft token map picks its rows
    (`shard_vocab`)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    q = slice(rank * heads // size * head_dim, (rank + 1) * heads // size * head_dim)
    first, end = kv_heads_of(config.num_key_value_heads, rank, size)
    kv = slice(first * head_dim, end * head_dim)
    share = config.intermediate_size // size
    inter = slice(rank * share, (rank + 1) * share)
    rules = {
        "self_attn.q_proj": (q,),
        "self_attn.k_proj": (kv,),
        "self_attn.v_proj": (kv,),
        "self_attn.o_proj.weight": (slice(None), q),  # its bias is added once, after the all-reduce
        "mlp.gate_proj": (inter,),
        "mlp.up_proj": (inter,),
        "mlp.down_proj.weight": (slice(None), inter),
    }

    def of(name: str) -> tuple[slice, ...] | None:
        if size == 1 or not name.startswith("model.layers."):
            return None
        part = name.split(".", 3)[3]  # model.layers.<i>.<part>
        return next((cut for key, cut in rules.items() if part == key or part.startswith(key + ".")), None)

    return of


def shard_vocab(lm_head: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s rows of the output layer [V, E]: the vocabulary in `size` equal slices, the last padded with zeros."""
    rows = -(-lm_head.shape[0] // size)
    part = lm_head[rank * rows : (rank + 1) * rows]
    if part.shape[0] < rows:
        part = torch.cat([part, part.new_zeros(rows - part.shape[0], part.shape[1])])
    return part.contiguous()


# Collectives between CPU ranks: shared memory (`shared_memory.py`), or gloo, which measures 40 times slower
# there and is kept as the torch.distributed path the tests can run without a GPU (SPECFLEET_TP_CPU_COLLECTIVES=gloo).
CPU_COLLECTIVES = ("shm", "gloo")


@dataclass
class Group:
    """This process's rank in a model's tensor-parallel group: the collectives of its pass, and rank 0's messages."""

    rank: int
    size: int
    shared: SharedMemory  # rank 0's messages; the collectives too unless `distributed`
    # The collectives run on torch.distributed's default group: NCCL between GPUs, gloo where asked for.
    distributed: bool
    # Rank 0: the other ranks, child processes or Ray actors (`ray_ranks.RayRank`), both with wait() and kill().
    workers: list = field(default_factory=list)
    closing: bool = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x (contiguous) summed over the ranks, in place."""
        if self.distributed:
            dist.all_reduce(x)
            return x
        return self.shared.all_reduce(x)

    def gather_vocab(self, x: torch.Tensor, vocab: int) -> torch.Tensor:
        """[..., vocab]: every rank's slice of the output layer's scores [..., V / size], in rank order."""
        if not self.distributed:
            return self.shared.all_gather(x)[..., :vocab]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)[..., :vocab]

    def ready(self) -> None:
        """Every rank, once its model is loaded: wait for all the others; then rank 0 removes the shared memory's
        file (the mappings stay), so that nothing is left in /dev/shm however the group ends."""
        self.shared.all_reduce(torch.zeros(1))
        self.shared.close()

    def send(self, message) -> None:
        """Rank 0: hand the other ranks a message (`serve` says which)."""
        self.shared.send(message)

    def receive(self):
        return self.shared.receive()

    def close(self) -> None:
        """Rank 0: stop the other ranks and leave the group."""
        if self.closing:
            return
        self.closing = True
        try:
            self.shared.send(("stop",), timeout_s=10.0)
        except TimeoutError:  # a rank already gone, or stuck: killed below
            pass
        for worker in self.workers:
            try:
                worker.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            worker.kill()  # stuck; or exited (a process: nothing to do; an actor: its bundle freed)
        if self.distributed:
            dist.destroy_process_group()

    def abandon(self) -> None:
        """Rank 0, when its own load fails after it started the others: end them (they wait for it to be ready) and
        remove the shared memory's file, so that a failed start leaves nothing behind."""
        self.closing = True
        for worker in self.workers:
            worker.kill()
        self.shared.close()
        if self.distributed:
            dist.destroy_process_group()


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the rank-th GPU from the configured one, or the CPU."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def join(rank: int, size: int, where: dict, device: torch.device) -> Group:
    """A rank other than 0: join the group rank 0 set up in `launch` (`where`: its shared memory's path, its
    rendezvous port, the CPU collectives)."""
    return _connect(rank, size, where, device, SharedMemory.attach(where["shm"], rank, size))


def _connect(rank: int, size: int, where: dict, device: torch.device, shared: SharedMemory) -> Group:
    distributed = device.type == "cuda" or where["collectives"] == "gloo"
    if distributed:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{where['port']}", rank=rank, world_size=size, timeout=START_TIMEOUT)
    return Group(rank, size, shared, distributed)


def alone(device: torch.device) -> Group:
    """A group of one rank on torch.distributed (NCCL on a GPU, gloo on a CPU): `load_model(group=alone(device))` runs
    a model through a split model's code path, collectives and all, with nothing split. What the GPU check runs on
    its one GPU, where two NCCL ranks cannot share the card (tests/engine/test_parallel.py). `Group.close` ends it."""
    where = _meeting_point("gloo", own_device=True)
    return _connect(0, 1, where, device, SharedMemory.create(where["shm"], 1))


def _meeting_point(collectives: str, own_device: bool) -> dict:
    """Where a group's ranks meet: a /dev/shm file and a free port on 127.0.0.1 (named by rank 0's pid and the port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {"shm": f"/dev/shm/specfleet-tp-{os.getpid()}-{port}", "port": port, "collectives": collectives, "own_device": own_device}


# What a rank other than 0 runs (`rank.main`; not `-m`: the package imports the engine's modules before runpy would run it).
_RANK_MAIN = "import sys; from specfleet.engine.rank import main; sys.exit(main(sys.argv[1:]))"


def launch(
    spec: dict, size: int, device: torch.device, on_lost: Callable[[int, int], None] | None = None, start: Callable[[list[str]], list] | None = None
) -> Group:
    """Rank 0: start ranks 1..size-1, each loading the model `spec` names (`load_model`'s keywords), and join them.

    start: from one spec (JSON) per rank, the ranks started elsewhere, each on a device of its own (`ray_ranks.start`:
    Ray actors, which see only their own GPU), as objects with wait() and kill(); None: child processes of this one,
    rank r on the r-th GPU from `device`.

    on_lost(rank, exit code) runs when one of them exits before `Group.close`; by default this process exits
    (a replica that lost a rank cannot serve: its supervisor restarts the whole group)."""
    collectives = os.environ.get("SPECFLEET_TP_CPU_COLLECTIVES", "shm")
    if collectives not in CPU_COLLECTIVES:
        raise ValueError(f"SPECFLEET_TP_CPU_COLLECTIVES must be one of {list(CPU_COLLECTIVES)}, got {collectives!r}")
    where = _meeting_point(collectives, own_device=start is not None)
    shared = SharedMemory.create(where["shm"], size)  # before the others start, which open it
    specs = [json.dumps({**spec, "rank": r, "size": size, "where": where}) for r in range(1, size)]
    workers = start(specs) if start is not None else [subprocess.Popen([sys.executable, "-c", _RANK_MAIN, s, str(os.getpid())]) for s in specs]
    group = _connect(0, size, where, device, shared)
    group.workers = workers
    for rank, worker in enumerate(workers, start=1):
        threading.Thread(target=_watch, args=(group, rank, worker, on_lost or _lost), daemon=True, name=f"tp-rank-{rank}").start()
    return group


def _watch(group: Group, rank: int, worker, on_lost: Callable[[int, int], None]) -> None:
    code = worker.wait()
    if not group.closing:
        on_lost(rank, code)


def abort(err: BaseException) -> None:
    """Rank 0 failed inside a pass the other ranks run too: they wait in its collectives, so the group cannot go on.
    This process exits (its supervisor restarts the whole group), as when a rank dies."""
    log.error("tensor-parallel rank 0 failed inside a pass (%r): this replica stops, to be restarted with all its ranks", err)
    logging.shutdown()
    os._exit(70)


def _lost(rank: int, code: int) -> None:
    log.error("tensor-parallel rank %d exited (code %s): this replica stops, to be restarted with all its ranks", rank, code)
    logging.shutdown()
    os._exit(70)
