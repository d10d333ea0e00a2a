"""`pdcluster bench --elastic`: rate schedule, arrivals, instance-seconds, the comparison and
its goal (no Ray)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import elastic
from benchmarks.elastic import (
    InstanceSample,
    RateStep,
    comparison_rows,
    goal,
    instance_seconds,
    parse_rate_steps,
    poisson_arrivals,
    rate_at,
    role_counts,
    stepped_workload,
)
from benchmarks.workload import LengthScaling, trace_workload
from cluster.cli import main as cli_main
from tests.test_bench import TRACE


def test_rate_steps_parse_and_reject_malformed():
    steps = parse_rate_steps("0.3:60, 1.2:30,0:10")
    assert steps == (RateStep(0.3, 60), RateStep(1.2, 30), RateStep(0.0, 10))
    assert elastic.format_rate_steps(steps) == "0.3:60,1.2:30,0:10"
    assert [rate_at(steps, t) for t in (0, 59.9, 60, 89.9, 95, 100, -1)] == [
        0.3, 0.3, 1.2, 1.2, 0.0, 0.0, 0.0,
    ]  # fmt: skip
    for bad in ("", "1", "1:0", "-1:5", "a:5", "1:b"):
        with pytest.raises(ValueError):
            parse_rate_steps(bad)


def test_arrivals_follow_each_steps_rate():
    steps = (RateStep(2.0, 500), RateStep(10.0, 500), RateStep(0.0, 100), RateStep(2.0, 500))
    arrivals = poisson_arrivals(steps, seed=3)
    assert arrivals == sorted(arrivals) and arrivals == poisson_arrivals(steps, seed=3)
    counts = np.histogram(arrivals, bins=[0, 500, 1000, 1100, 1600])[0]
    assert 900 < counts[0] < 1100 and 4700 < counts[1] < 5300 and 900 < counts[3] < 1100
    assert counts[2] == 0  # a zero-rate step is silent
    gaps = np.diff([t for t in arrivals if 500 <= t < 1000])
    assert 0.9 < gaps.std() / gaps.mean() < 1.1  # exponential gaps: CV about 1


def test_stepped_workload_keeps_trace_lengths_at_new_times(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    base = trace_workload(path, LengthScaling(max_output_len=100))
    steps = parse_rate_steps("1:2")
    w = stepped_workload(base, [0.5, 1.0, 1.5], steps)
    assert [r.arrival_s for r in w.requests] == [0.5, 1.0, 1.5]
    assert [r.prompt_len for r in w.requests] == [374, 396, 879]
    assert "rate steps 1:2" in elastic.describe(w) and "tokens ×1" in elastic.describe(w)
    with pytest.raises(ValueError, match="need 7"):
        stepped_workload(base, [float(i) for i in range(7)], steps)


def test_instance_seconds_hold_each_sample_until_the_next():
    samples = [
        InstanceSample(0.0, {"prefill": 1, "decode": 1}),
        InstanceSample(10.0, {"prefill": 3, "decode": 1}),
        InstanceSample(15.0, {"prefill": 2, "decode": 2}),
        InstanceSample(40.0, {"prefill": 9, "decode": 9}),  # past the end: not counted
    ]
    out = instance_seconds(list(reversed(samples)), end_s=20.0)
    assert out["prefill"] == pytest.approx(10 * 1 + 5 * 3 + 5 * 2)
    assert out["decode"] == pytest.approx(10 + 5 + 10)
    assert out["total"] == pytest.approx(out["prefill"] + out["decode"])
    assert instance_seconds([], 5.0)["total"] == 0


def test_role_counts_of_cluster_instances():
    instances = {"a": ("prefill", None), "b": ("decode", None), "c": ("decode", None)}
    assert role_counts(instances) == {"prefill": 1, "decode": 2}
    assert role_counts({}) == {"prefill": 0, "decode": 0}


def _run(name, attainment, total):
    seconds = {"prefill": total / 2, "decode": total / 2, "total": total}
    summary = {"attainment": attainment, "num_ok": 10, "num_requests": 10}
    return {"name": name, "sizes": {"prefill": 1, "decode": 1}, "summary": summary,
            "instance_seconds": seconds}  # fmt: skip


def test_comparison_and_goal():
    rows = comparison_rows([_run("elastic", 0.95, 60), _run("smallest", 0.5, 40),
                            _run("largest", 0.9, 120)])  # fmt: skip
    assert [r["ratio_vs_largest"] for r in rows] == [0.5, pytest.approx(1 / 3), 1.0]
    assert goal(rows) == {"attainment_ok": True, "instance_seconds_ok": True, "met": True}
    costly = comparison_rows([_run("elastic", 0.95, 90), _run("largest", 0.9, 120)])
    assert goal(costly)["met"] is False and goal(costly)["attainment_ok"] is True
    assert goal(comparison_rows([_run("elastic", 0.9, 1)])) is None  # no largest run
    table = "\n".join(elastic.summary_table(rows))
    assert "| elastic | 1P1D | 10/10 | 95% | 30 | 30 | 60 | 0.50 |" in table


def test_bench_elastic_flag_reaches_the_elastic_parser(capsys):
    """`pdcluster bench --elastic ...` is the elastic benchmark's command line."""
    assert cli_main(["bench", "--elastic", "--rate-steps", "1:x", "--slo-scale", "3"]) == 2
    assert "not RATE:SECONDS" in capsys.readouterr().err
    assert cli_main(["bench", "--elastic", "--runs", "elastic,huge", "--slo-scale", "3"]) == 2
    assert "--runs" in capsys.readouterr().err
