"""`pdcluster bench --elastic`: rate schedule and profiles, arrivals, instance-seconds, attainment
per step, the oracle, the comparison and its goal (no Ray), and a short simulated run."""

from __future__ import annotations

import json
from argparse import Namespace

import numpy as np
import pytest

from pdcluster.benchmarks import elastic, elastic_report, rate_profile
from pdcluster.benchmarks.client import RequestResult
from pdcluster.benchmarks.elastic import InstanceSample, role_counts
from pdcluster.benchmarks.elastic_report import (
    comparison_rows,
    goal,
    instance_seconds,
    oracle_instance_seconds,
    step_attainment,
)
from pdcluster.benchmarks.metrics import Slo
from pdcluster.benchmarks.rate_profile import (
    RateStep,
    parse_rate_steps,
    poisson_arrivals,
    rate_at,
    stepped_workload,
    trace_rate_steps,
)
from pdcluster.benchmarks.workload import LengthScaling, RequestSpec, trace_workload
from pdcluster.cluster.cli import main as cli_main
from tests.test_bench import TRACE


def test_rate_steps_parse_and_reject_malformed():
    steps = parse_rate_steps("0.3:60, 1.2:30,0:10")
    assert steps == (RateStep(0.3, 60), RateStep(1.2, 30), RateStep(0.0, 10))
    assert rate_profile.format_rate_steps(steps) == "0.3:60,1.2:30,0:10"
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


def _run(name, attainment, total, sizes=(1, 1), autoscale=None, steps=None):
    seconds = {"prefill": total / 2, "decode": total / 2, "total": total}
    summary = {"attainment": attainment, "num_ok": 10, "num_requests": 10}
    return {"name": name, "sizes": {"prefill": sizes[0], "decode": sizes[1]}, "summary": summary,
            "instance_seconds": seconds, "autoscale": autoscale, "step_attainment": steps}  # fmt: skip


def test_comparison_and_goal_against_the_fixed_pool_with_the_most_instances():
    rows = comparison_rows([_run("elastic", 0.95, 60, autoscale={}), _run("1P1D", 0.5, 40),
                            _run("2P2D", 0.9, 120, sizes=(2, 2))])  # fmt: skip
    assert [r["ratio_vs_largest"] for r in rows] == [0.5, pytest.approx(1 / 3), 1.0]
    assert [r["is_largest"] for r in rows] == [False, False, True]
    assert goal(rows) == {"attainment_ok": True, "instance_seconds_ok": True, "met": True,
                          "largest": "2P2D"}  # fmt: skip
    costly = comparison_rows([_run("elastic", 0.95, 90, autoscale={}),
                              _run("2P2D", 0.9, 120, sizes=(2, 2))])  # fmt: skip
    assert goal(costly)["met"] is False and goal(costly)["attainment_ok"] is True
    assert goal(comparison_rows([_run("elastic", 0.9, 1, autoscale={})])) is None  # no fixed run
    table = "\n".join(elastic_report.summary_table(rows))
    assert (
        "| elastic | 1P1D | 10/10 | 95% | — / — | — / — | 30.0 | 30.0 | 60.0 | 0.50 | — | — |"
        in (table)
    )


def test_a_trace_rate_profile_keeps_the_traces_rate_shape_scaled_to_the_peak(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)  # arrivals at 0, 4.3, 4.5, 4.7, 10 and 20 s
    steps = trace_rate_steps(path, bin_s=5, peak_rps=8, step_s=2)
    assert steps == (RateStep(8, 2), RateStep(0, 2), RateStep(2, 2), RateStep(0, 2))
    with pytest.raises(ValueError, match="no full 30 s window"):
        trace_rate_steps(path, bin_s=30, peak_rps=8, step_s=2)
    with pytest.raises(ValueError, match="above 0"):
        trace_rate_steps(path, bin_s=5, peak_rps=0, step_s=2)


def _result(arrival_s: float, ttft_s: float) -> RequestResult:
    return RequestResult(RequestSpec(arrival_s, 8, 2), ttft_s=ttft_s, e2e_s=ttft_s + 0.01,
                         num_output_tokens=2)  # fmt: skip


def test_attainment_per_step_counts_requests_by_their_modeled_arrival():
    steps = parse_rate_steps("1:10,5:10,0:10")
    slo = Slo(ttft_ms=200, tpot_ms=100)  # wall clock, as the runs measure
    results = [_result(4, 0.1), _result(18, 0.1), _result(22, 0.5), _result(30, 0.1),
               _result(39, 0.1), RequestResult(RequestSpec(25, 8, 2), error="boom")]  # fmt: skip
    # At time scale 2, wall arrivals 4 and 18 fall in step 0; 22, 25, 30 and 39 in step 1.
    assert step_attainment(results, steps, slo, scale=2) == [1.0, 0.5, None]


def test_the_oracle_takes_per_step_the_smallest_fixed_pool_meeting_the_target():
    steps = parse_rate_steps("1:10,5:10,0:10")
    runs = [
        _run("elastic", 0.9, 50, autoscale={}, steps=[1.0, 0.2, None]),
        _run("1P1D", 0.6, 60, steps=[0.95, 0.3, None]),
        _run("2P1D", 0.9, 90, sizes=(2, 1), steps=[1.0, 0.85, None]),
        _run("3P1D", 0.95, 120, sizes=(3, 1), steps=[1.0, 0.92, None]),
    ]
    # 2 instances in step 0, 4 in step 1 (only 3P1D meets 90%), 2 in the silent step 2.
    assert oracle_instance_seconds(runs, steps) == pytest.approx(2 * 10 + 4 * 10 + 2 * 10)
    runs[-1]["step_attainment"] = [1.0, 0.5, None]  # none meets step 1: the largest counts
    assert oracle_instance_seconds(runs, steps) == pytest.approx(80)
    assert oracle_instance_seconds(runs[:1], steps) is None
    table = elastic_report.step_table(runs[:2], steps)
    assert table[0] == "| run \\ step rate (req/s) | 1 | 5 | 0 |"
    assert table[2:] == ["| elastic | 100% | 20% | — |", "| 1P1D | 95% | 30% | — |"]


def test_scale_events_time_each_desired_change_until_the_pool_has_it():
    def sample(t_s, prefill, desired_prefill):
        return {"t_s": t_s, "counts": {"prefill": prefill, "decode": 1},
                "desired": {"prefill": desired_prefill, "decode": 1}}  # fmt: skip

    samples = [sample(0, 1, 1), sample(1, 1, 2), sample(2, 1, 2), sample(3, 2, 2),
               sample(4, 2, 1), sample(5, 1, 1), sample(6, 1, 2)]  # fmt: skip
    assert elastic_report.scale_events(samples) == [
        {"role": "prefill", "t_s": 1, "count": 1, "desired": 2, "reached_s": 3},
        {"role": "prefill", "t_s": 4, "count": 2, "desired": 1, "reached_s": 5},
        {"role": "prefill", "t_s": 6, "count": 1, "desired": 2, "reached_s": None},
    ]


def _args(*argv: str) -> Namespace:
    return elastic.build_parser().parse_args(["--ttft-slo-ms", "250", *argv])


def test_fixed_runs_cover_every_size_once_and_a_sim_pool_runs_in_modeled_time():
    args = _args("--runs", "elastic,smallest,fixed", "--max-prefill", "3", "--max-decode", "1",
                 "--model", "sim:h100-llama-3.1-8b", "--time-scale", "8",
                 "--interval-s", "0.25", "--scale-up-cooldown-s", "0.5")  # fmt: skip
    specs = elastic.run_specs(args)
    assert [s.name for s in specs] == ["elastic", "1P1D", "2P1D", "3P1D"]
    assert specs[0].autoscale["interval_s"] == 2.0  # modeled 0.25 s on the wall clock
    assert specs[0].autoscale["scale_up_cooldown_s"] == 4.0
    config = elastic.pool_config(args, specs[2])
    assert config["prefill"]["count"] == 2 and config["engine"]["sim_time_scale"] == 8
    assert config["prefill"]["num_cpus"] == 0.25 and "resources" not in config["prefill"]
    real = elastic.pool_config(_args("--runs", "largest"), specs[2])
    assert real["prefill"]["resources"] == {"pdcluster_prefill": 1}
    assert "sim_time_scale" not in real.get("engine", {})


def test_bench_elastic_flag_reaches_the_elastic_parser(capsys):
    """`pdcluster bench --elastic ...` is the elastic benchmark's command line."""
    assert cli_main(["bench", "--elastic", "--rate-steps", "1:x", "--slo-scale", "3"]) == 2
    assert "not RATE:SECONDS" in capsys.readouterr().err
    assert cli_main(["bench", "--elastic", "--runs", "elastic,huge", "--slo-scale", "3"]) == 2
    assert "--runs" in capsys.readouterr().err
    assert cli_main(["bench", "--elastic", "--time-scale", "4", "--slo-scale", "3"]) == 2
    assert "--time-scale needs a simulated model" in capsys.readouterr().err
    assert cli_main(["bench", "--elastic", "--rate-from-trace", "300", "--slo-scale", "3"]) == 2
    assert "needs --peak-rate and --step-s" in capsys.readouterr().err


def test_a_simulated_pool_run_reports_modeled_time_and_ends_clean(ray_session, tmp_path):
    out = tmp_path / "elastic"
    argv = ["--model", "sim:h100-llama-3.1-8b", "--time-scale", "2", "--rate-steps", "20:0.4",
            "--runs", "largest", "--max-prefill", "1", "--max-decode", "1",
            "--max-prompt-len", "64", "--max-output-len", "4", "--ttft-slo-ms", "2000",
            "--tpot-slo-ms", "500", "--drain-s", "30", "--out", str(out)]  # fmt: skip
    assert elastic.main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    (run,) = data["runs"]
    assert run["name"] == "1P1D" and run["all_blocks_free"] and run["sim_steps"] > 0
    assert run["summary"]["num_ok"] == run["summary"]["num_requests"] > 0
    assert run["slo"]["ttft_ms"] == 4000  # the modeled SLO on the wall clock
    assert run["step_attainment"] == [run["summary"]["attainment"]]
    # 2 instances from the first sample to the last answer, in modeled seconds (wall ÷ 2).
    first_s, end_s = run["samples"][0]["t_s"], run["summary"]["duration_s"] / 2
    assert run["instance_seconds"]["total"] == pytest.approx(2 * (end_s - first_s), rel=0.01)
    assert data["oracle_instance_seconds"] == pytest.approx(2 * 0.4)  # 1P1D over the schedule
    assert (out / "elastic.png").stat().st_size > 0
