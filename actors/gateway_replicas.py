"""Gateway replicas as Ray actors: more processes serving one gateway's address.

The replicas share the serving process's listen address (SO_REUSEPORT), so they run on one
Ray node of its host, asking for `gateway.num_cpus` and `gateway.resources` like Serve
replicas do. What a replica is (cluster/replicas.py: `GatewayReplica`) is handed in; this
module only places and starts its actors.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

if TYPE_CHECKING:  # the gateway's settings, from the config above this layer
    from pdcluster.cluster.config import GatewaySettings


def replica_node(settings: GatewaySettings, count: int) -> str:
    """The Ray node for `count` more replicas: one on this process's host (the replicas share
    its listen address) whose resources hold them all, this process's own node first. A
    ValueError says what to change when no node on the host does (e.g. `pdcluster serve` run
    on a KubeRay head while `gateway.resources` names a resource only workers declare)."""
    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n["Alive"]]
    host = next(n["NodeManagerAddress"] for n in nodes if n["NodeID"] == here)
    ask = {"CPU": settings.num_cpus, **settings.resources}
    fits = [
        n["NodeID"]
        for n in sorted(nodes, key=lambda n: n["NodeID"] != here)
        if n["NodeManagerAddress"] == host
        and all(n["Resources"].get(name, 0) >= amount * count for name, amount in ask.items())
    ]
    if not fits:
        raise ValueError(
            f"gateway.replicas: {count} more replicas need {ask} each on a Ray node of this "
            f"host ({host}), and none has that much; run `pdcluster serve` on a node that "
            "declares it, or lower gateway.replicas, gateway.num_cpus or gateway.resources"
        )
    return fits[0]


def start_replica_actors(
    replica: type, args: tuple[Any, ...], settings: GatewaySettings, count: int
) -> list[ActorHandle]:
    """`count` actors of `replica(*args)` (a class whose async `serve` serves until the actor
    is killed) on one node of this host, each serving once this returns."""
    if count == 0:
        return []
    node = NodeAffinitySchedulingStrategy(replica_node(settings, count), soft=False)
    actors = [
        ray.remote(replica)
        .options(**settings.ray_actor_options(), scheduling_strategy=node, max_concurrency=1000)
        .remote(*args)
        for _ in range(count)
    ]
    for actor in actors:
        actor.serve.remote()
    return actors
