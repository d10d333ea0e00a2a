"""Gateway replicas stay off a head with no CPUs, like a KubeRay head with num-cpus "0".

A two-node Ray cluster on this machine: the head (0 CPUs) and one worker that declares
`pdcluster_gateway` (as the deploy/ worker groups do). The Serve app (cluster.serve_app)
and the `gateway.replicas` actors (actors.gateway_replicas) both ask for `gateway.resources`;
the script reports where each replica actor runs, and whether each serves. Prints one JSON
object on stdout. Run from the repository root as
`python -m tests.gateway_placement_check --model DIR`; it starts its own Ray cluster, so it
must not run inside a Ray driver.
"""

from __future__ import annotations

import sys
from typing import Any

from tests.multinode_check import run_check  # also sets the loopback-cluster environment

GATEWAY_RESOURCE = "pdcluster_gateway"
GATEWAY_SLOTS = 4  # replicas the worker holds: 2 Serve replicas and 2 `gateway.replicas`
POOL = "placement-check"


def actor_nodes(class_suffix: str) -> list[str]:
    """Node ids of the live actors whose class name ends with `class_suffix`."""
    from ray._private import state

    return [
        a["Address"]["NodeID"]
        for a in state.actors().values()
        if a["State"] == "ALIVE" and a["ActorClassName"].endswith(class_suffix)
    ]


def models_ok(port: int) -> bool:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).status_code == 200


def completion_tokens(port: int) -> int:
    import httpx

    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 3, "ignore_eos": True}
    response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


def check(model_dir: str, cluster) -> dict[str, Any]:
    import ray
    from ray import serve

    from pdcluster.actors.gateway_replicas import replica_node
    from pdcluster.actors.pool_controller import HEAD_RESOURCE
    from pdcluster.cluster.config import ClusterConfig, GatewaySettings
    from pdcluster.cluster.control.launch import shutdown_pool
    from pdcluster.cluster.replicas import start_replicas
    from pdcluster.cluster.serve_app import build_app
    from tests.cluster_utils import SMALL_ENGINE, wait_until
    from tests.gateway_utils import free_port

    ray.init(address=cluster.address, namespace="pdcluster-placement", log_to_driver=False)
    nodes = [n for n in ray.nodes() if n["Alive"]]
    head = next(n["NodeID"] for n in nodes if HEAD_RESOURCE in n["Resources"])
    worker = next(n["NodeID"] for n in nodes if n["NodeID"] != head)
    config = {
        "model": model_dir,
        "engine": dict(SMALL_ENGINE),
        "mixed": {"count": 1, "num_cpus": 1},
        "gateway": {"served_model_name": "tiny", "resources": {GATEWAY_RESOURCE: 1}},
    }
    result: dict[str, Any] = {"head": head, "worker": worker}
    serve_port, replicas_port = free_port(), free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": serve_port})
    try:
        serve.run(build_app({"config": config, "pool": POOL, "num_replicas": 2}), name="pdc")
        result["serve_replica_nodes"] = actor_nodes("pdcluster-gateway")
        result["serve_completion_tokens"] = completion_tokens(serve_port)

        settings = ClusterConfig.model_validate(config)
        result["driver"] = ray.get_runtime_context().get_node_id()
        result["plain_replica_node"] = replica_node(GatewaySettings(), 2)
        try:
            replica_node(settings.gateway, GATEWAY_SLOTS + 1)
        except ValueError as exc:
            result["too_many_error"] = str(exc)
        replicas = start_replicas(settings, POOL, "127.0.0.1", replicas_port, 2)
        assert wait_until(lambda: all(ray.get([r.started.remote() for r in replicas])), 120)
        result["gateway_replica_nodes"] = actor_nodes("GatewayReplica")
        result["replicas_models_ok"] = models_ok(replicas_port)
        result["replicas_completion_tokens"] = completion_tokens(replicas_port)
        for replica in replicas:
            ray.kill(replica, no_restart=True)
    finally:
        serve.shutdown()
        result["pool_shut_down"] = shutdown_pool(POOL)
    return result


if __name__ == "__main__":
    sys.exit(run_check(__doc__, check, [{GATEWAY_RESOURCE: GATEWAY_SLOTS}]))
