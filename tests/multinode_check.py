"""Serve 1E1P1D on a multi-node Ray cluster on this machine and compare with colocated serving.

A head node with no CPUs and one node per role, each declaring that role's custom resource
(`pdcluster_<role>`), so that every instance lands on a raylet of its own and encoder outputs
and KV blocks cross raylets through Ray's object manager. Prints one JSON object on stdout.
Run from the repository root as `python -m tests.multinode_check --model DIR`; it starts its
own Ray cluster and connects to it by address, so it must not run inside a Ray driver.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from pdcluster.benchmarks.targets import keep_current_cluster_record

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only local cluster
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

ROLES = ("encoder", "prefill", "decode")
STORE_BYTES = 100 * 1024 * 1024  # per node


def start_ray_cluster(workers: list[dict[str, float]]):
    """A head with no CPUs (nothing of the topology runs there) and one 1-CPU worker node
    per entry of `workers`, declaring those custom resources."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": False,
            "object_store_memory": STORE_BYTES,
        },
    )
    for resources in workers:
        cluster.add_node(num_cpus=1, resources=resources, object_store_memory=STORE_BYTES)
    cluster.wait_for_nodes()
    return cluster


def serve(model_dir: str, cluster) -> dict[str, Any]:
    import ray

    from pdcluster.cluster.config import ClusterConfig
    from pdcluster.cluster.control.launch import launch
    from pdcluster.engine import LLM
    from tests.cluster_utils import GREEDY, SMALL_ENGINE, mixed_prompts

    ray.init(address=cluster.address, namespace="pdcluster-multinode", log_to_driver=False)
    roles = {
        role: {"count": 1, "num_cpus": 1, "resources": {f"pdcluster_{role}": 1}} for role in ROLES
    }
    config = ClusterConfig.model_validate(
        {"model": model_dir, "engine": dict(SMALL_ENGINE), **roles}
    )
    prompts = mixed_prompts(with_images=True)
    with launch(config) as pd:
        outputs = pd.generate(prompts, GREEDY)
        stats = pd.wait_idle()
    expected = LLM(model_dir, **SMALL_ENGINE).generate(prompts, GREEDY)
    return {
        "num_nodes": len([n for n in ray.nodes() if n["Alive"]]),
        "head_node_id": ray.get_runtime_context().get_node_id(),
        "token_ids": [o.token_ids for o in outputs],
        "expected_token_ids": [o.token_ids for o in expected],
        "finish_reasons": [o.finish_reason for o in outputs],
        "instances": {
            s.role: {
                "node_id": s.node_id,
                "healthy": s.healthy,
                "num_loads": s.kv_transfer.num_loads,
                "bytes_received": s.kv_transfer.bytes_received,
                "ec_loaded": s.ec.loaded,
            }
            for s in stats
        },
    }


def run_check(
    description: str,
    check: Callable[[str, Any], dict[str, Any]],
    workers: list[dict[str, float]],
) -> int:
    """A check script's main: start the cluster, run `check(model_dir, cluster)` on it (a
    `ray.cluster_utils.Cluster`), shut it down, print the result as one JSON object."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--model", required=True, help="checkpoint folder")
    args = parser.parse_args()
    import ray

    cluster = None
    with keep_current_cluster_record():
        try:
            cluster = start_ray_cluster(workers)
            result = check(args.model, cluster)
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(run_check(__doc__, serve, [{f"pdcluster_{role}": 1} for role in ROLES]))
