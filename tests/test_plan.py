"""`pdcluster plan`: candidate splits, the table and the choice, and one short simulated run."""

from __future__ import annotations

import json

import pytest

from pdcluster.benchmarks import plan
from pdcluster.benchmarks.plan import RatePoint, Split, SplitResult
from pdcluster.cluster import cli


def test_candidate_splits_are_every_pd_split_then_all_mixed():
    names = [s.name for s in plan.candidate_splits(4)]
    assert names == ["1P3D", "2P2D", "3P1D", "4mixed"]
    assert all(s.num_instances == 4 for s in plan.candidate_splits(4))
    assert [s.name for s in plan.candidate_splits(1)] == ["1mixed"]
    assert plan.Split(2, 1).settings() == {
        "encoder.count": 0, "prefill.count": 2, "decode.count": 1, "mixed.count": 0,
    }  # fmt: skip
    with pytest.raises(ValueError, match="at least 1"):
        plan.candidate_splits(0)


def test_with_encoder_the_candidates_add_every_epd_split_of_the_same_count():
    names = [s.name for s in plan.candidate_splits(4, with_encoder=True)]
    assert names == ["1P3D", "2P2D", "3P1D", "1E1P2D", "1E2P1D", "2E1P1D", "4mixed"]
    assert all(s.num_instances == 4 for s in plan.candidate_splits(4, with_encoder=True))
    assert [s.name for s in plan.candidate_splits(2, with_encoder=True)] == ["1P1D", "2mixed"]
    assert plan.Split(1, 1, num_encoder=1).settings()["encoder.count"] == 1


def test_splits_can_be_narrowed_to_named_candidates():
    candidates = plan.candidate_splits(3)
    assert [s.name for s in plan.select_splits(candidates, "2p1d, 3mixed")] == ["2P1D", "3mixed"]
    with pytest.raises(ValueError, match="not candidates.*1P2D, 2P1D, 3mixed"):
        plan.select_splits(candidates, "4mixed")


def _result(split: Split, attainments: dict[float, float], overrun: int = 0) -> SplitResult:
    points = tuple(
        RatePoint(rate, a, 10, 10, 100.0, 20.0, sim_steps=100, sim_steps_overrun=overrun)
        for rate, a in attainments.items()
    )
    return SplitResult(split, points)


def test_the_best_split_is_the_trusted_one_with_the_highest_goodput_per_instance():
    results = [
        _result(Split(1, 3), {2: 1.0, 4: 0.95, 8: 0.5}),
        _result(Split(2, 2), {2: 1.0, 4: 1.0, 8: 0.92}),
        _result(Split(3, 1), {2: 1.0, 4: 1.0, 8: 1.0}, overrun=20),  # the host fell behind
        _result(Split(0, 0, 4), {2: 0.5, 4: 0.2, 8: 0.0}),
    ]
    assert results[0].goodput()["interpolated_rps"] == pytest.approx(4 + 4 * 0.05 / 0.45)
    assert results[2].overrun_share == pytest.approx(0.2) and not results[2].trusted()
    assert plan.best_split(results).split.name == "2P2D"
    table = plan.format_table(results).splitlines()
    assert table[2].startswith("| 1P3D | 4 | 4.44 | 1.11 | 2: 100%, 4: 95%, 8: 50% | 0.0% | yes")
    assert table[4].startswith("| 3P1D | 8 | 8 | 2 |") and "| 20.0% | **no** |" in table[4]
    assert table[5].startswith("| 4mixed | — | — | — |")
    assert plan.verdict(results).startswith("best split: 2P2D, goodput ≥ 8 req/s (≥ 2 per")
    results[1] = _result(Split(2, 2), {2: 1.0, 4: 1.0, 8: 0.5, 16: 0.0})
    assert plan.verdict(results) == "best split: 2P2D, goodput 4.8 req/s (1.2 per instance)"


def test_the_latency_table_has_a_row_per_split_and_rate_in_modeled_ms():
    point = RatePoint(40.0, 0.95, 19, 20, 120.0, 9.5, 100, 0, ttft_p50_ms=61.25, tpot_p50_ms=8.0)
    no_tpot = RatePoint(80.0, 0.5, 20, 20, 400.0, None, 100, 0)
    rows = plan.latency_table([SplitResult(Split(1, 1, num_encoder=1), (point, no_tpot))])
    assert rows.splitlines()[2:] == [
        "| 1E1P1D | 40 | 61.2 | 120 | 8 | 9.5 | 95% |",
        "| 1E1P1D | 80 | — | 400 | — | — | 50% |",
    ]


def test_a_best_split_that_held_at_the_top_rate_is_a_lower_bound_and_ties_are_named():
    results = [_result(Split(3, 1), {4: 1.0, 8: 1.0}), _result(Split(0, 0, 4), {4: 1.0, 8: 0.95})]
    assert plan.verdict(results) == (
        "best split: 3P1D, goodput ≥ 8 req/s (≥ 2 per instance), tied with 4mixed; it held at "
        "the highest rate run: add higher --rates to separate"
    )


def test_an_untrusted_split_is_chosen_only_when_none_is_trusted_and_says_so():
    results = [_result(Split(1, 1), {2: 1.0}, overrun=30), _result(Split(0, 0, 2), {2: 0.1})]
    line = plan.verdict(results)
    assert line.startswith("best split: 1P1D") and "untrustworthy: 30% of its steps" in line
    assert plan.verdict(results[1:]).startswith("best split: none")


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--instances", "0"], "--instances must be at least 1"),
        (["--instances", "2", "--splits", "3P1D"], "--splits '3P1D': not candidates"),
        (["--instances", "2", "--rates", "fast"], "--rates 'fast'"),
        (["--instances", "2", "--time-scale", "0"], "--time-scale must be above 0"),
        (["--instances", "2", "--set", "engine.max_num_seqs=0"], "max_num_seqs"),
    ],
)
def test_bad_plan_input_is_a_clear_error_before_anything_runs(capsys, extra, message):
    argv = ["plan", "--profile", "h100-llama-3.1-8b", "--slo-ttft-ms", "250",
            "--slo-tpot-ms", "100", "--synthetic", "--rate", "1", *extra]  # fmt: skip
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_plan_runs_each_split_on_the_simulator_and_names_the_best(ray_session, tmp_path, capsys):
    out = tmp_path / "plan"
    argv = ["--profile", "h100-llama-3.1-8b", "--instances", "2", "--slo-ttft-ms", "2000",
            "--slo-tpot-ms", "500", "--synthetic", "--num-requests", "4", "--prompt-len", "64",
            "--output-len", "6", "--rates", "4", "--time-scale", "2", "--out", str(out)]  # fmt: skip
    assert plan.main(argv) == 0
    printed = capsys.readouterr().out
    assert "time scale 2" in printed and "| 1P1D |" in printed and "| 2mixed |" in printed
    data = json.loads((out / "plan.json").read_text())
    assert [s["name"] for s in data["splits"]] == ["1P1D", "2mixed"]
    for split in data["splits"]:
        (point,) = split["points"]
        assert point["rate_rps"] == pytest.approx(4.0)  # modeled: the wall-clock rate × scale
        assert point["num_ok"] == point["num_requests"] == 4
        assert point["sim_steps"] > 0 and point["ttft_p90_ms"] > 0
        assert split["all_blocks_free"]
    assert data["best"] in ("1P1D", "2mixed") and f"best split: {data['best']}" in printed
    assert (out / "plan.md").read_text().count("| 2mixed |") == 2  # goodput and latency rows
    assert (out / "plan.png").stat().st_size > 0


@pytest.mark.slow  # a 3-instance launch: ~1 min on 2 busy cores
def test_plan_runs_an_epd_split_with_images_on_the_multimodal_profile(ray_session, tmp_path):
    out = tmp_path / "plan"
    argv = ["--profile", "h100-llava-llama-3.1-8b", "--instances", "3", "--with-encoder",
            "--splits", "1E1P1D", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "500", "--synthetic",
            "--num-requests", "4", "--prompt-len", "16", "--output-len", "4",
            "--image-fraction", "1", "--rates", "4", "--time-scale", "2", "--out", str(out)]  # fmt: skip
    assert plan.main(argv) == 0
    (split,) = json.loads((out / "plan.json").read_text())["splits"]
    (point,) = split["points"]
    assert split["name"] == "1E1P1D" and split["all_blocks_free"]
    assert point["num_ok"] == point["num_requests"] == 4 and point["ttft_p50_ms"] > 0
