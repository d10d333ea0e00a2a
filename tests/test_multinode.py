"""1E1P1D on a multi-node Ray cluster (one raylet per role, on this machine): encoder outputs
and KV blocks cross raylets through Ray's object manager, and the outputs stay
token-identical to colocated serving.

The cluster is built in a subprocess (tests/multinode_check.py): this test session already
runs a Ray driver of its own, and a process connects to one cluster at a time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 300  # four raylets and three model loads on two cores


def test_epd_across_nodes_matches_colocated(preset_dir):
    command = [sys.executable, "-m", "tests.multinode_check", "--model", preset_dir("tiny-llava")]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])

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
