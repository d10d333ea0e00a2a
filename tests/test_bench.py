"""`pdcluster bench`: workload windowing and scaling, percentiles, goodput (no Ray), and a
smoke run that launches two tiny topologies on the session's Ray."""

from __future__ import annotations

import asyncio
import json
import math
import random

import httpx
import numpy as np
import pytest
import yaml
from prometheus_client import generate_latest

from pdcluster.actors.messages import InstanceStats
from pdcluster.benchmarks import bench, client, report, workload
from pdcluster.benchmarks.client import PreparedRequest, RequestResult, run_load
from pdcluster.benchmarks.metrics import (
    Slo,
    goodput,
    percentile,
    search_rates,
    summarize,
    vllm_result,
)
from pdcluster.benchmarks.spec_metrics import parse_spec_counters, spec_decode_delta
from pdcluster.benchmarks.targets import expand_variants, load_variant
from pdcluster.benchmarks.workload import (
    FIRST_ORDINARY_TOKEN_ID,
    MAX_RANDOM_TOKEN_ID,
    LengthScaling,
    RequestSpec,
    load_trace,
    request_body,
    scale_len,
    synthetic_workload,
    trace_workload,
    window,
    with_images,
)
from pdcluster.cluster.api.metrics import GatewayMetrics
from pdcluster.engine.spec_decode.metrics import SpecDecodingStats

TRACE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,55
2023-11-16 18:15:51.3910170,91,16
2023-11-16 18:15:56.6805900,4000,1
2023-11-16 18:16:06.6805900,10,700
"""


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    return path


def test_trace_times_are_relative_and_precise(trace):
    rows = load_trace(trace)
    assert [r.prompt_len for r in rows] == [374, 396, 879, 91, 4000, 10]
    assert rows[0].arrival_s == 0
    assert rows[1].arrival_s == pytest.approx(4.314579)
    assert rows[-1].arrival_s == pytest.approx(20.0)


def test_window_by_start_count_and_duration(trace):
    rows = load_trace(trace)
    w = window(rows, start_s=4.0, num_requests=3)
    assert [r.prompt_len for r in w] == [396, 879, 91]
    assert w[0].arrival_s == 0 and w[1].arrival_s == pytest.approx(0.227298)
    assert [r.prompt_len for r in window(rows, 4.0, duration_s=5.0)] == [396, 879, 91]
    with pytest.raises(ValueError, match="no requests"):
        window(rows, start_s=100)


def test_token_scaling_clamps_to_bounds(trace):
    assert scale_len(374, 0.25, 4, 1536) == 94
    assert scale_len(4000, 1.0, 4, 1536) == 1536
    assert scale_len(1, 0.25, 2, 512) == 2
    lengths = LengthScaling(0.5, min_prompt_len=8, max_prompt_len=1000, min_output_len=2,
                            max_output_len=300)  # fmt: skip
    w = trace_workload(trace, lengths, rate_scale=2.0)
    assert [r.prompt_len for r in w.requests] == [187, 198, 440, 46, 1000, 8]
    assert [r.output_len for r in w.requests] == [22, 54, 28, 8, 2, 300]
    assert w.requests[-1].arrival_s == pytest.approx(10.0)  # twice the trace's rate
    assert w.mean_rate == pytest.approx(0.5)
    assert "×0.5" in w.describe() and "0.5 req/s" in w.describe()


def test_retiming_keeps_burstiness(trace):
    w = trace_workload(trace, LengthScaling())
    fast = w.at_rate(2.0)
    assert fast.mean_rate == pytest.approx(2.0)
    gaps = np.diff([r.arrival_s for r in w.requests])
    fast_gaps = np.diff([r.arrival_s for r in fast.requests])
    np.testing.assert_allclose(fast_gaps / gaps, fast_gaps[0] / gaps[0])
    assert [r.prompt_len for r in fast.requests] == [r.prompt_len for r in w.requests]


def test_fit_cuts_prompts_to_the_context(trace):
    w = trace_workload(trace, LengthScaling(max_prompt_len=5000, max_output_len=1000)).fit(1024)
    assert all(r.prompt_len + r.output_len <= 1024 for r in w.requests)
    assert w.scaling["num_cut_to_fit"] == 1
    assert "cut to max_model_len 1024" in w.describe()


def test_synthetic_workload_rate_and_jitter():
    w = synthetic_workload(rate=4.0, num_requests=400, prompt_len=100, output_len=20, jitter=0.2)
    assert len(w.requests) == 400
    assert w.mean_rate == pytest.approx(4.0)
    assert all(80 <= r.prompt_len <= 120 and 16 <= r.output_len <= 24 for r in w.requests)
    gaps = np.diff([r.arrival_s for r in w.requests])
    assert 0.8 < gaps.std() / gaps.mean() < 1.2  # exponential gaps: CV about 1
    assert with_images(w, 1.0).requests[0].has_image
    assert not any(r.has_image for r in with_images(w, 0.0).requests)
    half = sum(r.has_image for r in with_images(w, 0.5).requests)
    assert 150 < half < 250


def test_request_bodies_have_exact_lengths():
    path, body = request_body(RequestSpec(0, 50, 7), "m", random.Random(0))
    assert path == "/v1/completions"
    assert len(body["prompt"]) == 50 and body["max_tokens"] == 7 and body["ignore_eos"]
    assert all(FIRST_ORDINARY_TOKEN_ID <= t < MAX_RANDOM_TOKEN_ID for t in body["prompt"])
    path, body = request_body(RequestSpec(0, 10, 3, has_image=True), "m", random.Random(0))
    assert path == "/v1/chat/completions" and body["max_completion_tokens"] == 3
    parts = body["messages"][0]["content"]
    assert parts[0]["image_url"]["url"].startswith("data:image/png;base64,")
    assert len(parts[1]["text"].split()) == 10


def test_lora_models_take_turns_as_the_requests_model():
    specs = [RequestSpec(0, 5, 2)] * 5
    assert [r.body["model"] for r in bench.prepare(specs, "base", 0)] == ["base"] * 5
    models = [r.body["model"] for r in bench.prepare(specs, "base", 0, ["a", "b"])]
    assert models == ["a", "b", "a", "b", "a"]
    args = bench.build_parser().parse_args(["--url", "http://x", "--lora-models", "a,b"])
    assert args.lora_models == ["a", "b"]


def test_percentile_matches_numpy():
    values = [random.Random(1).random() for _ in range(37)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0


def _result(ttft_s, e2e_s, n, error=None):
    return RequestResult(RequestSpec(0, 10, n), ttft_s=ttft_s, e2e_s=e2e_s,
                         num_output_tokens=n, error=error)  # fmt: skip


def test_summary_counts_and_attainment():
    results = [
        _result(0.1, 1.1, 11),  # TPOT 100 ms: meets both
        _result(0.3, 0.5, 3),  # TTFT misses
        _result(0.1, 3.1, 11),  # TPOT 300 ms misses
        _result(0.1, 0.1, 1),  # one token: no TPOT, meets
        _result(None, None, 0, error="HTTP 500"),
    ]
    assert results[0].tpot_s == pytest.approx(0.1) and results[3].tpot_s is None
    s = summarize(results, duration_s=2.0, slo=Slo(ttft_ms=200, tpot_ms=150))
    assert (s["num_requests"], s["num_ok"], s["num_errors"]) == (5, 4, 1)
    assert s["attainment"] == pytest.approx(2 / 5)
    assert s["ttft_attainment"] == pytest.approx(3 / 5)
    assert s["tpot_attainment"] == pytest.approx(3 / 5)
    assert s["throughput_rps"] == 2.0 and s["output_tokens_per_s"] == 13.0
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0) and s["first_error"] == "HTTP 500"


def test_goodput_takes_the_passing_prefix_and_interpolates():
    g = goodput([(1, 1.0), (2, 0.95), (4, 0.5), (8, 0.92)])
    assert g["rps"] == 2  # 8 passing after 4 failing does not count as goodput
    assert g["max_passing_rps"] == 8  # but is reported
    assert g["interpolated_rps"] == pytest.approx(2 + 2 * 0.05 / 0.45)
    assert goodput([(1, 0.5)])["rps"] is None
    assert goodput([(1, 1.0), (2, 0.9)])["interpolated_rps"] == 2


def test_rate_search_doubles_then_bisects():
    capacity = 5.0
    seen = []

    def measure(rate):
        seen.append(rate)
        return 1.0 if rate <= capacity else 0.0

    points = search_rates(measure, start=1.0, bisect_steps=3)
    assert seen[:4] == [1, 2, 4, 8]
    g = goodput(points)
    assert 4 <= g["rps"] <= capacity and capacity - g["rps"] < 1.0
    down = search_rates(lambda r: 1.0 if r <= 0.3 else 0.0, start=1.0, bisect_steps=0)
    assert [r for r, _ in down] == [1.0, 0.5, 0.25]


def test_missing_trace_is_a_clear_error(tmp_path, capsys):
    code = bench.main(["--url", "http://127.0.0.1:9", "--trace", str(tmp_path / "nope.csv")])
    assert code == 2
    assert "nope.csv not found" in capsys.readouterr().err


def test_sweep_without_slo_is_refused(capsys):
    code = bench.main(["--url", "http://x", "--synthetic", "--rates", "1,2"])
    assert code == 2 and "needs SLOs" in capsys.readouterr().err


def test_vary_expands_a_topology_into_one_variant_per_combination():
    varies = [
        "local-mixed:engine.max_num_batched_tokens=256,512",
        "local-mixed:mixed.num_cpus=1,0.5",
    ]
    variants = expand_variants(["local-1p1d", "local-mixed"], varies)
    assert [v.name for v in variants] == [
        "local-1p1d",
        "local-mixed[engine.max_num_batched_tokens=256,mixed.num_cpus=1]",
        "local-mixed[engine.max_num_batched_tokens=256,mixed.num_cpus=0.5]",
        "local-mixed[engine.max_num_batched_tokens=512,mixed.num_cpus=1]",
        "local-mixed[engine.max_num_batched_tokens=512,mixed.num_cpus=0.5]",
    ]
    assert variants[2].overrides() == {
        "engine": {"max_num_batched_tokens": 256},
        "mixed": {"num_cpus": 0.5},
    }
    config = load_variant(variants[3], "preset:small-llama")
    assert config.engine.max_num_batched_tokens == 512 and config.model == "preset:small-llama"
    assert config.engine_settings("mixed").max_num_batched_tokens == 512


@pytest.mark.parametrize(
    ("vary", "message"),
    [
        ("local-1p1d:engine.max_num_batched_tokens=64", "not one of --topologies"),
        ("local-mixed:engine.max_num_batched_tokens", "expected TOPOLOGY:KEY=V1,V2"),
        ("local-mixed:engine.max_num_batched_tokens=0", "max_num_batched_tokens"),
        ("local-mixed:engine.no_such_setting=1", "no_such_setting"),
    ],
)
def test_a_bad_vary_is_a_clear_error_before_anything_runs(capsys, vary, message):
    argv = ["--topologies", "local-mixed", "--vary", vary, "--rates", "1"]
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_default_trace_is_the_packaged_sample_without_shared(tmp_path):
    path = workload.default_trace(tmp_path / "shared" / "traces" / "absent.csv")
    assert path == workload.PACKAGED_TRACE and path.is_file() and "shared" not in path.parts
    rows = load_trace(path)
    assert len(rows) == 2000 and rows[0].prompt_len == 374  # the full trace's first rows
    shared = tmp_path / "full.csv"
    shared.write_text(TRACE)
    assert workload.default_trace(shared) == shared


def _fake_gateway(monkeypatch, chunk_delay_s, num_tokens=3):
    """An httpx transport that streams `num_tokens` completion chunks per request; returns
    a dict whose "peak" is the most requests it had in flight at once."""
    state = {"in_flight": 0, "peak": 0}

    async def handler(request: httpx.Request) -> httpx.Response:
        state["in_flight"] += 1
        state["peak"] = max(state["peak"], state["in_flight"])

        async def body():
            try:
                for _ in range(num_tokens):
                    await asyncio.sleep(chunk_delay_s)
                    yield b'data: {"choices": [{"index": 0, "text": "x"}]}\n\n'
                usage = {"prompt_tokens": 4, "completion_tokens": num_tokens}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1

        return httpx.Response(200, content=body())

    transport = httpx.MockTransport(handler)
    monkeypatch.setattr(client, "make_client", lambda api_key=None: httpx.AsyncClient(
        transport=transport))  # fmt: skip
    return state


def _burst(num):
    return [PreparedRequest(RequestSpec(0.0, 4, 3), "/v1/completions", {}) for _ in range(num)]


@pytest.mark.parametrize("max_concurrency, peak", [(None, 6), (2, 2), (1, 1)])
def test_max_concurrency_caps_requests_in_flight(monkeypatch, max_concurrency, peak):
    state = _fake_gateway(monkeypatch, chunk_delay_s=0.01)
    outcome = asyncio.run(run_load("http://gw", _burst(6), 30.0, max_concurrency=max_concurrency))
    assert state["peak"] == peak
    assert all(r.ok and r.num_output_tokens == 3 for r in outcome.results)
    sends = [r.send_s for r in outcome.results]
    if max_concurrency:  # the rest waited for a slot: sent after the first ones
        assert min(sends[max_concurrency:]) > max(sends[:max_concurrency])


def test_max_concurrency_deadline_cancels_waiting_requests(monkeypatch):
    _fake_gateway(monkeypatch, chunk_delay_s=0.2)
    outcome = asyncio.run(run_load("http://gw", _burst(3), 0.05, max_concurrency=1))
    errors = [r.error for r in outcome.results]
    assert errors[0] == "cancelled at the run's deadline"
    assert all("waiting for a --max-concurrency slot" in e for e in errors[1:])


def test_max_concurrency_below_one_is_refused(capsys):
    code = bench.main(["--url", "http://x", "--synthetic", "--rate", "1", "--max-concurrency", "0"])
    assert code == 2 and "--max-concurrency" in capsys.readouterr().err


VLLM_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls",
    "latencies", "start_times", "queue_times", "errors",
    *(f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p99")),
}  # fmt: skip


def _synthetic_results():
    results = [
        _result(0.1, 1.1, 11),
        _result(0.3, 0.5, 3),
        _result(0.2, 0.2, 1),
        _result(None, None, 0, error="HTTP 500"),
    ]
    for r in results[:2]:  # one ITL per token after the first
        r.itl_s = [(r.e2e_s - r.ttft_s) / (r.num_output_tokens - 1)] * (r.num_output_tokens - 1)
    run = {
        "rate_rps": 2.0,
        "scaling": {"source": "synthetic"},
        "max_concurrency": 2,
        "summary": summarize(results, 2.0, Slo(ttft_ms=200, tpot_ms=150)),
        "requests": [r.to_dict() for r in results],
    }
    return {"topologies": [{"name": "1P1D", "model": "m", "runs": [run, run]}]}


def test_vllm_json_has_vllms_keys_and_units(tmp_path):
    results = _synthetic_results()
    topo = results["topologies"][0]
    out = vllm_result(topo, topo["runs"][0], "20261130-120000")
    assert set(out) == VLLM_KEYS
    assert (out["num_prompts"], out["completed"], out["failed"]) == (4, 3, 1)
    assert (out["max_concurrency"], out["request_rate"], out["burstiness"]) == (2, 2.0, 1.0)
    assert out["total_input_tokens"] == 30 and out["total_output_tokens"] == 15
    assert out["request_throughput"] == 1.5 and out["output_throughput"] == 7.5
    assert out["total_token_throughput"] == 22.5
    assert out["request_goodput"] == 1.0  # 2 of 4 meet both SLOs (the second's TTFT misses)
    assert out["ttfts"] == pytest.approx([0.1, 0.3, 0.2, 0.0])  # seconds, 0 for failed
    assert out["output_lens"] == [11, 3, 1, 0] and out["errors"][3] == "HTTP 500"
    assert len(out["itls"][0]) == 10 and out["itls"][0][0] == pytest.approx(0.1)
    assert out["mean_ttft_ms"] == pytest.approx(200.0)
    assert out["std_ttft_ms"] == pytest.approx(np.std([100, 300, 200]))
    assert out["median_tpot_ms"] == pytest.approx(100.0)  # mean of 100 and 100: (0.5-0.3)/2
    assert out["p99_e2el_ms"] == pytest.approx(np.percentile([1100, 500, 200], 99))
    path = report.write_vllm_json(results, tmp_path / "vllm.jsonl")
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and set(json.loads(lines[0])) == VLLM_KEYS


# ---- smoke run on Ray ---------------------------------------------------------------------
def _config(tmp_path, model_dir, name, roles):
    data = {
        "model": model_dir,
        "engine": {
            "block_size": 4,
            "num_blocks": 256,
            "max_num_batched_tokens": 256,
            "max_num_seqs": 32,
            "max_model_len": 256,
        },  # fmt: skip
        **{role: {"count": count, "num_cpus": 1} for role, count in roles.items()},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_bench_smoke_two_topologies(ray_session, preset_dir, tmp_path):
    model_dir = preset_dir("tiny-llava")
    pd = _config(tmp_path, model_dir, "pd", {"prefill": 1, "decode": 1})
    mixed = _config(tmp_path, model_dir, "mixed", {"mixed": 1})
    out = tmp_path / "out"
    argv = ["--topologies", f"{pd},{mixed}", "--vary", f"{mixed}:engine.max_num_batched_tokens=16",
            "--synthetic", "--num-requests", "8",
            "--prompt-len", "24", "--output-len", "6", "--jitter", "0.5", "--rates", "4,16",
            "--slo-scale", "5,3", "--isolated-requests", "2", "--image-fraction", "0.25",
            "--gateway-overhead", "--overhead-requests", "2", "--out", str(out),
            "--max-concurrency", "6", "--save-vllm-json", str(out / "vllm.jsonl")]  # fmt: skip
    assert bench.main(argv) == 0
    vllm_runs = [json.loads(line) for line in (out / "vllm.jsonl").read_text().splitlines()]
    mixed_16 = f"{mixed}[engine.max_num_batched_tokens=16]"
    assert [(v["label"], v["max_concurrency"], v["completed"]) for v in vllm_runs] == [
        (name, 6, 8) for name in (pd, pd, mixed_16, mixed_16)
    ]

    results = json.loads((out / "results.json").read_text())
    assert results["command"].startswith("pdcluster bench --topologies")
    assert results["machine"]["cpu_count"] >= 1
    topos = results["topologies"]
    assert [t["topology"] for t in topos] == ["1P1D", "1mixed"]
    assert "settings" not in topos[0]
    assert topos[1]["settings"] == {"engine.max_num_batched_tokens": 16}
    _check_stages(topos[0], handoff=True)
    _check_stages(topos[1], handoff=False)
    for topo in topos:
        assert topo["slo"] == topos[0]["slo"]  # the first topology's isolated latency sets it
        assert topo["isolated"]["ttft_ms"] > 0 and topo["isolated"]["tpot_ms"] > 0
        assert [round(r["rate_rps"]) for r in topo["runs"]] == [4, 16]
        for run in topo["runs"]:
            s = run["summary"]
            assert s["num_requests"] == len(run["requests"]) == 8
            assert s["num_ok"] + s["num_errors"] == 8 and s["num_ok"] == 8
            assert 0 <= s["attainment"] <= 1
            assert s["ttft_ms"]["p50"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"]
            for r in run["requests"]:
                assert r["num_output_tokens"] == r["output_len"]
                # a chunk per engine output: a token, or the tokens that arrived together
                assert min(1, r["output_len"] - 1) <= len(r["itl_ms"]) <= r["output_len"] - 1
            assert any(r["has_image"] for r in run["requests"])
        assert topo["goodput"]["rps"] in (None, 4.0, 16.0)
        overhead = topo["gateway_overhead"]
        assert overhead["http_ttft_ms_median"] > 0 and overhead["api_ttft_ms_median"] > 0
    (comparison,) = results["comparisons"]
    assert [row["rate_rps"] for row in comparison["per_rate"]] == [
        r["rate_rps"] for r in topos[0]["runs"]
    ]
    summary = (out / "summary.md").read_text()
    assert "Ratios: " in summary and "Goodput" in summary and "synthetic Poisson" in summary
    assert summary.count("Where the time went") == 2 and "kv_wait" in summary
    for png in ("attainment_vs_rate.png", "ttft_cdf.png", "tpot_cdf.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not math.isnan(results["cdf_rate_rps"])


@pytest.mark.slow  # two topologies at every rate: test_bench_smoke_two_topologies covers the runner
def test_bench_interleaved_runs_each_rate_on_each_topology_in_turn(
    ray_session, preset_dir, tmp_path
):
    model_dir = preset_dir("tiny-llava")
    pd = _config(tmp_path, model_dir, "pd", {"prefill": 1, "decode": 1})
    mixed = _config(tmp_path, model_dir, "mixed", {"mixed": 1})
    out = tmp_path / "out"
    argv = ["--topologies", f"{pd},{mixed}", "--interleave", "--synthetic", "--num-requests",
            "4", "--prompt-len", "16", "--output-len", "4", "--rates", "4,8,16",
            "--image-fraction", "1", "--ttft-slo-ms", "60000", "--out", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    first, second = results["topologies"]
    assert [t["topology"] for t in (first, second)] == ["1P1D", "1mixed"]
    starts = [[r["started_unix_s"] for r in t["runs"]] for t in (first, second)]
    a, b = starts
    assert a[0] < b[0] < b[1] < a[1] < a[2] < b[2]  # A B, B A, A B
    for topo in (first, second):
        assert [run["summary"]["num_ok"] for run in topo["runs"]] == [4, 4, 4]
    assert [row["rate_rps"] for row in results["comparisons"][0]["per_rate"]] == [4, 8, 16]


def test_interleave_needs_launched_topologies_and_listed_rates(capsys):
    code = bench.main(["--url", "http://x", "--interleave", "--synthetic", "--rate", "1"])
    assert code == 2 and "--interleave needs --topologies" in capsys.readouterr().err


def _check_stages(topo, handoff):
    """Every text request of every run has its stage durations; a 1P1D one its handoff."""
    for run in topo["runs"]:
        texts = [r for r in run["requests"] if not r["has_image"]]
        assert run["summary"]["stages_ms"]["num_traced"] == len(texts) > 0
        for r in texts:
            stages = r["stages_ms"]
            for name in ("to_instance", "queue", "prefill", "to_replica", "decode"):
                assert stages[name] >= 0, (name, stages)
            assert stages["decode"] <= r["e2e_ms"]
            assert (stages["kv_wait"] is not None) == handoff
            if handoff:
                assert stages["to_decode"] >= 0 and stages["first_decode_step"] > 0
        assert all(r["stages_ms"] is None for r in run["requests"] if r["has_image"])


def test_handoff_ttft_smoke_reports_the_pd_over_prefill_alone_ratio(
    ray_session, preset_dir, tmp_path
):
    from pdcluster.benchmarks import handoff_ttft

    argv = ["--model", preset_dir("tiny-llama"), "--num-prompts", "2", "--prompt-tokens", "64",
            "--max-tokens", "3", "--token-range", "100,1000", "--out", str(tmp_path)]  # fmt: skip
    assert handoff_ttft.main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    summary = result["summary"]
    assert summary["ttft_pd_over_prefill_alone_p50"] > 0
    assert len(result["pd"]["ttft_ms"]) == len(result["prefill_alone"]["ttft_ms"]) == 2
    assert all(t > 0 for t in result["pd"]["ttft_ms"] + result["prefill_alone"]["ttft_ms"])
    assert result["pd"]["stage_p50_ms"]["prefill"] is not None  # P's traced stage
    assert result["pd"]["stage_p50_ms"]["to_decode"] is not None  # the handoff reached D


def test_sessions_smoke_compares_pool_off_and_on_and_reports_the_p_added_mid_run(
    ray_session, preset_dir, tmp_path
):
    from pdcluster.benchmarks import sessions

    argv = ["--model", preset_dir("tiny-llama"), "--prefills", "1", "--decodes", "1",
            "--num-sessions", "3", "--turns", "3", "--system-tokens", "40",
            "--user-tokens", "8,16", "--reply-tokens", "4", "--session-rate", "20",
            "--think-s", "0.2", "--num-blocks", "64", "--max-model-len", "512",
            "--token-range", "100,1000", "--add-prefill-at-s", "0", "--out", str(tmp_path)]  # fmt: skip
    assert sessions.main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    for variant in (result["off"], result["on"]):
        assert variant["turns"] == 9
        assert variant["follow_up_prompt_tokens_computed"] <= variant["follow_up_prompt_tokens"]
        added = variant["added_prefill"]
        assert added["instance_id"].endswith("-prefill-1")  # the second P of the pool
        assert added["up_at_s"] >= added["asked_at_s"] >= 0
        assert 0 <= added["follow_ups"] <= 6
        assert added["follow_up_prompt_tokens_computed"] <= added["follow_up_prompt_tokens"]
    assert result["off"]["kv_pool_hit_tokens"] == 0
    assert result["on"]["kv_pool"]["num_entries"] > 0  # P and D published


def test_front_cost_reads_the_loads_latencies_and_scaling():
    from pdcluster.benchmarks.front_cost import Side, load_latency, scaling_report

    latency = load_latency([[0.1, 0.2, 0.4], [0.3, 0.5], []])  # seconds from each send
    assert latency["ttft_p50"] == pytest.approx(200.0)
    assert latency["gap_p50"] == pytest.approx(200.0)  # gaps 0.1, 0.2, 0.2
    assert latency["gap_p99"] == pytest.approx(200.0)
    one = Side("replicas-1", {"front": 500.0}, 10_000, {}, load_s=2.0, load_latency=latency)
    two = Side("replicas-2", {"front": 900.0}, 18_000, {}, load_s=2.0, load_latency=latency)
    table = scaling_report([one, two]).splitlines()
    assert table[2].startswith("| replicas-1 | 5000 | 1.00 | 50 | 0.25 |")
    assert table[3].startswith("| replicas-2 | 9000 | 1.80 | 50 | 0.45 |")


def test_own_threads_count_python_threads_but_not_an_actor_processs_main_thread():
    """The idle split (benchmarks/front_cost.py): a Python thread's CPU is pdcluster's own, an
    actor process's main thread (Ray's task loop) is not, unless it is the serving process."""
    import os
    import threading
    import time

    from pdcluster.benchmarks.front_cost import _own_threads_cpu_s

    def burn(cpu_s: float) -> None:
        start = time.thread_time()
        while time.thread_time() - start < cpu_s:
            pass

    pid, not_root = os.getpid(), -1
    before = _own_threads_cpu_s(pid, not_root)
    burn(0.3)  # on the main thread
    assert _own_threads_cpu_s(pid, not_root) - before < 0.1
    assert _own_threads_cpu_s(pid, pid) >= 0.3  # the serving process: its main thread counts

    readings: list[float] = []

    def burn_and_read() -> None:  # read while it runs: a finished thread leaves /proc
        burn(0.3)
        readings.append(_own_threads_cpu_s(pid, not_root) - before)

    thread = threading.Thread(target=burn_and_read)
    thread.start()
    thread.join(60)
    assert readings[0] >= 0.25


def test_a_runs_drafts_are_read_from_metrics_under_vllms_names():
    metrics = GatewayMetrics("m", max_model_len=64)

    def counters(*drafts: SpecDecodingStats | None) -> dict[str, float]:
        metrics.instances.snapshot = [
            InstanceStats(f"D{i}", "decode", spec_decode=d) for i, d in enumerate(drafts)
        ]
        return parse_spec_counters(generate_latest(metrics.registry).decode())

    before = counters(SpecDecodingStats(2, 8, 5, [2, 2, 1, 0]), None)
    after = counters(SpecDecodingStats(4, 16, 9, [4, 3, 2, 0]), SpecDecodingStats(2, 8, 8, [2] * 4))
    spec = spec_decode_delta(before, after)
    assert spec == {
        "num_drafts": 4,
        "num_draft_tokens": 16,
        "num_accepted_tokens": 12,
        "acceptance_rate": 0.75,
        "accepted_per_draft_by_position": [1.0, 0.75, 0.75, 0.5],
    }
    summary = {"num_ok": 1, "num_requests": 1, "output_tokens_per_s": 9.0, "spec_decode": spec}
    summary |= {
        "ttft_ms": {"p50": 1, "p90": 1, "p99": 1},
        "tpot_ms": {"p50": 1, "p90": 1, "p99": 1},
    }
    assert "drafts: 12 of 16 tokens accepted (0.75)" in report.run_line("t", 1.0, summary)
    assert spec_decode_delta(after, after) is None  # nothing drafted during the run
    assert spec_decode_delta(None, after) is None  # /metrics unreadable
