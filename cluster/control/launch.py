"""Start a pdcluster on Ray (its pool controller launches the instance actors), or attach
another gateway replica to a running pool by name.

`launch(config)` uses an existing cluster when `ray.address` is set (or Ray is already
initialised), and otherwise starts an embedded local Ray with no dashboard. The `Cluster` it
returns (cluster/client.py) is one gateway replica's client: it plans, submits and reads
tokens itself (actors/front/); nothing central is on a request's path. Every Ray call is
made by actors/ (ray_runtime.py starts or joins Ray, pool_client.py talks to the pool).
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from pdcluster.actors.pool_client import PoolClient
from pdcluster.actors.ray_runtime import (
    address_from_env,
    cluster_resources,
    ray_is_up,
    shutdown_ray,
)
from pdcluster.actors.ray_runtime import init_ray as _init_ray
from pdcluster.cluster.client import DEFAULT_MODEL, Cluster
from pdcluster.cluster.config import ClusterConfig, RaySettings
from pdcluster.cluster.control.pool import (
    READY_TIMEOUT_S,
    PoolPlan,
    controller_name,
    embedded_ray_cpus,
    topology_demand,
    unplaceable,
)
from pdcluster.engine.presets import resolve_model_dir
from pdcluster.engine.spec_decode.draft_model import draft_model_dir
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.routing.role import Role

__all__ = ["Cluster", "TopologyDoesNotFit", "init_ray", "launch", "shutdown_pool"]

logger = logging.getLogger(__name__)


class TopologyDoesNotFit(ValueError):
    """The topology asks for more than the embedded Ray has (no node can ever be added)."""


def init_ray(settings: RaySettings) -> bool:
    """Connect to (or start) Ray as `settings` say; True when this call started it (see
    actors/ray_runtime.py: token authentication, one ConnectionError saying what to set)."""
    return _init_ray(
        settings.address, settings.namespace, settings.num_cpus, settings.object_store_memory
    )


def launch(
    config: ClusterConfig | str | Path, pool: str | None = None, detached: bool = False
) -> Cluster:
    """Start every instance of the topology and the pool's controller; returns when all are
    ready. With `pool` naming a pool that is already up (or being launched by another
    process), attach to it instead: every caller gets its own gateway-side client of the
    one pool. A new unnamed pool is this caller's (its `shutdown` ends the pool); a named
    one is shared and ends with `shutdown_pool`. `detached` pools outlive the process that
    launched them (a Serve app's replicas come and go)."""
    if not isinstance(config, ClusterConfig):
        config = ClusterConfig.from_yaml(config)
    embedded_ray = not (ray_is_up() or config.ray.address or address_from_env())
    if embedded_ray:
        config = sized_for_this_machine(config)
    owns_ray = init_ray(config.ray)
    if embedded_ray and owns_ray:
        _check_fits(config)
    model = config.model or DEFAULT_MODEL
    model_dir = resolve_model_dir(model)  # the driver tokenizes, so it needs the files too
    check_draft_models(config, model_dir)
    name = pool or f"pdc-{uuid.uuid4().hex[:6]}"
    client = PoolClient.start(PoolPlan(name, config, model), controller_name(name), detached)
    try:
        members = client.wait_started(READY_TIMEOUT_S)
    except BaseException:
        if pool is None:
            client.end(timeout_s=60, quiet=True)
        raise
    logger.info("pdcluster %s: %d instances (%s)", name, len(members), config.topology_name())
    return Cluster(
        config, model_dir, name, client, owns_ray, owned=pool is None,
        embedded_ray=embedded_ray and owns_ray,
    )  # fmt: skip


def check_draft_models(config: ClusterConfig, model_dir: str) -> None:
    """Each role's draft model (speculative method draft_model) exists and shares the
    target's vocabulary: ValueError (FileNotFoundError) now, not from an instance that
    fails to start."""
    target = None
    for role in Role:
        spec = config.engine_config(role, model_dir).draft_model
        if spec is not None:
            target = target or Tokenizer(model_dir)
            draft_model_dir(spec, target)


def sized_for_this_machine(config: ClusterConfig) -> ClusterConfig:
    """`config` with an embedded Ray of as many logical CPUs as its instances reserve, when
    that is more than the cores (and `ray.num_cpus` is unset): the instances then share the
    cores, as with the built-in YAML configs, instead of waiting for CPUs that never come."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpus = embedded_ray_cpus(config, cores or 1)
    if config.ray.num_cpus is not None or cpus <= (cores or 1):
        return config
    logger.info(
        "%s reserves %d CPUs on %d cores: the embedded Ray gets %d logical CPUs",
        config.topology_name(), cpus, cores, cpus,
    )  # fmt: skip
    return config.model_copy(update={"ray": config.ray.model_copy(update={"num_cpus": cpus})})


def _check_fits(config: ClusterConfig) -> None:
    """TopologyDoesNotFit (after ending the embedded Ray) when the instances ask for more
    than it has: no autoscaler adds a node to it, so they would wait for nothing."""
    need, have = topology_demand(config), cluster_resources()
    if not unplaceable(need, have):
        return
    shutdown_ray()
    have = {k: round(have.get(k, 0.0), 3) for k in need}
    raise TopologyDoesNotFit(
        f"{config.topology_name()} needs {need} in all but this machine's Ray has {have}; "
        "ask for fewer instances or resources per instance (num_cpus, num_gpus), raise "
        "ray.num_cpus, or pass --address of a larger Ray cluster"
    )


def shutdown_pool(pool: str, namespace: str | None = None) -> bool:
    """End a named pool: its instances and its controller. False when no such pool is up."""
    client = PoolClient.find(pool, controller_name(pool), namespace)
    if client is None:
        return False
    client.end()
    return True
