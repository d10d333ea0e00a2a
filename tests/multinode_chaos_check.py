"""A whole node dies under a streaming load, on a multi-node Ray cluster on this machine.

A head with no CPUs, one prefill node and two decode nodes (each declaring its role's custom
resource, so every instance has a raylet of its own). Greedy streams run on both decodes; one
decode's node is removed (its raylet and every process on it killed) while its streams are
mid-decode. Those streams move to the surviving decode and finish token-identical to
colocated serving. A replacement node then joins, Ray restarts the lost instance there
(detached, restartable actors), and it takes traffic again. Prints one JSON object on stdout;
run from the repository root as `python -m tests.multinode_chaos_check --model DIR`.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

from tests.multinode_check import STORE_BYTES, run_check  # sets the loopback-cluster environment

# Ray notices a dead raylet after failure_threshold missed health checks (default 5 x 3 s).
os.environ.setdefault("RAY_health_check_period_ms", "500")
os.environ.setdefault("RAY_health_check_failure_threshold", "4")

WORKERS = [{"pdcluster_prefill": 1}, {"pdcluster_decode": 1}, {"pdcluster_decode": 1}]
NUM_STREAMS = 8
MAX_TOKENS = 96
RESTART_TIMEOUT_S = 120.0


def check(model_dir: str, ray_cluster) -> dict[str, Any]:
    import ray

    from pdcluster.cluster.config import ClusterConfig
    from pdcluster.cluster.control.launch import launch
    from pdcluster.engine import LLM, SamplingParams
    from tests.cluster_utils import (
        SMALL_ENGINE,
        Load,
        assert_clean,
        kv_pool_actor,
        live_object_ids,
        stats_by_id,
        wait_until,
    )

    ray.init(address=ray_cluster.address, namespace="pdcluster-chaos", log_to_driver=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [f"Stream {i} tells a long story about the sea and its ships" for i in range(16)]
    roles = {
        role: {"count": count, "num_cpus": 1, "resources": {f"pdcluster_{role}": 1}}
        for role, count in (("prefill", 1), ("decode", 2))
    }
    # The KV pool on (the default): its owner lives on the head, so the node's death loses
    # only what the dead instance held; moved streams may load their prefix from the pool.
    config = ClusterConfig.model_validate({"model": model_dir, "engine": SMALL_ENGINE, **roles})

    with launch(config) as pd:
        baseline = live_object_ids()
        decodes = sorted(i for i, (role, _) in pd.instances.items() if role == "decode")
        victim = decodes[0]

        async def scenario() -> list:
            load = Load(pd, params)
            streams = load.add(prompts[:NUM_STREAMS])
            assert await load.all_have(streams, 4)
            before = stats_by_id(pd)[victim]
            assert before.scheduler.num_running > 0, before  # some streams decode on the victim
            ray.get(pd.instances[victim][1].pause.remote())  # its streams stay mid-decode
            node = next(n for n in ray_cluster.worker_nodes if n.node_id == before.node_id)
            ray_cluster.remove_node(node, allow_graceful=False)
            return await load.done(), before

        results, before = asyncio.run(scenario())
        moved = pd.front.num_moves
        ray_cluster.add_node(
            num_cpus=1, resources={"pdcluster_decode": 1}, object_store_memory=STORE_BYTES
        )

        def back() -> bool:
            stats = stats_by_id(pd)[victim]
            return stats.healthy and stats.node_id not in (None, before.node_id)

        restarted = wait_until(back, RESTART_TIMEOUT_S)
        again = pd.generate(prompts[NUM_STREAMS:], params)
        after = stats_by_id(pd)[victim]
        assert_clean(pd, baseline, timeout_s=60)
        final = pd.wait_idle()
        pool_entries = ray.get(kv_pool_actor(pd).stats.remote()).num_entries
    expected = LLM(model_dir, **SMALL_ENGINE).generate(prompts, params)
    return {
        "victim_running_at_kill": before.scheduler.num_running,
        "num_moves": moved,
        "finish_reasons": [r.finish_reason for r in results + again],
        "errors": [r.outputs[0].error for r in results + again if r.outputs[0].error],
        "token_ids": [r.token_ids for r in results + again],
        "expected_token_ids": [o.token_ids for o in expected],
        "restarted": restarted,
        "victim_node_before": before.node_id,
        "victim_node_after": after.node_id,
        "victim_loads_after_restart": after.kv_transfer.num_loads,
        "kv_pool_entries_after": pool_entries,  # the pool outlived the node (on the head)
        "free_equals_total": all(
            s.scheduler.num_blocks_free == s.scheduler.num_blocks_total for s in final
        ),
    }


if __name__ == "__main__":
    sys.exit(run_check(__doc__, check, WORKERS))
