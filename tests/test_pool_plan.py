"""The pool's plain-Python decisions (cluster/control/pool.py), without Ray."""

from __future__ import annotations

from collections import Counter

import pytest

from pdcluster.actors.pool_messages import PlannerState, ScalingCount
from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.control.pool import PoolPlan, latency_p90s
from pdcluster.routing.role import Role


def plan(**roles) -> PoolPlan:
    config = ClusterConfig(model="preset:tiny-llama", **roles)
    return PoolPlan("p", config, "preset:tiny-llama")


def test_the_topology_launches_one_entry_per_instance_and_sizes_each():
    p = plan(prefill={"count": 2, "num_cpus": 0.5}, decode={"count": 1})
    assert p.initial_roles() == ["prefill", "prefill", "decode"]
    assert p.resources("prefill") == {"num_cpus": 0.5, "num_gpus": 0, "resources": {}}
    assert p.demand("prefill") == {"CPU": 0.5}
    spec = p.instance_spec("decode", "p-decode-3", kv_pool="p-kvpool")
    assert (spec.instance_id, spec.role, spec.kv_pool) == ("p-decode-3", "decode", "p-kvpool")


def test_indices_continue_after_the_members_and_the_newest_drains_first():
    members = {"p-decode-0": "decode", "p-decode-4": "decode", "p-prefill-1": "prefill"}
    assert PoolPlan.next_indices(members) == {"decode": 5, "prefill": 2}
    assert PoolPlan.newest_first("decode", members) == ["p-decode-4", "p-decode-0"]


def test_scale_requests_that_cannot_be_are_value_errors():
    p = plan(mixed={"count": 1})
    members = {"p-mixed-0": "mixed"}
    with pytest.raises(ValueError, match=r"count must be in \[0, 64\]"):
        p.check_scale("mixed", 65, members)
    with pytest.raises(ValueError, match="leaves none to serve"):
        p.check_scale("mixed", 0, members)
    p.check_scale("mixed", 2, members)
    p.check_scale("encoder", 0, members)  # an encoder serves nothing on its own


def test_a_placement_timeout_names_the_demand_and_what_is_free():
    error = plan(decode={"count": 1, "num_cpus": 2}).placement_timeout("decode", 1, {"CPU": 1})
    assert "1 more decode instance(s) did not come up" in str(error)
    assert "each needs {'CPU': 2.0}; free now: {'CPU': 1}" in str(error)


def test_only_fresh_latency_reports_count_and_the_worst_wins():
    reports = {"a": (100.0, 50.0, None), "b": (100.0, 80.0, 7.0), "old": (10.0, 999.0, 999.0)}
    assert latency_p90s(reports, now=110.0) == (80.0, 7.0)
    assert latency_p90s({}, now=0.0) == (None, None)


def test_planner_state_without_a_planner_is_the_actual_count():
    p = plan(prefill={"count": 1}, decode={"count": 1})
    state = p.planner_state({"p-prefill-0": Role.PREFILL, "p-decode-0": Role.DECODE}, {}, None)
    assert state == PlannerState({Role.ENCODER: 0, Role.PREFILL: 1, Role.DECODE: 1, Role.MIXED: 0})
    assert state.to_dict() == {
        "desired": {"encoder": 0, "prefill": 1, "decode": 1, "mixed": 0},
        "decisions": [],
        "round_s": None,
    }


def test_planner_state_counts_decisions_per_role_and_direction():
    p = plan(prefill={"count": 1}, decode={"count": 1})
    decisions = Counter({(Role.PREFILL, "up"): 2, (Role.PREFILL, "down"): 1})
    state = p.planner_state({"p-prefill-0": Role.PREFILL}, decisions, 0.25)
    assert state.decisions == (
        ScalingCount(Role.PREFILL, "up", 2),
        ScalingCount(Role.PREFILL, "down", 1),
    )
    assert state.to_dict()["decisions"] == [["prefill", "up", 2], ["prefill", "down", 1]]
    assert state.to_dict()["round_s"] == 0.25
