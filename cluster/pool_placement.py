"""Where the pools' workers go: the pool a role's worker joins, and the Ray placement
groups that hold their bundles (``cluster.pools`` keeps the groups and fills the bundles).

At one tensor-parallel rank a pool is one placement group with a bundle per worker (the
service's ``placement_strategy``); above one rank each worker has a group of its own, a
bundle per rank on one node (``STRICT_PACK``, ``ClusterConfig.worker_bundles``). A start
waits for its groups against its deadline (``StartTimeout`` past it, saying what the pool
asked and what the cluster offers); a worker added later gets a group of its own unless a
removed worker left a bundle in its pool's group. Nothing here holds state: the caller
keeps each group as soon as it exists, so that a failed start removes it.
"""

from __future__ import annotations

import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from cluster.config import ClusterConfig


class StartTimeout(TimeoutError):
    """The pools did not start within ``ClusterConfig.start_timeout_s``."""


def pool_role(config: ClusterConfig, role: str) -> str:
    """The pool a ``role`` ("prefill" or "decode") worker joins: its own, or "colocated" in a
    colocated deployment, which has no prefill pool (``ValueError`` naming what was asked)."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
    if config.colocated:
        if role == "prefill":
            raise ValueError("a colocated deployment has no prefill pool")
        return "colocated"
    return role


def worker_group(config: ClusterConfig, role: str) -> tuple[list[dict[str, float]], str]:
    """The bundles and strategy of a placement group for one ``role`` worker: a bundle per
    tensor-parallel rank (rank 0, the worker's actor, in the first), all on one node."""
    bundles = config.worker_bundles(role)
    return bundles, "STRICT_PACK" if len(bundles) > 1 else "PACK"


def wait_placed(pg: PlacementGroup, role: str, asks: str, deadline: float, start_timeout_s: float) -> None:
    """Wait for ``pg`` until ``deadline``; past it, ``StartTimeout`` says what ``role``'s pool asked."""
    if not pg.wait(max(0.0, deadline - time.monotonic())):
        total = ray.cluster_resources()
        offered = {k: total.get(k, 0) for k in pg.bundle_specs[0]}
        raise StartTimeout(
            f"{role} pool: {asks} were not placed within start_timeout_s={start_timeout_s:g} s; "
            f"the Ray cluster's nodes offer {offered} in all (are the worker pods scheduled and joined?). "
            f"The start's placement groups are removed; the next start tries again"
        )


def place_pool(config: ClusterConfig, role: str, count: int, deadline: float, pgs: dict[str, object],
               own_pgs: list[object]) -> list[tuple[PlacementGroup, int]]:
    """Place ``count`` ``role`` workers by ``deadline``: (group, bundle index) for each. At one
    rank one group for the pool, kept in ``pgs[role]``; above one rank a group per worker
    (``worker_group``), each added to ``own_pgs``. Each is kept as soon as it exists, before
    it is waited for, so that a failure while waiting for it removes it."""
    if config.tensor_parallel_size(role) == 1:
        bundle = config.resources(role).bundle()
        pg = pgs[role] = placement_group([bundle] * count, strategy=config.placement_strategy)
        wait_placed(pg, role, f"{count} worker(s) asking {bundle} each", deadline, config.start_timeout_s)
        return [(pg, i) for i in range(count)]
    bundles, strategy = worker_group(config, role)
    groups = [placement_group(bundles, strategy=strategy) for _ in range(count)]
    own_pgs.extend(groups)
    for pg in groups:
        wait_placed(pg, role, f"{count} worker(s) asking {bundles} each, on one node", deadline,
                    config.start_timeout_s)
    return [(pg, 0) for pg in groups]


def place_worker(config: ClusterConfig, role: str, timeout_s: float) -> PlacementGroup:
    """A placement group of its own for one more ``role`` worker, placed within
    ``timeout_s``; past it the group is removed and ``TimeoutError`` says what it asked."""
    bundles, strategy = worker_group(config, role)
    pg = placement_group(bundles, strategy=strategy)
    if not pg.wait(timeout_s):
        remove_placement_group(pg)
        asks = bundles[0] if len(bundles) == 1 else bundles
        raise TimeoutError(f"no room for one more {role} worker ({asks}) within {timeout_s:g} s")
    return pg
