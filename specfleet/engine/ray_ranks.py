"""A split model's ranks as Ray actors, where its rank 0 is a Ray actor in a placement group.

`specfleet serve --ray` gives each actor of a service with `tensor_parallel_size: N` (a verifier replica, a drafter
service) one placement group of N bundles on one node (STRICT_PACK, `specfleet.ray_cluster`) and places the actor,
rank 0, in bundle 0. The service loads its model with `start` as `load_model`'s start_ranks, which starts ranks
1..N-1: one `RankActor` each, in bundle r of the same group, with that bundle's resources (a GPU each on a GPU node:
Ray sets each actor's CUDA_VISIBLE_DEVICES to its own, so every rank uses the first device it sees). They meet as
the child processes of `parallel.launch` do: through a /dev/shm file and a rendezvous port on 127.0.0.1, which the
one node makes possible.

Failure is the replica's, as with child processes: rank 0 watches each rank's `serve` call and exits when one
ends before it closes the group (`parallel._watch`); Ray kills the ranks an actor created when that actor dies
(they are its own), and restarts it into bundle 0 of its group (`ray.max_restarts`), where it starts new ones.
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys

from specfleet.engine import rank


def in_placement_group() -> bool:
    """Whether this process is a Ray actor placed in a placement group (never true where Ray is not imported)."""
    if "ray" not in sys.modules:
        return False
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return False
    from ray.util.placement_group import get_current_placement_group

    return get_current_placement_group() is not None


def starter():
    """`load_model`'s start_ranks for this process: `start` where it is a Ray actor in a placement group (`specfleet
    serve --ray` puts a split service's actors in one), else None (child processes)."""
    return start if in_placement_group() else None


class RankActor:
    """Rank r of a split model: joins the group, loads its slices, runs rank 0's passes until told to stop."""

    def __init__(self, spec: str):
        from specfleet.ray_actors import prepare_actor_process

        prepare_actor_process()
        self.spec = spec

    def serve(self) -> int:
        return rank.run(json.loads(self.spec))

    def where(self) -> dict:
        from specfleet.ray_actors import where

        return where()


class RayRank:
    """One rank's actor, as `parallel.Group` handles its other ranks: `wait` for its exit code, `kill`."""

    def __init__(self, actor, rank: int):
        self.actor, self.rank = actor, rank
        self.served = actor.serve.remote()

    def wait(self, timeout: float | None = None) -> int:
        """0 once the rank stopped as told, 1 once its actor died; subprocess.TimeoutExpired after `timeout` seconds.

        Through a future, not ray.get: rank 0 is an async actor, whose threads may block but whose ray.get warns."""
        import ray

        try:
            return self.served.future().result(timeout)
        except concurrent.futures.TimeoutError:
            raise subprocess.TimeoutExpired(f"tensor-parallel rank {self.rank}", timeout) from None
        except ray.exceptions.RayError:
            return 1

    def where(self):
        """Where its actor runs (`ray_actors.where`), as a Ray object reference."""
        return self.actor.where.remote()

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)


def start(specs: list[str]) -> list[RayRank]:
    """Rank r (1, 2, ...) of `specs` as an actor in bundle r of this actor's placement group."""
    import ray
    from ray.util.placement_group import get_current_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = get_current_placement_group()
    bundles = group.bundle_specs
    if len(bundles) <= len(specs):
        raise ValueError(f"tensor_parallel_size {len(specs) + 1} needs as many bundles in this actor's placement group; it has {len(bundles)}")
    ranks = []
    for r, spec in enumerate(specs, start=1):
        bundle = dict(bundles[r])
        options = dict(
            num_cpus=bundle.pop("CPU", 0),
            num_gpus=bundle.pop("GPU", 0),
            max_restarts=0,  # a rank lost is the replica lost: rank 0 restarts with new ones
            max_concurrency=2,  # where() beside serve(), which runs until the group closes
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=r),
        )
        if "memory" in bundle:
            options["memory"] = bundle.pop("memory")
        if bundle:
            options["resources"] = bundle
        ranks.append(RayRank(ray.remote(RankActor).options(**options).remote(spec), r))
    return ranks
