"""Ray autoscaler integration: scaling decode 1 -> 2 makes the autoscaler add a decode
node (the new instance, a pending actor, waits for it), and scaling back lets that node
idle out; outputs stay token-identical throughout.

The autoscaling cluster (Ray's fake multi-node provider) is built in a subprocess
(tests/autoscaler_check.py): this test session already runs a Ray driver of its own, and a
process connects to one cluster at a time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 400  # three raylets started on demand, three model loads, a 6 s idle timeout


@pytest.mark.slow  # a fake autoscaler adding and removing a raylet: ~50 s on 2 cores
def test_decode_node_added_on_scale_up_and_idles_out_on_scale_down(preset_dir):
    command = [sys.executable, "-m", "tests.autoscaler_check", "--model", preset_dir("tiny-llama")]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skipped" in result:
        pytest.skip(result["skipped"])

    # Nodes: one decode node, a second added for the new instance, then only the first.
    assert result["decode_node_counts"] == [1, 2, 1]
    assert result["prefill_nodes"] == 1
    before, scaled, after = result["decode_nodes"]
    (added,) = set(scaled) - set(before)
    assert after == before

    # The scale calls did what they said; the new instance ran on the added node.
    assert len(result["decode_instances_up"]) == 2
    (new_instance,) = set(result["decode_instances_up"]) - set(result["decode_instances_down"])
    assert result["decode_stats"][new_instance]["node_id"] == added
    assert all(s["num_steps"] > 0 for s in result["decode_stats"].values())

    # Token-identical on 1 decode instance, on 2, and on 1 again.
    expected = result["token_ids_before"]
    assert result["token_ids_scaled"] == expected * 3
    assert result["token_ids_after"] == expected
