"""Where a service's process runs, and whether a drafter can draft while the verifier verifies.

The router's pipelined lanes (router/scheduler.py) hide drafting behind verification only when the
two run at the same time. Drafters on other hosts or devices do; a drafter pinned to the
verifier's only core does not: its lanes merely queue behind each other at the verifier (measured
in docs/BENCHMARKS.md, "Pipelining on shared cores"), and the router runs one lane instead.
"""

from __future__ import annotations

import os
import socket


def describe(info) -> None:
    """Fill a ModelInfo's host, cpus and threads with this process's."""
    import torch

    info.host = socket.gethostname()
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    info.cpus.extend(sorted(cores))
    info.threads = torch.get_num_threads()


def can_overlap(verifier, drafter) -> bool:
    """Whether the drafter (a ModelInfo) can compute while the verifier (a ModelInfo) does."""
    if not verifier.host or not drafter.host or verifier.host != drafter.host:
        return True  # another machine (or a service that does not say)
    v_gpu, d_gpu = verifier.device.startswith("cuda"), drafter.device.startswith("cuda")
    if v_gpu or d_gpu:
        return not (v_gpu and d_gpu and verifier.device == drafter.device)
    # Both on this host's CPUs: together they need as many cores as their threads.
    return len(set(verifier.cpus) | set(drafter.cpus)) >= max(1, verifier.threads) + max(1, drafter.threads)
