"""Where a service's process runs, and whether a drafter can draft while the verifier verifies.

The router's pipelined lanes (router/scheduler.py) hide drafting behind verification only when the
two run at the same time. Drafters on other hosts or devices do; a drafter pinned to the
verifier's only core does not: its lanes merely queue behind each other at the verifier (measured
in docs/benchmarks/pipelining-shared-cores.md), and the router runs one lane instead.
"""

from __future__ import annotations

import os
import socket


def describe(info, threads: int | None = None) -> None:
    """Fill a ModelInfo's host, cpus and threads with this process's (threads: its torch threads unless given)."""
    info.host = socket.gethostname()
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    info.cpus.extend(sorted(cores))
    if threads is None:
        import torch

        threads = torch.get_num_threads()
    info.threads = threads


def here():
    """This process (the router, one busy thread) as a ModelInfo: its host and cores."""
    from specfleet.v1 import common_pb2

    info = common_pb2.ModelInfo()
    describe(info, threads=1)
    return info


def can_overlap(verifier, drafter, router=None) -> bool:
    """Whether the drafter (a ModelInfo) can compute while the verifier (a ModelInfo) does. The router
    (when given, and on the same host) needs a core of its own too: it runs every round between them."""
    if not verifier.host or not drafter.host or verifier.host != drafter.host:
        return True  # another machine (or a service that does not say)
    v_gpu, d_gpu = verifier.device.startswith("cuda"), drafter.device.startswith("cuda")
    if v_gpu or d_gpu:
        return not (v_gpu and d_gpu and verifier.device == drafter.device)
    # Both on this host's CPUs: together they need as many cores as their threads.
    cores = set(verifier.cpus) | set(drafter.cpus)
    needed = max(1, verifier.threads) + max(1, drafter.threads)
    if router is not None and router.host == verifier.host and cores & set(router.cpus):
        cores |= set(router.cpus)
        needed += max(1, router.threads)
    return len(cores) >= needed
