"""Multi-node Ray clusters on this machine (one raylet per node).

1E1P1D with one raylet per role: encoder outputs and KV blocks cross raylets through Ray's
object manager, and the outputs stay token-identical to colocated serving. And gateway
replicas (Serve's and `gateway.replicas`') stay off a head with no CPUs.

Each cluster is built in a subprocess (tests/multinode_check.py,
tests/gateway_placement_check.py): this test session already runs a Ray driver of its own,
and a process connects to one cluster at a time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300  # four raylets and three model loads on two cores


def run_check(module: str, model_dir: str) -> dict:
    command = [sys.executable, "-m", module, "--model", model_dir]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # three raylets: ~40 s; the node-death test crosses nodes too, 1E1P1D equivalence runs on one
def test_epd_across_nodes_matches_colocated(preset_dir):
    result = run_check("tests.multinode_check", preset_dir("tiny-llava"))

    assert result["num_nodes"] == 4  # the head and one node per role
    nodes = {role: stats["node_id"] for role, stats in result["instances"].items()}
    assert sorted(nodes) == ["decode", "encoder", "prefill"]
    assert len(set(nodes.values())) == 3 and result["head_node_id"] not in nodes.values()
    assert all(stats["healthy"] for stats in result["instances"].values())

    assert result["token_ids"] == result["expected_token_ids"]
    assert set(result["finish_reasons"]) == {"length"}
    # The handoffs really happened, across raylets: E -> P and P -> D.
    assert result["instances"]["prefill"]["ec_loaded"] > 0
    assert result["instances"]["decode"]["num_loads"] > 0
    assert result["instances"]["decode"]["bytes_received"] > 0


@pytest.mark.slow  # four raylets and Serve: about a minute on 2 cores
def test_gateway_replicas_stay_off_a_head_without_cpus(preset_dir):
    result = run_check("tests.gateway_placement_check", preset_dir("tiny-llava"))
    head, worker = result["head"], result["worker"]
    assert head != worker

    # Serve replicas and `gateway.replicas` actors ask for pdcluster_gateway: the worker.
    assert result["serve_replica_nodes"] == [worker, worker]
    assert result["gateway_replica_nodes"] == [worker, worker]
    assert result["serve_completion_tokens"] == result["replicas_completion_tokens"] == 3
    assert result["replicas_models_ok"]
    # Without the resource they would go to the driver's own node (here the head).
    assert result["plain_replica_node"] == result["driver"]
    # More replicas than the worker declares is one clear error, not replicas that wait.
    assert "5 more replicas need" in result["too_many_error"]
    assert "'pdcluster_gateway': 1.0" in result["too_many_error"]
    assert result["pool_shut_down"]


def test_a_whole_node_dies_under_load_and_its_streams_go_on(preset_dir):
    """1P2D, one raylet per instance: a decode's node is removed mid-stream. Every stream
    finishes token-identical to colocated serving (those on the lost node moved), the lost
    instance comes back on a replacement node and serves again, and nothing leaks."""
    result = run_check("tests.multinode_chaos_check", preset_dir("tiny-llama"))

    assert result["victim_running_at_kill"] > 0 and result["num_moves"] > 0
    assert result["errors"] == [] and set(result["finish_reasons"]) == {"length"}
    assert result["token_ids"] == result["expected_token_ids"]
    assert result["restarted"] and result["victim_node_after"] != result["victim_node_before"]
    assert result["victim_loads_after_restart"] > 0  # the replacement took traffic
    assert result["kv_pool_entries_after"] > 0
    assert result["free_equals_total"]
