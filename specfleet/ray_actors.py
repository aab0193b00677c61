"""The Ray actors of specfleet's services: their names, their placement options, joining a cluster,
finding the actors and waiting until they are ready.

What the services' actors (`drafter_service/actor.py`, `verifier_service/actor.py`), the router's
Ray transport (`router/ray_transport.py`) and the launcher (`specfleet/ray_cluster.py`, which
creates the actors: `specfleet serve --ray`) share; it imports none of them.

The actors are named (`verifier`, `verifier-1`, ..., `drafter-<service name>`) in a Ray namespace,
so a router anywhere in the cluster finds them. Ray token authentication stays on: this module
never turns it off.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
import time

from specfleet import config as config_mod

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "specfleet"
CLIENT_CONNECT_ATTEMPTS = 3
VERIFIER_ACTOR = "verifier"
# Environment every actor process sets before it imports the model stack (Ray workers inherit the
# raylet's environment, not the driver's).
ACTOR_ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def prepare_actor_process() -> None:
    for key, value in ACTOR_ENV.items():
        os.environ.setdefault(key, value)


def drafter_actor_name(service: str) -> str:
    return f"drafter-{service}"


def verifier_actor_names(cfg: config_mod.Config) -> list[str]:
    """One actor per verifier replica: `verifier`, `verifier-1`, ... (the addresses only count them under Ray)."""
    return [VERIFIER_ACTOR if i == 0 else f"{VERIFIER_ACTOR}-{i}" for i in range(len(cfg.verifier.addresses()))]


def actor_services(cfg: config_mod.Config) -> dict[str, config_mod.ServiceConfig]:
    """Every actor of this config, verifiers first: {actor name: its service's section}."""
    services: dict[str, config_mod.ServiceConfig] = {name: cfg.verifier for name in verifier_actor_names(cfg)}
    services.update({drafter_actor_name(s.name): s for s in cfg.drafters})
    return services


def actor_placements(cfg: config_mod.Config) -> dict[str, config_mod.RayPlacement | None]:
    """Every actor of this config, verifiers first: {actor name: its placement}."""
    return {name: service.ray for name, service in actor_services(cfg).items()}


def is_client_address(address: str | None) -> bool:
    """A Ray Client address (`ray://HOST:PORT`): this process joins through the head's client server, not as a node's driver."""
    return bool(address) and address.startswith("ray://")


def where() -> dict:
    """Where the calling Ray worker runs: node id and IP, host, pid, the resources Ray assigned it."""
    import ray

    ctx = ray.get_runtime_context()
    try:
        gpu_ids = [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # not in a worker with GPUs
        gpu_ids = []
    return {
        "node_id": ctx.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "actor_id": ctx.get_actor_id(),
        "resources": dict(ctx.get_assigned_resources()),
        "gpu_ids": gpu_ids,
        "restarted": _restarted(ctx),
        "placement_group": ctx.get_placement_group_id(),  # a split service's group (`rank_bundles`), or None
    }


def _restarted(ctx) -> bool:
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Ray's property uses a deprecated API of its own
            return bool(ctx.was_current_actor_reconstructed)
    except Exception:
        return False


def actor_options(placement: config_mod.RayPlacement | None, name: str, namespace: str, detached: bool) -> dict:
    """Ray actor options for one service, from its `ray` config key."""
    p = placement or config_mod.RayPlacement()
    options = {
        "name": name,
        "namespace": namespace,
        "num_cpus": p.num_cpus,
        "num_gpus": p.num_gpus,
        "max_restarts": p.max_restarts,
        # Calls that were in flight when the actor died fail (the scheduler handles that); new calls wait for the restart.
        "max_task_retries": 0,
        # Async actor: calls run concurrently on its event loop and meet in the BatchQueue.
        "max_concurrency": 1000,
    }
    if p.resources:
        options["resources"] = dict(p.resources)
    if p.label_selector:
        options["label_selector"] = dict(p.label_selector)
    if p.memory_mb:
        options["memory"] = int(p.memory_mb * 2**20)
    if detached:
        options["lifetime"] = "detached"
        options["get_if_exists"] = True
    return options


def rank_bundles(placement: config_mod.RayPlacement | None, size: int) -> list[dict[str, float]]:
    """The bundles of a split service's placement group: one per rank, each what the service's `ray` key asks for.

    Raises ValueError where that is nothing (Ray refuses an empty bundle)."""
    p = placement or config_mod.RayPlacement()
    bundle = {"CPU": p.num_cpus, "GPU": p.num_gpus, **p.resources, "memory": p.memory_mb * 2**20}
    bundle = {k: float(v) for k, v in bundle.items() if v}
    if not bundle:
        raise ValueError(
            "ray: with tensor_parallel_size above 1 each rank's actor takes a bundle of a placement group, which must "
            "hold something: set num_cpus, num_gpus or resources above 0"
        )
    return [bundle] * size


def connect(address: str | None, namespace: str, **init_kwargs) -> str:
    """Join the Ray cluster at address (None: start a local one; `ray://`: through Ray Client); returns the cluster's GCS address."""
    import ray

    # Through Ray Client, the head starts a server process per client, and Ray's proxy sometimes
    # fails that start at once (it reads the new process while it is a zombie, psutil.ZombieProcess:
    # ConnectionAbortedError "Starting Ray client server failed"); the next try gets a fresh one.
    attempts = CLIENT_CONNECT_ATTEMPTS if is_client_address(address) else 1
    for attempt in range(1, attempts + 1):
        if ray.is_initialized():
            break
        try:
            ray.init(address=address, namespace=namespace, **init_kwargs)
        except ConnectionAbortedError as err:
            if attempt == attempts:
                raise
            log.warning("Ray Client at %s: %s; trying again (%d of %d)", address, str(err).strip().splitlines()[-1], attempt + 1, attempts)
            ray.shutdown()
            time.sleep(2.0 * attempt)
    return ray.get_runtime_context().gcs_address


def lookup_actors(cfg: config_mod.Config, namespace: str, timeout_s: float) -> dict:
    """The named actors of this config, waiting (up to timeout_s) for them to be registered."""
    import ray

    names = list(actor_placements(cfg))
    deadline = time.monotonic() + timeout_s
    handles = {}
    while True:
        for name in names:
            if name not in handles:
                try:
                    handles[name] = ray.get_actor(name, namespace=namespace)
                except ValueError:
                    pass
        missing = [n for n in names if n not in handles]
        if not missing:
            return handles
        if time.monotonic() > deadline:
            raise TimeoutError(f"no Ray actor(s) {missing} in namespace {namespace!r} after {timeout_s:.0f}s; is `specfleet serve --ray` running?")
        time.sleep(0.5)


class ActorStartError(RuntimeError):
    pass


async def wait_ready(handles: dict, timeout_s: float, cfg: config_mod.Config | None = None) -> dict:
    """Wait until every actor has loaded its model; returns {actor name: where()}.

    The first actor that fails to start (a missing model, say) ends the wait with its
    error. An actor no node can host stays pending: the timeout's error then names
    what it asked for and what the cluster has.
    """
    import ray

    async def one(name, handle):
        try:
            return name, await handle.where.remote()
        except ray.exceptions.RayError as err:
            raise ActorStartError(f"actor {name!r} failed to start: {_root_cause(err)}") from None

    tasks = {name: asyncio.ensure_future(one(name, h)) for name, h in handles.items()}
    done, pending = await asyncio.wait(tasks.values(), timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for t in done:
        if t.exception() is not None:
            raise t.exception()
    if pending:
        waiting = [n for n, t in tasks.items() if t in pending]
        asked = ""
        if cfg is not None:
            wants = actor_placements(cfg)
            keys = ("num_cpus", "num_gpus", "resources", "label_selector", "memory")
            asked = "; ".join(
                f"{n} asks for { ({k: v for k, v in actor_options(wants.get(n), n, '', False).items() if k in keys}) }" for n in waiting
            )
        raise TimeoutError(
            f"Ray actor(s) {waiting} not ready after {timeout_s:.0f}s (still loading, or no node has the resources or labels "
            f"they need). {asked}. Cluster resources: {ray.cluster_resources()}"
        )
    return dict(t.result() for t in done)


def _root_cause(err: BaseException) -> str:
    """The last line of the actor's traceback (e.g. `FileNotFoundError: ...`), not Ray's whole report."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:", line):
            return line
    return lines[-1] if lines else type(err).__name__


def format_placement(placements: dict) -> str:
    lines = []
    for name in sorted(placements, key=_listing_order):
        w = placements[name]
        res = ", ".join(f"{k}={v:g}" for k, v in sorted(w.get("resources", {}).items())) or "-"
        gpus = f" gpus {','.join(w['gpu_ids'])}" if w.get("gpu_ids") else ""
        lines.append(f"  {name:<24} node {w['node_id'][:12]} ip {w['node_ip']} host {w['hostname']} pid {w['pid']} [{res}]{gpus}")
    return "\n".join(lines)


def _listing_order(name: str) -> tuple:
    """Verifiers first, by replica (`verifier`, `verifier-1`, ..., `verifier-10`), then drafters by name, each actor
    followed by its other ranks (`verifier-1/rank-1`, ...)."""
    actor, _, rank = name.partition("/rank-")
    if actor == VERIFIER_ACTOR or actor.startswith(VERIFIER_ACTOR + "-"):
        return (0, int(actor.rpartition("-")[2]) if actor != VERIFIER_ACTOR else 0, "", int(rank or 0))
    return (1, 0, actor, int(rank or 0))
