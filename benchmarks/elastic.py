"""`pdcluster bench --elastic`: an autoscaled P/D pool against fixed pools, under a stepped rate.

Requests take their prompt and output lengths from a trace (the Azure LLM conversation trace
by default, in trace order, scaled and clamped as in `pdcluster bench`) and arrive as a
Poisson process whose rate is piecewise constant (benchmarks/rate_profile.py):
`--rate-steps 0.3:60,1.2:60,0.3:60`, or `--rate-from-trace 300 --peak-rate R --step-s S`, the
trace's own rate per 300 s window scaled to a peak of R req/s, each window S seconds long. The
same requests (same arrival times, same prompt token ids) are replayed open loop, streaming,
against each pool (`--runs`):

- elastic: starts at the smallest size; the planner scales P and D within [min, max];
- smallest / largest: fixed at the minimum / maximum P and D;
- fixed: every fixed size in between (each P count × each D count), named like 2P1D.

Real models run each pool on a fresh multi-node Ray cluster on this machine: a head with 0
CPUs and one 1-CPU node per instance slot, declaring `pdcluster_prefill` or
`pdcluster_decode`, so that every instance gets a raylet of its own and KV blocks cross
raylets. A simulated model (`--model sim:PROFILE`, base config benchmarks/configs/
plan-sim.yaml) runs on one embedded Ray, and everything is in **modeled** time: with
`--time-scale S` the rates, SLOs, planner interval and cooldowns given are modeled, run S×
slower on the wall clock, and reported divided back; each run reports the share of simulated
steps that overran their modeled time (the host fell behind) and whether every instance ended
with all blocks free.

Every second (wall) the number of instances per role is sampled from the gateway's view of
the pool (an instance counts from when it joins the pool, ready, until it has drained and
left; its boot time is not counted); instance-seconds integrate those counts over the run
(first request sent to last answer). Only P and D count: these text-only pools run no
encoder, and the gateway and pool controller (in or beside this process) are not counted.
Per rate step, each run's attainment; from the fixed runs', the "oracle": the instance-seconds
of a pool that in every step had the fewest instances of any fixed run meeting 90% attainment
in that step, with no time to scale (the best any planner could do with those sizes). Writes
results.json, summary.md and elastic.png (request rate over time above instances per role).

The "nodes" of a real-model run share this machine's cores: on a small machine they
oversubscribe the CPU, so a larger pool buys less than real nodes would; summary.md states
the machine.

    python -m pdcluster.benchmarks.elastic --rate-steps 0.3:60,1.2:60,0.3:60 --model preset:small-llama \\
        --token-scale 0.25 --slo-scale 5,3 --out elastic-out
    python -m pdcluster.benchmarks.elastic --model sim:h100-llama-3.1-8b --time-scale 8 \\
        --rate-from-trace 300 --peak-rate 48 --step-s 3 --runs elastic,fixed \\
        --max-prefill 3 --max-decode 1 --ttft-slo-ms 250 --tpot-slo-ms 100 --out elastic-sim
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from pdcluster.benchmarks import report
from pdcluster.benchmarks.elastic_report import (
    ROLES,
    instance_seconds,
    step_attainment,
    topology_name,
    write_all,
)
from pdcluster.benchmarks.metrics import Slo
from pdcluster.benchmarks.rate_profile import (
    RateStep,
    parse_rate_steps,
    poisson_arrivals,
    stepped_workload,
    trace_rate_steps,
)
from pdcluster.benchmarks.targets import Target, keep_current_cluster_record, resolve_config
from pdcluster.benchmarks.workload import LengthScaling, Workload, trace_workload

STORE_BYTES = 100 * 1024 * 1024  # object store per Ray node
SAMPLE_INTERVAL_S = 1.0
SIM_CONFIG = Path(__file__).resolve().parent / "configs" / "plan-sim.yaml"
REAL_CONFIG = "local-1p1d"
FIXED_RUNS = ("smallest", "largest", "fixed")


def describe(workload: Workload) -> str:
    return (f"{workload.describe(with_rate=False)}; Poisson arrivals at rate steps "
            f"{workload.scaling['rate_steps']} (req/s:s)")  # fmt: skip


def is_sim(args: argparse.Namespace) -> bool:
    return str(args.model or "").startswith("sim:")


def scaled_arrivals(workload: Workload, scale: float) -> Workload:
    """The workload on the wall clock: every modeled arrival time × `scale`."""
    requests = tuple(replace(r, arrival_s=r.arrival_s * scale) for r in workload.requests)
    return Workload(requests, workload.scaling)


# ---- instance samples ----------------------------------------------------------------------
@dataclass(frozen=True)
class InstanceSample:
    t_s: float  # since the run started (modeled, for a simulated model)
    counts: dict[str, int]  # role -> live instances
    desired: dict[str, int] | None = None  # the planner's, where it runs


def role_counts(instances: dict[str, tuple[str, Any]]) -> dict[str, int]:
    """{role: count} of `Cluster.instances` (instance id -> (role, handle))."""
    counts = dict.fromkeys(ROLES, 0)
    for role, _ in instances.values():
        counts[role] = counts.get(role, 0) + 1
    return counts


# ---- runs -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSpec:
    name: str  # elastic, or the fixed pool's topology (e.g. 2P1D)
    sizes: dict[str, int]  # starting instances per role
    autoscale: dict[str, Any] | None = None


def run_specs(args: argparse.Namespace) -> list[RunSpec]:
    """The runs of `--runs` in order (a fixed size named twice runs once)."""
    smallest = {"prefill": args.min_prefill, "decode": args.min_decode}
    fixed = {
        "smallest": [smallest],
        "largest": [{"prefill": args.max_prefill, "decode": args.max_decode}],
        "fixed": [{"prefill": p, "decode": d}
                  for p in range(args.min_prefill, args.max_prefill + 1)
                  for d in range(args.min_decode, args.max_decode + 1)],
    }  # fmt: skip
    specs: dict[str, RunSpec] = {}
    for name in args.runs.split(","):
        if name == "elastic":
            specs.setdefault(name, RunSpec(name, smallest, autoscale_section(args)))
        for sizes in fixed.get(name, []):
            specs.setdefault(topology_name(sizes), RunSpec(topology_name(sizes), sizes))
    return list(specs.values())


def autoscale_section(args: argparse.Namespace) -> dict[str, Any]:
    """The planner's settings; its interval and cooldowns are modeled seconds, run × scale."""
    scale = args.time_scale
    return {
        "prefill": {"min": args.min_prefill, "max": args.max_prefill,
                    "target_queued_prefill_tokens": args.target_queued_prefill_tokens},
        "decode": {"min": args.min_decode, "max": args.max_decode,
                   "target_kv_usage": args.target_kv_usage,
                   "target_running_per_instance": args.target_running_per_decode},
        "interval_s": args.interval_s * scale,
        "scale_up_cooldown_s": args.scale_up_cooldown_s * scale,
        "scale_down_cooldown_s": args.scale_down_cooldown_s * scale,
        "scale_down_fraction": args.scale_down_fraction,
    }  # fmt: skip


def pool_config(args: argparse.Namespace, spec: RunSpec) -> dict[str, Any]:
    """The base config with the run's model and autoscaling; a real model's roles pinned to
    their nodes, a simulated one's time scale set."""
    base = args.config or (SIM_CONFIG if is_sim(args) else REAL_CONFIG)
    data = yaml.safe_load(resolve_config(str(base)).read_text(encoding="utf-8"))
    for role in ("encoder", "mixed"):
        data.pop(role, None)
    pinned: dict[str, dict[str, Any]] = {
        role: {} if is_sim(args) else {"num_cpus": 1, "resources": {f"pdcluster_{role}": 1}}
        for role in ROLES
    }
    for role in ROLES:
        data[role] = {**data.get(role, {}), "count": spec.sizes[role], **pinned[role]}
    data.pop("ray", None)  # this process starts or joins the Ray cluster itself
    data.pop("gateway", None)
    if args.model:
        data["model"] = args.model
    if is_sim(args):
        data.setdefault("engine", {})["sim_time_scale"] = args.time_scale
    if spec.autoscale:
        data["autoscale"] = spec.autoscale
    return data


@contextlib.contextmanager
def multinode_ray(num_nodes: dict[str, int]) -> Iterator[str]:
    """A fresh `ray.cluster_utils.Cluster` (0-CPU head, 1-CPU nodes declaring
    `pdcluster_<role>`), with this process connected as its driver; yields its address."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = None
    with keep_current_cluster_record():
        try:
            cluster = Cluster(initialize_head=True, head_node_args={
                "num_cpus": 0, "include_dashboard": False, "object_store_memory": STORE_BYTES})  # fmt: skip
            for role, count in num_nodes.items():
                for _ in range(count):
                    cluster.add_node(num_cpus=1, resources={f"pdcluster_{role}": 1},
                                     object_store_memory=STORE_BYTES)  # fmt: skip
            cluster.wait_for_nodes()
            ray.init(address=cluster.address, namespace="pdcluster-elastic", log_to_driver=False)
            yield cluster.address
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()


def ray_for_run(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """A real model's pool gets a fresh multi-node cluster (a node per slot of the largest
    pool); a simulated one runs on the embedded Ray of `ray_for_bench`."""
    if is_sim(args):
        return contextlib.nullcontext()
    return multinode_ray({"prefill": args.max_prefill, "decode": args.max_decode})


def ray_for_bench(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """For a simulated model, one embedded Ray for every run, with the CPUs of the largest
    pool's instances (starting Ray once: on a loaded host a start can time out)."""
    from pdcluster.benchmarks.targets import embedded_ray
    from pdcluster.cluster.config import ClusterConfig

    if not is_sim(args):
        return contextlib.nullcontext()
    largest = {"prefill": args.max_prefill, "decode": args.max_decode}
    config = ClusterConfig.model_validate(pool_config(args, RunSpec("largest", largest)))
    return embedded_ray(math.ceil(sum(config.role(r).num_cpus * largest[r] for r in ROLES)))


async def sample_instances(
    cluster: Any, start: float, samples: list[InstanceSample], with_planner: bool
) -> None:
    """Append one sample per SAMPLE_INTERVAL_S until cancelled."""
    while True:
        counts = _live_counts(cluster)
        desired = None
        if with_planner:
            with contextlib.suppress(Exception):  # a busy controller: no desired this time
                desired = (await asyncio.wait_for(cluster.planner_state(), 1.0)).desired
        samples.append(InstanceSample(time.perf_counter() - start, counts, desired))
        await asyncio.sleep(SAMPLE_INTERVAL_S)


def _live_counts(cluster: Any) -> dict[str, int]:
    """`role_counts` of the pool as the gateway sees it; its membership thread may change
    the map while it is copied: read again then."""
    for _ in range(10):
        with contextlib.suppress(RuntimeError):  # "dictionary changed size during iteration"
            return role_counts(cluster.instances)
    return role_counts(cluster.instances)


async def load_with_samples(
    target: Target, prepared: list, limit_s: float, with_planner: bool
) -> tuple[Any, list[InstanceSample]]:
    """The open-loop run, with the pool's size sampled beside it (same clock origin, to
    within the client's setup)."""
    from pdcluster.benchmarks.client import run_load

    samples: list[InstanceSample] = []
    start = time.perf_counter()
    sampler = asyncio.ensure_future(sample_instances(target.cluster, start, samples, with_planner))
    try:
        outcome = await run_load(target.url, prepared, limit_s, desc=f"{target.name} run")
    finally:
        sampler.cancel()
        (stopped,) = await asyncio.gather(sampler, return_exceptions=True)
    if not isinstance(stopped, asyncio.CancelledError):
        raise RuntimeError("the instance sampler stopped early") from stopped
    return outcome, samples


def modeled_latencies(summary: dict[str, Any], scale: float) -> dict[str, float | None]:
    """TTFT and TPOT p50 / p90 of a run's summary, divided back to modeled ms."""
    return {f"{metric}_{q}_ms": None if (v := summary[f"{metric}_ms"][q]) is None else v / scale
            for metric in ("ttft", "tpot") for q in ("p50", "p90")}  # fmt: skip


def measure_run(
    spec: RunSpec,
    target: Target,
    workload: Workload,
    slo: Slo | None,
    args: argparse.Namespace,
    steps: tuple[RateStep, ...],
) -> dict[str, Any]:
    from pdcluster.benchmarks import bench, plan
    from pdcluster.benchmarks.metrics import summarize
    from pdcluster.benchmarks.targets import wait_quiet

    wait_quiet(target)
    scale = args.time_scale
    wall = scaled_arrivals(workload, scale)
    prepared = bench.prepare(wall.requests, target.model, args.seed)  # same in every run
    limit_s = wall.requests[-1].arrival_s + args.drain_s
    steps_before = plan.sim_step_counts(target) if is_sim(args) else (0, 0)
    outcome, samples = asyncio.run(
        load_with_samples(target, prepared, limit_s, spec.autoscale is not None)
    )
    summary = summarize(outcome.results, outcome.duration_s, slo)
    print(report.run_line(spec.name, wall.mean_rate, summary))
    planner = asyncio.run(target.cluster.planner_state()) if spec.autoscale else None
    modeled = [InstanceSample(s.t_s / scale, s.counts, s.desired) for s in samples]
    result = {
        "name": spec.name,
        "sizes": spec.sizes,
        "autoscale": spec.autoscale,
        "summary": summary,
        "modeled_ms": modeled_latencies(summary, scale),
        "instance_seconds": instance_seconds(modeled, outcome.duration_s / scale),
        "step_attainment": step_attainment(outcome.results, steps, slo, scale) if slo else None,
        "samples": [asdict(s) for s in modeled],
        "planner": None if planner is None else planner.to_dict(),
        "loadavg_after": report.loadavg(),
        "requests": [r.to_dict() for r in outcome.results],
    }
    if is_sim(args):
        sim_steps, overrun = (a - b for a, b in zip(plan.sim_step_counts(target), steps_before))
        result.update(sim_steps=sim_steps, sim_steps_overrun=overrun,
                      all_blocks_free=plan.all_blocks_free(target))  # fmt: skip
    return result


def bench_run(
    spec: RunSpec,
    args: argparse.Namespace,
    workload: Workload,
    reference: Slo | None,
    steps: tuple[RateStep, ...],
) -> dict[str, Any]:
    """One pool on a fresh Ray cluster: warm up, SLOs (wall clock), the measured run."""
    from pdcluster.benchmarks import bench
    from pdcluster.benchmarks.targets import Variant, local_target

    config_path = Path(args.out) / "configs" / f"{spec.name}.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(pool_config(args, spec)), encoding="utf-8")
    print(f"\n== {spec.name}: {spec.sizes} {'autoscaled' if spec.autoscale else 'fixed'} ==")
    with ray_for_run(args), local_target(Variant(str(config_path)), None) as target:
        target.name = spec.name
        fitted = workload.fit(target.max_model_len)
        bench.warm_up(target, fitted, args.seed + 1)
        isolated = None
        if args.slo_scale and reference is None:
            isolated = bench.measure_isolated(target, fitted, args.isolated_requests, args.seed + 2)
        slo = bench.resolve_slo(_wall_slo_args(args), isolated, reference)
        result = measure_run(spec, target, fitted, slo, args, steps)
    result.update(config=str(config_path), isolated=isolated, model=target.model)
    result["slo"] = asdict(slo) if slo else None
    return result


def _wall_slo_args(args: argparse.Namespace) -> argparse.Namespace:
    """The SLO options on the wall clock (modeled × scale)."""
    scale = args.time_scale
    return argparse.Namespace(**{
        **vars(args), "ttft_slo_ms": args.ttft_slo_ms and args.ttft_slo_ms * scale,
        "tpot_slo_ms": args.tpot_slo_ms and args.tpot_slo_ms * scale,
    })  # fmt: skip


# ---- command line -----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from pdcluster.benchmarks.workload import default_trace

    p = argparse.ArgumentParser(prog="pdcluster bench --elastic", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    w = p.add_argument_group("workload (modeled seconds and req/s for a sim: model)")
    w.add_argument("--rate-steps", default="0.3:60,1.2:60,0.3:60", help="RATE:SECONDS,...")
    w.add_argument("--rate-from-trace", type=float, default=None, metavar="BIN_S",
                   help="instead of --rate-steps: the trace's rate per BIN_S-second window")  # fmt: skip
    w.add_argument("--peak-rate", type=float, default=None, help="the busiest window's req/s")
    w.add_argument("--step-s", type=float, default=None, help="seconds each window lasts")
    w.add_argument("--trace", default=str(default_trace()), help="trace CSV (default: %(default)s)")
    w.add_argument("--window-start-s", type=float, default=0.0, help="trace window start")
    w.add_argument("--token-scale", type=float, default=1.0, help="× trace prompt/output lengths")
    w.add_argument("--min-prompt-len", type=int, default=4)
    w.add_argument("--max-prompt-len", type=int, default=1536)
    w.add_argument("--min-output-len", type=int, default=2)
    w.add_argument("--max-output-len", type=int, default=512)
    w.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("pools")
    c.add_argument("--config", default=None,
                   help=f"base topology (default {REAL_CONFIG}; for a sim: model "
                   "benchmarks/configs/plan-sim.yaml)")  # fmt: skip
    c.add_argument("--model", default="preset:small-llama", help="model of every pool")
    c.add_argument("--runs", default="elastic,smallest,largest",
                   help="in order, a comma list of elastic, smallest, largest, fixed")  # fmt: skip
    c.add_argument("--time-scale", type=float, default=1.0,
                   help="a sim: model's modeled time runs this many times slower")  # fmt: skip
    for role, letter in (("prefill", "P"), ("decode", "D")):
        c.add_argument(f"--min-{role}", type=int, default=1, help=f"smallest {letter} count")
        c.add_argument(f"--max-{role}", type=int, default=3, help=f"largest {letter} count")
    a = p.add_argument_group("autoscaling (elastic run; seconds modeled for a sim: model)")
    a.add_argument("--interval-s", type=float, default=2.0)
    a.add_argument("--scale-up-cooldown-s", type=float, default=6.0)
    a.add_argument("--scale-down-cooldown-s", type=float, default=15.0)
    a.add_argument("--scale-down-fraction", type=float, default=0.5)
    a.add_argument("--target-queued-prefill-tokens", type=int, default=1024)
    a.add_argument("--target-running-per-decode", type=int, default=8)
    a.add_argument("--target-kv-usage", type=float, default=0.8)
    s = p.add_argument_group("SLOs (modeled ms for a sim: model)")
    s.add_argument("--ttft-slo-ms", type=float, default=None)
    s.add_argument("--tpot-slo-ms", type=float, default=None)
    s.add_argument("--slo-scale", help="K or K_ttft,K_tpot × isolated TTFT/TPOT (first run's)")
    s.add_argument("--isolated-requests", type=int, default=3, help="for --slo-scale")
    p.add_argument("--drain-s", type=float, default=120.0, help="run limit past the last arrival "
                   "(wall clock)")  # fmt: skip
    p.add_argument("--out", default="elastic-out", help="output folder")
    return p


def slo_source(args: argparse.Namespace) -> str:
    if not args.slo_scale:
        return "absolute (--ttft-slo-ms/--tpot-slo-ms)"
    return f"{args.slo_scale} × the first run's isolated TTFT,TPOT"


def rate_steps(args: argparse.Namespace) -> tuple[RateStep, ...]:
    if args.rate_from_trace is None:
        return parse_rate_steps(args.rate_steps)
    if args.peak_rate is None or args.step_s is None:
        raise ValueError("--rate-from-trace needs --peak-rate and --step-s")
    return trace_rate_steps(args.trace, args.rate_from_trace, args.peak_rate, args.step_s)


def build_workload(args: argparse.Namespace, steps: tuple[RateStep, ...]) -> Workload:
    arrivals = poisson_arrivals(steps, args.seed)
    lengths = LengthScaling(args.token_scale, args.min_prompt_len, args.max_prompt_len,
                            args.min_output_len, args.max_output_len)  # fmt: skip
    base = trace_workload(args.trace, lengths, args.window_start_s, max(1, len(arrivals)))
    return stepped_workload(base, arrivals, steps)


def _check(args: argparse.Namespace) -> None:
    runs = args.runs.split(",")
    if not args.runs or set(runs) - {"elastic", *FIXED_RUNS}:
        raise ValueError(f"--runs is a comma list of elastic, {', '.join(FIXED_RUNS)}")
    if not (1 <= args.min_prefill <= args.max_prefill and 1 <= args.min_decode <= args.max_decode):
        raise ValueError("need 1 <= --min-<role> <= --max-<role>")
    if not (args.slo_scale or args.ttft_slo_ms or args.tpot_slo_ms):
        raise ValueError("SLO attainment needs SLOs: --slo-scale or --ttft-slo-ms/--tpot-slo-ms")
    if args.time_scale <= 0:
        raise ValueError(f"--time-scale must be above 0 (got {args.time_scale})")
    if args.time_scale != 1 and not is_sim(args):
        raise ValueError("--time-scale needs a simulated model (--model sim:PROFILE)")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        _check(args)
        steps = rate_steps(args)
        workload = build_workload(args, steps)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only local clusters
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    print(f"workload: {describe(workload)}")
    if is_sim(args):
        print(f"time scale {args.time_scale:g}: modeled durations run {args.time_scale:g}× "
              "slower; the run lines below are wall clock, summary.md is modeled")  # fmt: skip
    results: dict[str, Any] = {
        "command": "pdcluster bench --elastic " + shlex.join(argv),
        "argv": argv,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": report.machine_info(),
        "workload": describe(workload),
        "rate_steps": [asdict(s) for s in steps],
        "time_scale": args.time_scale,
        "slo_source": slo_source(args),
        "note": SIM_NOTE if is_sim(args) else NOTE,
        "runs": [],
    }
    results["machine"]["loadavg_start"] = report.loadavg()
    reference: Slo | None = None
    with ray_for_bench(args):
        for spec in run_specs(args):
            run = bench_run(spec, args, workload, reference, steps)
            results["runs"].append(run)
            if reference is None and run["slo"]:
                reference = Slo(**run["slo"])
            results["machine"]["loadavg_end"] = report.loadavg()
            paths = write_all(results, steps, Path(args.out))  # a cut run keeps these
    print(paths[1].read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


NOTE = (
    "Every pool runs on a fresh multi-node Ray cluster on this one machine (0-CPU head, one "
    "1-CPU node per P/D slot of the largest pool): the nodes share the machine's cores, and "
    "oversubscribe them where there are fewer cores than nodes. Instance-seconds count P and "
    "D instances (no encoder runs) from joining the pool (ready) to leaving it (drained), "
    "sampled every second, over first request sent to last answer."
)
SIM_NOTE = (
    "Simulated model: every pool runs on a fresh embedded Ray on this machine; only the "
    "forward pass is modeled. Times, rates, SLOs, latencies and instance-seconds are modeled "
    "(wall ÷ the time scale); an instance's boot (joining the pool) takes its wall time ÷ the "
    "time scale, far less than a real GPU instance's. Instance-seconds count P and D instances "
    "from joining the pool (ready) to leaving it (drained), sampled every wall second, over "
    "first request sent to last answer. Steps overrun: the share of simulated steps that ran "
    "past their modeled time (the host fell behind)."
)


if __name__ == "__main__":
    sys.exit(main())
