"""specfleet on Ray: the verifier and the drafter services as Ray actors, placed by the config.

    specfleet serve --ray [ADDRESS]   connect to a Ray cluster (none given: start a local one),
                                      create the actors, print where each runs, start the router

ADDRESS is a cluster's GCS address (HOST:6379, `auto`) from a process on a Ray node, or
`ray://HOST:10001` from anywhere else: Ray Client, whose server runs on the head node
(`ray start --head` starts it on port 10001). The router, a child process, connects the same
way. Under Ray Client the cluster's nodes must have specfleet and the models installed (the
same image): the client sends no code.

Each service's `ray` key in the config (`specfleet.config.RayPlacement`) says what
its actor needs: CPUs, GPUs, custom resources (`ray start --resources`) or node
labels (`ray start --labels`), and how often Ray restarts it. The verifier runs as one
actor per replica (`verifier.address` and each of `verifier.replicas`), all with the
verifier's placement. The actors are named (`verifier`, `verifier-1`, ...,
`drafter-<service name>`) in a Ray namespace, so a router anywhere in the cluster
finds them (`specfleet router --ray ADDRESS`) and talks to them through
`router.ray_transport`, the same interfaces as over gRPC; it spreads requests over
the verifier actors and moves a dead one's requests like any replica's
(`router.verifiers.VerifierPool`).

This module creates the actors and starts the router; what the actors, the router's Ray transport
and it share (actor names, placement options, joining the cluster, waiting for the actors) is
`specfleet.ray_actors`.

Ray token authentication (RAY_AUTH_MODE=token, Ray >= 2.52; on by default for
local clusters in the Ray this project pins) stays on: every process that joins
the cluster needs the token, from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or
~/.ray/auth_token. This module never turns it off.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

from specfleet import config as config_mod
from specfleet.ray_actors import (
    actor_options,
    actor_services,
    connect,
    format_placement,
    is_client_address,
    rank_bundles,
    wait_ready,
)

log = logging.getLogger(__name__)


def resolve_model_paths(cfg: config_mod.Config) -> None:
    """Relative model paths that exist here become absolute (an actor's working directory is Ray's, not ours).

    Model directories must exist at these paths on every node that may run the actor
    (the same container image or shared storage); Ray does not copy them.
    """

    def fix(path: str) -> str:
        p = pathlib.Path(path)
        return str(p.resolve()) if not p.is_absolute() and p.exists() else path

    cfg.verifier.model = fix(cfg.verifier.model)
    if cfg.router.tokenizer:
        cfg.router.tokenizer = fix(cfg.router.tokenizer)
    for svc in cfg.drafters:
        for m in svc.models:
            m.path = fix(m.path)


def create_actors(cfg: config_mod.Config, namespace: str, detached: bool = False, groups: list | None = None) -> dict:
    """Create one actor per verifier replica and per drafter service; returns {actor name: handle}.

    A service split over N ranks (`tensor_parallel_size`) gets, per actor, a placement group of N bundles on one node
    (STRICT_PACK), each what its `ray` key asks for; its actor, rank 0, takes bundle 0 and starts the other ranks in
    the rest (`specfleet.engine.ray_ranks`). The groups are appended to `groups`."""
    import ray

    from drafter_service.actor import DrafterActor
    from verifier_service.actor import VerifierActor

    config_yaml = cfg.to_yaml()
    handles = {}
    for name, service in actor_services(cfg).items():
        cls, args = (VerifierActor, (config_yaml,)) if service is cfg.verifier else (DrafterActor, (config_yaml, service.name))
        options = actor_options(service.ray, name, namespace, detached)
        if service.tensor_parallel_size > 1:
            options = _in_placement_group(options, service.ray, service.tensor_parallel_size, f"{namespace}-{name}", detached, groups)
        try:
            handles[name] = ray.remote(cls).options(**options).remote(*args)
        except ValueError as err:  # the name is taken
            raise RuntimeError(
                f"cannot create actor {name!r} in Ray namespace {namespace!r}: {err}. Another specfleet runs there: "
                "stop it, or pick another namespace (--namespace)"
            ) from None
    return handles


def _in_placement_group(options: dict, placement, size: int, name: str, detached: bool, groups: list | None) -> dict:
    """`options` for rank 0 of a split service: in bundle 0 of a new placement group of `size` bundles on one node."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    selector = options.pop("label_selector", None)  # the bundles' (every rank's node is the one node)
    group = placement_group(
        rank_bundles(placement, size),
        strategy="STRICT_PACK",
        name=name,
        lifetime="detached" if detached else None,
        **({"bundle_label_selector": [selector] * size} if selector else {}),
    )
    if groups is not None:
        groups.append(group)
    return {**options, "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)}


def _ranks(handles: dict, cfg: config_mod.Config) -> dict:
    """Where each split service's other ranks run: {"<actor>/rank-<r>": where()}."""
    import ray

    ranks = {}
    for name, service in actor_services(cfg).items():
        if service.tensor_parallel_size > 1:
            for r, where in enumerate(ray.get(handles[name].ranks.remote(), timeout=60), start=1):
                ranks[f"{name}/rank-{r}"] = where
    return ranks


def _rank_placements(cfg: config_mod.Config):
    """Every actor's placement, once per actor it becomes (a split service: once per rank)."""
    for service in actor_services(cfg).values():
        yield from [service.ray or config_mod.RayPlacement()] * service.tensor_parallel_size


def _local_resources(cfg: config_mod.Config) -> dict[str, float]:
    """Custom resources the config asks for, to declare on a local one-node cluster so the same config runs."""
    wanted: dict[str, float] = {}
    for placement in _rank_placements(cfg):
        for k, v in placement.resources.items():
            wanted[k] = wanted.get(k, 0.0) + v
    return wanted


def _local_cpus(cfg: config_mod.Config) -> int:
    """CPUs to declare on a local one-node cluster: this machine's, or what the actors ask for where that is more
    (there Ray's CPUs only place actors; their processes share the machine's cores either way)."""
    return max(os.cpu_count() or 1, math.ceil(sum(p.num_cpus for p in _rank_placements(cfg))))


def serve(cfg: config_mod.Config, address: str | None, namespace: str, detached: bool, startup_timeout_s: float) -> int:
    """`specfleet serve --ray`: actors on the Ray cluster, the router as a child process using Ray transports."""
    import ray

    from specfleet import security
    from specfleet.serving import wait_started, wait_until_serving

    resolve_model_paths(cfg)
    init_kwargs = {"log_to_driver": True, "logging_level": logging.WARNING}
    if address is None:
        resources = _local_resources(cfg)
        init_kwargs["resources"] = resources
        init_kwargs["num_cpus"] = _local_cpus(cfg)
        needs_gpu = max([cfg.verifier.ray.num_gpus if cfg.verifier.ray else 0] + [s.ray.num_gpus for s in cfg.drafters if s.ray])
        print(
            f"specfleet serve: starting a local Ray cluster (custom resources {resources or 'none'}"
            f"{'; the config asks for GPUs: this machine must have them' if needs_gpu else ''})",
            flush=True,
        )
    try:
        gcs_address = connect(address, namespace, **init_kwargs)
    except Exception as err:
        print(f"specfleet serve: cannot connect to Ray at {address or '(local)'}: {err}", file=sys.stderr)
        return 1
    via = f" through Ray Client {address}" if is_client_address(address) else ""
    print(f"specfleet serve: Ray cluster at {gcs_address}{via}, namespace {namespace!r}, {len(ray.nodes())} node(s)", flush=True)
    # The router joins the way this process did: a process that is no Ray node can only use Ray Client.
    router_ray_address = address if is_client_address(address) else gcs_address
    router_proc: subprocess.Popen | None = None
    handles: dict = {}
    groups: list = []  # placement groups of split services
    config_dir = _tempdir()

    def stop_all(code: int) -> int:
        if router_proc is not None and router_proc.poll() is None:
            router_proc.send_signal(signal.SIGTERM)
            try:
                router_proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                router_proc.kill()
        if not detached:
            for handle in handles.values():
                try:
                    ray.kill(handle, no_restart=True)
                except Exception:
                    pass
            for group in groups:
                ray.util.remove_placement_group(group)
        ray.shutdown()
        shutil.rmtree(config_dir, ignore_errors=True)
        return code

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        try:
            handles = create_actors(cfg, namespace, detached, groups)
            placements = asyncio.run(wait_ready(handles, startup_timeout_s, cfg))
            placements.update(_ranks(handles, cfg))
        except Exception as err:
            print(f"specfleet serve: the Ray actors did not start: {err}", file=sys.stderr)
            return stop_all(1)
        print("specfleet serve: placement", flush=True)
        print(format_placement(placements), flush=True)
        log.info("placement:\n%s", format_placement(placements))

        config_file = pathlib.Path(config_dir) / "config.yaml"
        config_file.write_text(cfg.to_yaml())
        command = [sys.executable, "-m", "router", "--config", str(config_file), "--ray", router_ray_address, "--ray-namespace", namespace]
        router_proc = subprocess.Popen(command)
        router_address = f"{cfg.router.host}:{cfg.router.port}"
        # The router's public port may serve TLS (security.tls): the health check speaks it too.
        wait = functools.partial(wait_until_serving, security=security.load(cfg.security))
        if not asyncio.run(wait_started(router_address, [("router", router_proc)], startup_timeout_s, wait)):
            return stop_all(1)
        print(f"specfleet is ready: router listening on {router_address} (Ray actors in namespace {namespace!r}; Ctrl-C stops)", flush=True)
        print(f"  try: specfleet generate --server {router_address} 'def fibonacci(n):'", flush=True)
        while True:
            if router_proc.poll() is not None:
                print(f"specfleet serve: router exited with code {router_proc.returncode}; stopping", file=sys.stderr)
                return stop_all(1)
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("specfleet serve: stopping", file=sys.stderr)
        return stop_all(0)


def _tempdir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="specfleet-ray-")
