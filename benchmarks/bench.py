"""`pdcluster bench`: serving benchmark of a pdcluster gateway, or of topologies it launches.

Replays a window of a trace (TIMESTAMP,ContextTokens,GeneratedTokens CSV; the Azure LLM
conversation trace by default) or a synthetic Poisson stream, open loop, streaming, and
reports TTFT / TPOT / ITL / e2e percentiles, throughput, SLO attainment and goodput (the
highest swept rate at which >= 90% of requests meet both SLOs). Writes results.json,
summary.md and PNG plots to --out. Launched topologies also report where each request's time
went (queue, prefill, handoff, decode: benchmarks/stages.py), from the instances' stage times.

    pdcluster bench --topologies local-1p1d,local-mixed --model preset:small-llama \\
        --token-scale 0.25 --num-requests 60 --rates 0.5,1,2,4 --slo-scale 5,3 --out bench-out
    pdcluster bench --topologies local-1p1d,local-mixed --model smollm2-135m \\
        --vary local-mixed:engine.max_num_batched_tokens=256,512,1024 --rates 0.2,0.4 ...
    pdcluster bench --url http://127.0.0.1:8000 --synthetic --rate 2 --prompt-len 256 \\
        --output-len 64 --num-requests 50 --ttft-slo-ms 500 --tpot-slo-ms 100

`pdcluster bench --elastic ...` is the elastic-vs-fixed benchmark (benchmarks/elastic.py,
`pdcluster bench --elastic --help`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shlex
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from pdcluster.benchmarks import report, stages
from pdcluster.benchmarks.client import (
    ClientProcess,
    PreparedRequest,
    RequestResult,
    run_load,
    stream_one,
)
from pdcluster.benchmarks.metrics import Slo, goodput, search_rates, summarize
from pdcluster.benchmarks.spec_metrics import read_spec_counters, spec_decode_delta
from pdcluster.benchmarks.targets import (
    Target,
    Variant,
    expand_variants,
    load_variant,
    local_target,
    shared_ray,
    url_target,
    wait_quiet,
)
from pdcluster.benchmarks.workload import (
    LengthScaling,
    RequestSpec,
    Workload,
    default_trace,
    request_body,
    synthetic_workload,
    token_prompt,
    trace_workload,
    with_images,
)

NUM_WARMUP = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdcluster bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    t = p.add_argument_group("target (one of)")
    t.add_argument("--url", help="base URL of a running gateway (model from /v1/models)")
    t.add_argument("--topologies", help="comma list of ray_configs names or YAML paths to launch")
    t.add_argument("--model", help="override each topology's model (e.g. preset:small-llama)")
    t.add_argument("--api-key", default=None, help="bearer key of the --url gateway")
    t.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="TOPOLOGY:KEY=V1,V2,...",
        help="run TOPOLOGY once per value of a config setting (KEY dotted as in the YAML, e.g.\n"
        "local-mixed:engine.max_num_batched_tokens=256,512,1024); repeat for a grid",
    )

    add_workload_arguments(p)

    s = p.add_argument_group("rates and SLOs")
    s.add_argument("--rates", help="comma list of rates (req/s) to sweep, or 'auto' (search)")
    s.add_argument("--search-steps", type=int, default=2, help="bisections of --rates auto")
    s.add_argument("--goodput-target", type=float, default=0.9, help="attainment for goodput")
    s.add_argument("--ttft-slo-ms", type=float, default=None)
    s.add_argument("--tpot-slo-ms", type=float, default=None)
    s.add_argument("--slo-scale", help="K or K_ttft,K_tpot × isolated TTFT/TPOT (measured first)")
    s.add_argument(
        "--slo-reference",
        choices=("first", "each"),
        default="first",
        help="isolated latency of the first topology sets every topology's SLOs (first), or "
        "each its own (each)",
    )
    s.add_argument("--isolated-requests", type=int, default=3, help="for --slo-scale")

    x = p.add_argument_group("extra measurements and limits")
    x.add_argument("--gateway-overhead", action="store_true", help="HTTP vs Python API TTFT")
    x.add_argument("--overhead-requests", type=int, default=20)
    x.add_argument("--max-run-s", type=float, default=600.0, help="one run stops itself after")
    x.add_argument("--drain-s", type=float, default=120.0, help="run limit past the last arrival")
    x.add_argument("--cdf-rate", type=float, default=None, help="rate of the CDF plots")
    x.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="at most N requests in flight; one arriving later waits for a free slot (as in\n"
        "`vllm bench serve`: the arrival schedule is kept, the sent rate may fall)",
    )
    x.add_argument(
        "--interleave",
        action="store_true",
        help="launch every topology at once and run each rate on each in turn (order flipping\n"
        "per rate), so a drifting background load on a shared machine falls on all alike",
    )
    x.add_argument(
        "--lora-models",
        type=lambda text: [m for m in text.split(",") if m],
        default=[],
        help="comma list of LoRA adapters the target serves (`--lora-modules`): the run's\n"
        "requests name them in turn as their model, instead of the base model",
    )
    x.add_argument("--out", default="bench-out", help="output folder")
    x.add_argument(
        "--save-vllm-json",
        metavar="PATH",
        default=None,
        help="also write each run as a `vllm bench serve --save-result --save-detailed` JSON\n"
        "object, one per line (one run: a plain JSON file)",
    )
    return p


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload options that `build_workload` reads (shared with `pdcluster plan`)."""
    w = p.add_argument_group("workload")
    w.add_argument(
        "--trace",
        default=str(default_trace()),
        help="trace CSV (default: the full Azure conv trace at ../shared/traces/ when present,\n"
        "else the packaged first-2,000-request sample; here: %(default)s)",
    )
    w.add_argument("--window-start-s", type=float, default=0.0, help="trace window start")
    w.add_argument("--num-requests", type=int, default=None, help="requests per run")
    w.add_argument("--duration-s", type=float, default=None, help="trace window length")
    w.add_argument("--token-scale", type=float, default=1.0, help="× trace prompt/output lengths")
    w.add_argument("--min-prompt-len", type=int, default=4)
    w.add_argument("--max-prompt-len", type=int, default=1536)
    w.add_argument("--min-output-len", type=int, default=2)
    w.add_argument("--max-output-len", type=int, default=512)
    w.add_argument("--rate-scale", type=float, default=1.0, help="× trace arrival rate")
    w.add_argument("--rate", type=float, default=None, help="target mean rate (req/s)")
    w.add_argument("--synthetic", action="store_true", help="Poisson arrivals at --rate")
    w.add_argument("--prompt-len", type=int, default=256, help="synthetic prompt length")
    w.add_argument("--output-len", type=int, default=64, help="synthetic output length")
    w.add_argument("--jitter", type=float, default=0.0, help="synthetic lengths ± this fraction")
    w.add_argument("--image-fraction", type=float, default=0.0, help="requests with an image")
    w.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        _check(args)
        variants = _variants(args)
        workload = build_workload(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    description = workload.describe(with_rate=not args.rates)
    if args.rates:
        description += f"; rates swept: {args.rates} req/s"
    results = {
        "command": "pdcluster bench " + shlex.join(argv),
        "argv": argv,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": report.machine_info(),
        "workload": {"description": description, "scaling": workload.scaling},
        "topologies": [],
    }
    print(f"workload: {description}")
    bench = bench_interleaved if args.interleave else bench_one_by_one
    for result in bench(args, workload, variants):
        results["topologies"].append(result)
        results["machine"]["loadavg_end"] = report.loadavg()
        paths = report.write_all(results, Path(args.out), args.cdf_rate)  # a cut run keeps these
    if args.save_vllm_json:
        paths["vllm_json"] = report.write_vllm_json(results, Path(args.save_vllm_json))
    print(paths["summary"].read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _check(args: argparse.Namespace) -> None:
    if bool(args.url) == bool(args.topologies):
        raise ValueError("give exactly one of --url and --topologies")
    if args.vary and args.url:
        raise ValueError("--vary needs --topologies (it changes the configs it launches)")
    if args.gateway_overhead and args.url:
        raise ValueError("--gateway-overhead needs --topologies (it calls the Python API)")
    if args.synthetic and args.rate is None and not args.rates:
        raise ValueError("--synthetic needs --rate (or --rates)")
    sweep = args.rates == "auto" or len((args.rates or "").split(",")) > 1
    if sweep and not (args.slo_scale or args.ttft_slo_ms or args.tpot_slo_ms):
        raise ValueError("a rate sweep (goodput) needs SLOs: --slo-scale or --*-slo-ms")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency is at least 1")
    if not 0 <= args.image_fraction <= 1:
        raise ValueError("--image-fraction is a fraction in [0, 1]")
    if args.interleave and (args.url or args.rates == "auto"):
        raise ValueError("--interleave needs --topologies and a list of --rates (not auto)")


def _variants(args: argparse.Namespace) -> list[Variant]:
    """The topologies to launch (each --vary point one), their configs checked up front."""
    if args.url:
        return []
    names = [n.strip() for n in args.topologies.split(",") if n.strip()]
    if not names:
        raise ValueError("--topologies names no topology")
    variants = expand_variants(names, args.vary)
    for variant in variants:
        load_variant(variant, args.model)
    return variants


def _targets(
    args: argparse.Namespace, variants: list[Variant]
) -> Iterator[tuple[contextlib.AbstractContextManager[Target], Variant | None]]:
    if args.url:
        yield contextlib.nullcontext(url_target(args.url, args.api_key)), None
        return
    for variant in variants:
        yield local_target(variant, args.model), variant


def build_workload(args: argparse.Namespace) -> Workload:
    if args.synthetic:
        rate = args.rate or float(args.rates.split(",")[0])
        num = args.num_requests or max(1, round((args.duration_s or 60.0) * rate))
        workload = synthetic_workload(
            rate, num, args.prompt_len, args.output_len, args.jitter, args.seed
        )
    else:
        lengths = LengthScaling(
            args.token_scale,
            args.min_prompt_len,
            args.max_prompt_len,
            args.min_output_len,
            args.max_output_len,
        )
        num = args.num_requests if args.num_requests or args.duration_s else 100
        workload = trace_workload(
            args.trace, lengths, args.window_start_s, num, args.duration_s, args.rate_scale
        )
        if args.rate is not None:
            workload = workload.at_rate(args.rate)
    if args.image_fraction:
        workload = with_images(workload, args.image_fraction, args.seed)
    return workload


# ---- one target -----------------------------------------------------------------------
@dataclass
class TargetBench:
    """One target's measurements: its result header (isolated latency, SLO) and its runs;
    `measure(rate)` adds one run and returns its attainment."""

    target: Target
    args: argparse.Namespace
    workload: Workload  # fitted to the target's context
    result: dict[str, Any]
    slo: Slo | None
    seeds: Iterator[int]  # fresh prompts for every run
    runs: list[dict[str, Any]] = field(default_factory=list)

    def measure(self, rate: float | None) -> float:
        run = run_rate(self.target, self.workload, rate, self.slo, self.args, next(self.seeds))
        self.runs.append(run)
        return run["summary"].get("attainment", 0.0)


def bench_target(
    target: Target, args: argparse.Namespace, workload: Workload, reference: Slo | None
) -> dict[str, Any]:
    """Warm up, measure isolated latency (for --slo-scale), run every rate, and the extras."""
    bench = start_target(target, args, workload, reference)
    if args.rates == "auto":
        start = args.rate or bench.workload.mean_rate
        search_rates(bench.measure, start, args.goodput_target, bisect_steps=args.search_steps)
    elif args.rates:
        for rate in swept_rates(args):
            bench.measure(rate)
    else:
        bench.measure(None)
    return finish_target(bench)


def start_target(
    target: Target, args: argparse.Namespace, workload: Workload, reference: Slo | None
) -> TargetBench:
    """Warm up, measure isolated latency (for --slo-scale) and set the SLO."""
    workload = workload.fit(target.max_model_len)
    print(f"\n== {target.name} ({target.topology or 'remote'}, model {target.model}) ==")
    seeds = iter(range(args.seed * 100_000 + 1, 10**9))
    warm_up(target, workload, next(seeds))
    result: dict[str, Any] = {
        "name": target.name,
        "url": target.url,
        "topology": target.topology,
        "config": target.config_path,
        "model": target.model,
        "max_model_len": target.max_model_len,
        "workload": workload.describe(with_rate=not args.rates),
    }
    if args.slo_scale:
        result["isolated"] = measure_isolated(target, workload, args.isolated_requests, next(seeds))
    slo = resolve_slo(args, result.get("isolated"), reference)
    if slo:
        result["slo"] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "source": _slo_source(
            args, reference)}  # fmt: skip
    return TargetBench(target, args, workload, result, slo, seeds)


def finish_target(bench: TargetBench) -> dict[str, Any]:
    """The target's result: its runs by rate, goodput over them, and the extras."""
    args, result = bench.args, bench.result
    result["runs"] = sorted(bench.runs, key=lambda r: r["rate_rps"])
    if bench.slo and len(bench.runs) > 1:
        points = [(r["rate_rps"], r["summary"]["attainment"]) for r in result["runs"]]
        result["goodput"] = goodput(points, args.goodput_target)
        print(f"goodput: {result['goodput']}")
    if args.gateway_overhead:
        result["gateway_overhead"] = measure_gateway_overhead(
            bench.target, bench.workload, args.overhead_requests, next(bench.seeds)
        )
    return result


def swept_rates(args: argparse.Namespace) -> list[float]:
    return sorted(float(r) for r in args.rates.split(","))


def bench_one_by_one(
    args: argparse.Namespace, workload: Workload, variants: list[Variant]
) -> Iterator[dict[str, Any]]:
    """Each target in turn: launched, measured at every rate, shut down."""
    reference: Slo | None = None
    for target_cm, variant in _targets(args, variants):
        with target_cm as target:
            result = bench_target(target, args, workload, reference)
        yield _with_settings(result, variant)
        if args.slo_reference == "first" and reference is None and result.get("slo"):
            reference = Slo(result["slo"]["ttft_ms"], result["slo"]["tpot_ms"])


def bench_interleaved(
    args: argparse.Namespace, workload: Workload, variants: list[Variant]
) -> Iterator[dict[str, Any]]:
    """--interleave: every topology is up at once (on one embedded Ray with the CPUs of them
    all) and each rate runs on each in turn, the order flipping from rate to rate (A B, B A,
    ...), so that a background load drifting on a shared machine falls on all of them alike.
    An idle topology's actors wait on their inboxes, so it costs the running one no CPU."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(shared_ray([v.config_name for v in variants]))
        targets = [stack.enter_context(local_target(v, args.model)) for v in variants]
        benches: list[TargetBench] = []
        reference: Slo | None = None
        for target in targets:
            benches.append(start_target(target, args, workload, reference))
            if args.slo_reference == "first" and reference is None:
                reference = benches[-1].slo
        for i, rate in enumerate(swept_rates(args) if args.rates else [None]):
            for bench in benches if i % 2 == 0 else benches[::-1]:
                bench.measure(rate)
        results = [finish_target(bench) for bench in benches]
    for result, variant in zip(results, variants):
        yield _with_settings(result, variant)


def _with_settings(result: dict[str, Any], variant: Variant | None) -> dict[str, Any]:
    """The result, labelled with the --vary settings its topology was launched with."""
    if variant is not None and variant.settings:
        result["settings"] = variant.settings
    return result


def run_rate(
    target: Target,
    workload: Workload,
    rate: float | None,
    slo: Slo | None,
    args: argparse.Namespace,
    seed: int,
) -> dict[str, Any]:
    """One open-loop run of the workload at `rate` (None: as built); waits for quiet first."""
    wait_quiet(target)
    if rate is not None:
        workload = workload.at_rate(rate)
    prepared = prepare(workload.requests, target.model, seed, args.lora_models)
    span = workload.requests[-1].arrival_s
    limit = min(args.max_run_s, span + args.drain_s)
    actual_rate = workload.mean_rate if len(workload.requests) > 1 else 0.0
    load_before = report.loadavg()
    spec_before = read_spec_counters(target.url, target.api_key)
    started_unix_s = time.time()
    outcome = asyncio.run(
        run_load(
            target.url,
            prepared,
            limit,
            target.api_key,
            f"{target.name} @ {actual_rate:.3g}",
            args.max_concurrency,
        )
    )
    summary = summarize(outcome.results, outcome.duration_s, slo)
    spec = spec_decode_delta(spec_before, read_spec_counters(target.url, target.api_key))
    if spec is not None:
        summary["spec_decode"] = spec
    print(report.run_line(target.name, actual_rate, summary) + f"   [{workload.describe()}]")
    records = [r.to_dict() for r in outcome.results]
    if target.cluster is not None:  # launched here: the replica's traces are at hand
        per_request = stages.join(prepared, outcome.results, target.cluster.front.traces())
        for record, stage_ms in zip(records, per_request):
            record["stages_ms"] = stage_ms
        summary["stages_ms"] = stages.summarize_stages(per_request)
    return {
        "rate_rps": actual_rate,
        "scaling": workload.scaling,
        "workload": workload.describe(),
        "max_concurrency": args.max_concurrency,
        "max_run_s": limit,
        "started_unix_s": started_unix_s,
        "loadavg": {"before": load_before, "after": report.loadavg()},  # a shared machine?
        "summary": summary,
        "requests": records,
    }


def warm_up(target: Target, workload: Workload, seed: int) -> None:
    """A few short requests one after another, before anything is measured."""
    _sequential(target, [_median_spec(workload, 8)] * NUM_WARMUP, seed)


def prepare(
    specs: tuple[RequestSpec, ...] | list[RequestSpec],
    model: str,
    seed: int,
    lora_models: list[str] | None = None,
):
    """Request bodies built before the run (token ids and PNGs cost nothing during it);
    with `lora_models`, request i names lora_models[i % len] as its model."""
    rng = random.Random(seed)
    models = lora_models or [model]
    return [
        PreparedRequest(s, *request_body(s, models[i % len(models)], rng))
        for i, s in enumerate(specs)
    ]


def _median_spec(workload: Workload, max_output: int | None = None) -> RequestSpec:
    specs = workload.requests
    output = int(statistics.median(s.output_len for s in specs))
    return RequestSpec(
        0.0,
        int(statistics.median(s.prompt_len for s in specs)),
        min(output, max_output) if max_output else output,
        any(s.has_image for s in specs),
    )


def _sequential(target: Target, specs: list[RequestSpec], seed: int) -> list[RequestResult]:
    """Requests one after another (concurrency 1)."""

    async def go() -> list[RequestResult]:
        from pdcluster.benchmarks.client import make_client

        async with make_client(target.api_key) as client:
            return [
                await stream_one(client, target.url, r, RequestResult(r.spec))
                for r in prepare(specs, target.model, seed)
            ]

    results = asyncio.run(go())
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"requests to {target.url} failed: {failed[0]}")
    return results


def measure_isolated(target: Target, workload: Workload, num: int, seed: int) -> dict[str, Any]:
    """Single requests on the idle cluster at the workload's median lengths: the TTFT and
    TPOT that --slo-scale multiplies (medians over `num`)."""
    spec = _median_spec(workload)
    results = _sequential(target, [spec] * num, seed)
    isolated = {
        "prompt_len": spec.prompt_len,
        "output_len": spec.output_len,
        "has_image": spec.has_image,
        "num_requests": num,
        "ttft_ms": statistics.median(r.ttft_s for r in results) * 1e3,
        "tpot_ms": statistics.median(r.tpot_s for r in results) * 1e3,
    }
    print(f"isolated (concurrency 1, prompt {spec.prompt_len}, output {spec.output_len}): "
          f"TTFT {isolated['ttft_ms']:.1f} ms, TPOT {isolated['tpot_ms']:.1f} ms")  # fmt: skip
    return isolated


def resolve_slo(
    args: argparse.Namespace, isolated: dict[str, Any] | None, reference: Slo | None
) -> Slo | None:
    """Absolute SLOs where given, else the scale × isolated latency (of the first topology
    under --slo-reference first)."""
    scaled: Slo | None = reference
    if args.slo_scale and scaled is None and isolated:
        k = [float(x) for x in args.slo_scale.split(",")]
        k_ttft, k_tpot = (k[0], k[0]) if len(k) == 1 else (k[0], k[1])
        scaled = Slo(k_ttft * isolated["ttft_ms"], k_tpot * isolated["tpot_ms"])
    ttft = args.ttft_slo_ms or (scaled.ttft_ms if scaled else None)
    tpot = args.tpot_slo_ms or (scaled.tpot_ms if scaled else None)
    if ttft is None and tpot is None:
        return None
    return Slo(ttft or float("inf"), tpot or float("inf"))


def _slo_source(args: argparse.Namespace, reference: Slo | None) -> str:
    if not args.slo_scale:
        return "absolute (--ttft-slo-ms/--tpot-slo-ms)"
    whose = "the first topology's" if reference or args.slo_reference == "first" else "this"
    return f"{args.slo_scale} × {whose} isolated TTFT,TPOT"


def measure_gateway_overhead(
    target: Target, workload: Workload, num: int, seed: int
) -> dict[str, Any]:
    """At concurrency 1: TTFT through HTTP minus TTFT through `Cluster.stream` (which
    includes `make_request`), same prompt lengths, fresh token ids each (no prefix-cache
    hit), alternating which path goes first.

    The HTTP requests come from a separate client process over one keep-alive connection
    (as a real client's would), so the client neither shares the GIL of the gateway, which
    runs in a thread of this process, nor pays a connection setup per request. The Python
    API requests run on one event loop of this process's main thread, idle while the
    client process waits for its answer."""
    if target.cluster is None:
        raise ValueError("--gateway-overhead needs a launched topology")
    spec = replace(_median_spec(workload, 4), has_image=False)
    rng = random.Random(seed)
    http_ms: list[float] = []
    api_ms: list[float] = []
    wait_quiet(target)
    loop = asyncio.new_event_loop()
    try:
        with ClientProcess(target.url, target.api_key) as client:
            for i in range(num):
                for path in ("http", "api") if i % 2 == 0 else ("api", "http"):
                    if path == "http":
                        http_ms.append(_http_ttft(client, target, spec, rng) * 1e3)
                    else:
                        ttft = loop.run_until_complete(_api_ttft(target.cluster, spec, rng))
                        api_ms.append(ttft * 1e3)
    finally:
        loop.close()
    diffs = [h - a for h, a in zip(http_ms, api_ms)]
    out = {
        "num_requests": num,
        "prompt_len": spec.prompt_len,
        "output_len": spec.output_len,
        "client": "separate process, one keep-alive connection",
        "http_ttft_ms_median": statistics.median(http_ms),
        "api_ttft_ms_median": statistics.median(api_ms),
        "overhead_ms_median": statistics.median(diffs),
        "overhead_ms_of_medians": statistics.median(http_ms) - statistics.median(api_ms),
    }
    print(f"gateway overhead (concurrency 1, {num} pairs, prompt {spec.prompt_len}): "
          f"HTTP TTFT {out['http_ttft_ms_median']:.2f} ms - API TTFT "
          f"{out['api_ttft_ms_median']:.2f} ms = {out['overhead_ms_median']:.2f} ms "
          "(median of pairs)")  # fmt: skip
    return out


def _http_ttft(
    client: ClientProcess, target: Target, spec: RequestSpec, rng: random.Random
) -> float:
    result = client.send(prepare([spec], target.model, rng.randrange(2**31))[0])
    if not result.ok:
        raise RuntimeError(f"requests to {target.url} failed: {result.error}")
    return result.ttft_s


async def _api_ttft(cluster: Any, spec: RequestSpec, rng: random.Random) -> float:
    from pdcluster.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=spec.output_len, ignore_eos=True)
    prompt = token_prompt(spec.prompt_len, rng)
    start = time.perf_counter()
    request = cluster.make_request(prompt, params)
    ttft = None
    async for out in cluster.stream(request):
        if ttft is None and out.new_token_ids:
            ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("the Python API stream produced no token")
    return ttft


if __name__ == "__main__":
    sys.exit(main())
