"""Scale a 1P1D pool on a local autoscaling Ray cluster: a new decode instance makes Ray's
autoscaler add a decode node, and the node idles out once the instance is gone.

The cluster is Ray's fake multi-node provider (what `ray.cluster_utils.AutoscalingCluster`
sets up): a head with no CPUs runs the autoscaler, which starts worker "nodes" (raylets on
this machine) of two types, `prefill` and `decode`, each declaring `pdcluster_<role>`. The
cluster is started here with `ray.cluster_utils.Cluster` and an autoscaling config rather
than with `AutoscalingCluster` itself, whose `start` and `shutdown` run `ray stop --force`
(ending every Ray process on the machine) and whose config template is not in Ray's wheel.

Prints one JSON object on stdout. Run from the repository root as
`python -m tests.autoscaler_check --model DIR`; it starts its own Ray cluster and connects
to it by address, so it must not run inside a Ray driver.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdcluster.benchmarks.targets import keep_current_cluster_record

os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only local cluster
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["RAY_FAKE_CLUSTER"] = "1"  # the fake provider refuses to run without it
os.environ["AUTOSCALER_UPDATE_INTERVAL_S"] = "1"

STORE_BYTES = 100 * 1024 * 1024  # per node
IDLE_TIMEOUT_MIN = 0.1  # an idle worker node is removed after 6 s
NODE_TIMEOUT_S = 120.0
FAKE_PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
ENGINE = {"block_size": 4, "num_blocks": 64, "max_model_len": 256, "max_num_batched_tokens": 128}
PROMPTS = [
    "Hello there, how are you today?",
    "The quick brown fox jumps over the lazy dog. " * 3,
    [5, 9, 300, 41, 7],
    "A",
]


def worker_type(role: str, max_workers: int) -> dict[str, Any]:
    resources = {"CPU": 1, f"pdcluster_{role}": 1, "object_store_memory": STORE_BYTES}
    return {"resources": resources, "node_config": {}, "min_workers": 1, "max_workers": max_workers}


def autoscaling_config(gcs_address: str) -> dict[str, Any]:
    """The fake provider's cluster config: a head with no CPUs, one prefill node, one or two
    decode nodes."""
    return {
        "cluster_name": "pdcluster-autoscaler-check",
        "max_workers": 3,
        "provider": {
            "type": "external",
            "module": FAKE_PROVIDER,
            "gcs_address": gcs_address,  # where the fake nodes' raylets connect
            "use_node_id_as_ip": True,  # the fake nodes all share this machine's IP
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0},
            "prefill": worker_type("prefill", max_workers=1),
            "decode": worker_type("decode", max_workers=2),
        },
        "head_node_type": "ray.head.default",
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": IDLE_TIMEOUT_MIN,
        "auth": {},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def start_ray_cluster(config_path: Path):
    from ray._private.services import get_node_ip_address
    from ray.cluster_utils import Cluster

    ip = get_node_ip_address()
    port = _free_port(ip)
    config_path.write_text(json.dumps(autoscaling_config(f"{ip}:{port}")))
    return Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,  # nothing of the pool runs on the head
            "include_dashboard": False,
            "object_store_memory": STORE_BYTES,
            "gcs_server_port": port,
            "autoscaling_config": str(config_path),
        },
    )


def stop_autoscaler(cluster) -> None:
    """End the head's autoscaler and the worker nodes it started, while the GCS is still up.

    `Cluster.shutdown` stops the GCS first and knows nothing of the autoscaler's nodes (their
    raylets are the autoscaler's child processes), and Ray 2.60's autoscaler cannot end them
    itself on exit (`StandardAutoscaler.kill_workers` calls a method that no longer exists).
    """
    import psutil
    from ray._private import ray_constants

    for info in cluster.head_node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []):
        monitor = psutil.Process(info.process.pid)
        nodes = monitor.children()  # each worker node's raylet and log monitor
        info.process.kill()  # first, so that it starts no node in place of those ended
        info.process.wait(timeout=30)
        for process in nodes:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.terminate()  # a raylet ends its workers and agents as it exits
        _, alive = psutil.wait_procs(nodes, timeout=30)
        for process in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def _free_port(ip: str) -> int:
    with socket.socket() as sock:
        sock.bind((ip, 0))
        return sock.getsockname()[1]


def alive_nodes(role: str) -> list[str]:
    import ray

    return sorted(
        n["NodeID"]
        for n in ray.nodes()
        if n["Alive"] and n["Resources"].get(f"pdcluster_{role}", 0) > 0
    )


def poll(predicate: Callable[[], bool], timeout_s: float = NODE_TIMEOUT_S) -> float:
    """Seconds until `predicate()` held; raises TimeoutError after `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"condition not met in {timeout_s:.0f} s")
        time.sleep(0.2)
    return time.monotonic() - start


def connect(address: str) -> float:
    """Join the cluster once the autoscaler has started its minimum worker nodes (one of
    each type); returns the seconds that took."""
    import ray

    ray.init(address=address, namespace="pdcluster", log_to_driver=False)
    return poll(lambda: len(alive_nodes("prefill")) == 1 and len(alive_nodes("decode")) == 1)


def serve(model_dir: str) -> dict[str, Any]:
    """Serve on 1P1D, scale decode to 2 (a node is added) and back to 1 (it idles out)."""
    from pdcluster.cluster.config import ClusterConfig
    from pdcluster.cluster.control.launch import launch
    from tests.cluster_utils import GREEDY, SMALL_ENGINE

    roles = {
        role: {"count": 1, "num_cpus": 1, "resources": {f"pdcluster_{role}": 1}}
        for role in ("prefill", "decode")
    }
    config = ClusterConfig.model_validate(
        {"model": model_dir, "engine": {**SMALL_ENGINE, **ENGINE}, **roles}
    )
    result: dict[str, Any] = {}
    with launch(config) as pd:
        result["token_ids_before"] = [o.token_ids for o in pd.generate(PROMPTS, GREEDY)]
        result["decode_nodes"] = [alive_nodes("decode")]
        result |= scale_up(pd)
        result["decode_nodes"].append(alive_nodes("decode"))
        outputs = pd.generate(PROMPTS * 3, GREEDY)  # several at once: both D get some
        result["token_ids_scaled"] = [o.token_ids for o in outputs]
        result["decode_stats"] = {
            s.instance_id: {"num_steps": s.num_steps, "node_id": s.node_id}
            for s in pd.wait_idle()
            if s.role == "decode"
        }
        result |= scale_down(pd)
        result["decode_nodes"].append(alive_nodes("decode"))
        result["token_ids_after"] = [o.token_ids for o in pd.generate(PROMPTS, GREEDY)]
    result["decode_node_counts"] = [len(nodes) for nodes in result["decode_nodes"]]
    result["prefill_nodes"] = len(alive_nodes("prefill"))
    return result


def scale_up(pd) -> dict[str, Any]:
    """Decode 1 -> 2: the new instance (a pending actor) waits for a node to be added."""
    start = time.monotonic()
    members = asyncio.run(pd.scale("decode", 2))
    scale_up_s = time.monotonic() - start
    poll(lambda: sum(1 for r, _ in pd.instances.values() if r == "decode") == 2, 30)
    return {
        "scale_up_s": round(scale_up_s, 1),
        "decode_instances_up": sorted(i for i, r in members.items() if r == "decode"),
    }


def scale_down(pd) -> dict[str, Any]:
    """Decode 2 -> 1: the newest instance drains away, then its node idles out."""
    start = time.monotonic()
    members = asyncio.run(pd.scale("decode", 1))
    scale_down_s = time.monotonic() - start
    idle_out_s = poll(lambda: len(alive_nodes("decode")) == 1)
    return {
        "scale_down_s": round(scale_down_s, 1),
        "idle_out_s": round(idle_out_s, 1),
        "decode_instances_down": sorted(i for i, r in members.items() if r == "decode"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True, help="checkpoint folder")
    args = parser.parse_args()
    import ray

    # A head node records itself as "the current cluster" for `address="auto"`: put back
    # what was there, so that no later `ray.init()` finds this short-lived cluster.
    cluster = None
    with tempfile.TemporaryDirectory() as tmp, keep_current_cluster_record():
        try:
            try:
                cluster = start_ray_cluster(Path(tmp) / "autoscaling.json")
                min_nodes_up_s = connect(cluster.address)
            except Exception as exc:  # noqa: BLE001 - reported: the caller skips
                result = {"skipped": f"no autoscaling Ray cluster here: {exc!r}"}
            else:
                result = {"min_nodes_up_s": round(min_nodes_up_s, 1), **serve(args.model)}
        finally:
            ray.shutdown()
            if cluster is not None:
                stop_autoscaler(cluster)
                cluster.shutdown()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
