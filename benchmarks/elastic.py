"""`pdcluster bench --elastic`: an autoscaled P/D pool against fixed pools, under a stepped rate.

Requests take their prompt and output lengths from a trace (the Azure LLM conversation trace
by default, in trace order, scaled and clamped as in `pdcluster bench`) and arrive as a
Poisson process whose rate is piecewise constant: `--rate-steps 0.3:60,1.2:60,0.3:60` is
0.3 req/s for 60 s, then 1.2 req/s for 60 s, then 0.3 req/s for 60 s. The same requests
(same arrival times, same prompt token ids) are replayed open loop, streaming, against three
pools, each on a fresh multi-node Ray cluster on this machine: a head with 0 CPUs and one
1-CPU node per instance slot, declaring `pdcluster_prefill` or `pdcluster_decode`, so that
every instance gets a raylet of its own and KV blocks cross raylets. The runs:

- elastic: starts at the smallest size; the planner scales P and D within [min, max];
- smallest: fixed at the minimum P and D;
- largest: fixed at the maximum P and D.

Every second the number of instances per role is sampled from the gateway's view of the
pool (an instance counts from when it joins the pool, ready, until it has drained and left;
its boot time is not counted); instance-seconds integrate those counts over the run (first
request sent to last answer). Only P and D count: these text-only pools run no encoder, and
the gateway and pool controller (in or beside this process) are not counted. Writes
results.json, summary.md and elastic.png (request rate over time above instances per role)
to --out.

The "nodes" share this machine's cores: on a small machine they oversubscribe the CPU, so a
larger pool buys less than real nodes would; summary.md states the machine.

    python -m benchmarks.elastic --rate-steps 0.3:60,1.2:60,0.3:60 --model preset:small-llama \\
        --token-scale 0.25 --slo-scale 5,3 --out elastic-out
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from benchmarks import report
from benchmarks.metrics import Slo
from benchmarks.targets import Target, keep_current_cluster_record, resolve_config
from benchmarks.workload import LengthScaling, Workload, trace_workload

ROLES = ("prefill", "decode")
STORE_BYTES = 100 * 1024 * 1024  # object store per Ray node
SAMPLE_INTERVAL_S = 1.0
GOAL_INSTANCE_SECONDS_RATIO = 0.7  # elastic at most this × the largest pool's instance-seconds


# ---- rate schedule ----------------------------------------------------------------------
@dataclass(frozen=True)
class RateStep:
    rate_rps: float
    duration_s: float


def parse_rate_steps(text: str) -> tuple[RateStep, ...]:
    """'0.3:60,1.2:60' -> steps of (req/s, seconds); ValueError on a malformed one."""
    steps = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        rate, sep, seconds = part.partition(":")
        try:
            step = RateStep(float(rate), float(seconds))
        except ValueError:
            raise ValueError(f"rate step {part!r} is not RATE:SECONDS") from None
        if not sep or step.rate_rps < 0 or step.duration_s <= 0:
            raise ValueError(f"rate step {part!r}: need RATE >= 0 and SECONDS > 0")
        steps.append(step)
    if not steps:
        raise ValueError("--rate-steps needs at least one RATE:SECONDS")
    return tuple(steps)


def format_rate_steps(steps: tuple[RateStep, ...]) -> str:
    return ",".join(f"{s.rate_rps:g}:{s.duration_s:g}" for s in steps)


def step_starts(steps: tuple[RateStep, ...]) -> list[float]:
    """Start time of each step, and the schedule's end last."""
    starts = [0.0]
    for step in steps:
        starts.append(starts[-1] + step.duration_s)
    return starts


def rate_at(steps: tuple[RateStep, ...], t_s: float) -> float:
    """The scheduled rate at `t_s` (0 outside the schedule)."""
    starts = step_starts(steps)
    for step, start, end in zip(steps, starts, starts[1:]):
        if start <= t_s < end:
            return step.rate_rps
    return 0.0


def poisson_arrivals(steps: tuple[RateStep, ...], seed: int = 0) -> list[float]:
    """Arrival times of a Poisson process whose rate is each step's within that step
    (exponential gaps are memoryless, so restarting the clock at each step is exact)."""
    rng = random.Random(seed)
    starts = step_starts(steps)
    arrivals: list[float] = []
    for step, start, end in zip(steps, starts, starts[1:]):
        t = start
        while step.rate_rps > 0 and (t := t + rng.expovariate(step.rate_rps)) < end:
            arrivals.append(t)
    return arrivals


def stepped_workload(
    base: Workload, arrivals: list[float], steps: tuple[RateStep, ...]
) -> Workload:
    """The first len(arrivals) requests of `base` (their lengths), at `arrivals`."""
    if len(base.requests) < len(arrivals):
        raise ValueError(f"the trace window has {len(base.requests)} requests; the rate steps "
                         f"need {len(arrivals)}")  # fmt: skip
    if not arrivals:
        raise ValueError("the rate steps produce no request")
    requests = tuple(replace(r, arrival_s=t) for r, t in zip(base.requests, arrivals))
    scaling = {**base.scaling, "num_requests": len(requests), "rate_rps": None,
               "rate_steps": format_rate_steps(steps)}  # fmt: skip
    return Workload(requests, scaling)


def describe(workload: Workload) -> str:
    return (f"{workload.describe(with_rate=False)}; Poisson arrivals at rate steps "
            f"{workload.scaling['rate_steps']} (req/s:s)")  # fmt: skip


# ---- instance-seconds -------------------------------------------------------------------
@dataclass(frozen=True)
class InstanceSample:
    t_s: float  # since the run started
    counts: dict[str, int]  # role -> live instances
    desired: dict[str, int] | None = None  # the planner's, where it runs


def role_counts(instances: dict[str, tuple[str, Any]]) -> dict[str, int]:
    """{role: count} of `Cluster.instances` (instance id -> (role, handle))."""
    counts = dict.fromkeys(ROLES, 0)
    for role, _ in instances.values():
        counts[role] = counts.get(role, 0) + 1
    return counts


def instance_seconds(samples: list[InstanceSample], end_s: float) -> dict[str, float]:
    """Per role, the integral of the sampled counts from the first sample to `end_s`: each
    sample's counts hold until the next sample. "total" sums P and D."""
    ordered = sorted(samples, key=lambda s: s.t_s)
    out = dict.fromkeys(ROLES, 0.0)
    for sample, following in zip(ordered, ordered[1:] + [None]):
        until = min(end_s, following.t_s if following else end_s)
        for role in ROLES:
            out[role] += sample.counts.get(role, 0) * max(0.0, until - sample.t_s)
    out["total"] = sum(out[r] for r in ROLES)
    return out


# ---- runs -------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSpec:
    name: str  # elastic | smallest | largest
    sizes: dict[str, int]  # starting instances per role
    autoscale: dict[str, Any] | None = None


def run_specs(args: argparse.Namespace) -> list[RunSpec]:
    smallest = {"prefill": args.min_prefill, "decode": args.min_decode}
    largest = {"prefill": args.max_prefill, "decode": args.max_decode}
    specs = {
        "elastic": RunSpec("elastic", smallest, autoscale_section(args)),
        "smallest": RunSpec("smallest", smallest),
        "largest": RunSpec("largest", largest),
    }
    return [specs[name] for name in args.runs.split(",")]


def autoscale_section(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "prefill": {"min": args.min_prefill, "max": args.max_prefill,
                    "target_queued_prefill_tokens": args.target_queued_prefill_tokens},
        "decode": {"min": args.min_decode, "max": args.max_decode,
                   "target_kv_usage": args.target_kv_usage,
                   "target_running_per_instance": args.target_running_per_decode},
        "interval_s": args.interval_s,
        "scale_up_cooldown_s": args.scale_up_cooldown_s,
        "scale_down_cooldown_s": args.scale_down_cooldown_s,
        "scale_down_fraction": args.scale_down_fraction,
    }  # fmt: skip


def pool_config(args: argparse.Namespace, spec: RunSpec) -> dict[str, Any]:
    """The base config with the run's model, roles pinned to their nodes, and autoscaling."""
    data = yaml.safe_load(resolve_config(args.config).read_text(encoding="utf-8"))
    for role in ("encoder", "mixed"):
        data.pop(role, None)
    for role in ROLES:
        data[role] = {**data.get(role, {}), "count": spec.sizes[role], "num_cpus": 1,
                      "resources": {f"pdcluster_{role}": 1}}  # fmt: skip
    data.pop("ray", None)  # this process connects to the multi-node cluster itself
    data.pop("gateway", None)
    if args.model:
        data["model"] = args.model
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


async def sample_instances(
    cluster: Any, start: float, samples: list[InstanceSample], with_planner: bool
) -> None:
    """Append one sample per SAMPLE_INTERVAL_S until cancelled."""
    while True:
        counts = _live_counts(cluster)
        desired = None
        if with_planner:
            with contextlib.suppress(Exception):  # a busy controller: no desired this time
                desired = (await asyncio.wait_for(cluster.planner_state(), 1.0))["desired"]
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
    from benchmarks.client import run_load

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


def measure_run(
    spec: RunSpec, target: Target, workload: Workload, slo: Slo | None, args: argparse.Namespace
) -> dict[str, Any]:
    from benchmarks import bench
    from benchmarks.metrics import summarize
    from benchmarks.targets import wait_quiet

    wait_quiet(target)
    prepared = bench.prepare(workload.requests, target.model, args.seed)  # same in every run
    limit_s = workload.requests[-1].arrival_s + args.drain_s
    outcome, samples = asyncio.run(
        load_with_samples(target, prepared, limit_s, spec.autoscale is not None)
    )
    summary = summarize(outcome.results, outcome.duration_s, slo)
    print(report.run_line(spec.name, workload.mean_rate, summary))
    planner = asyncio.run(_planner_state(target.cluster)) if spec.autoscale else None
    return {
        "name": spec.name,
        "sizes": spec.sizes,
        "autoscale": spec.autoscale,
        "summary": summary,
        "instance_seconds": instance_seconds(samples, outcome.duration_s),
        "samples": [asdict(s) for s in samples],
        "planner": planner,
        "loadavg_after": report.loadavg(),
        "requests": [r.to_dict() for r in outcome.results],
    }


async def _planner_state(cluster: Any) -> dict[str, Any]:
    return await cluster.planner_state()


def bench_run(
    spec: RunSpec, args: argparse.Namespace, workload: Workload, reference: Slo | None
) -> dict[str, Any]:
    """One pool on a fresh multi-node Ray cluster: warm up, SLOs, the measured run."""
    from benchmarks import bench
    from benchmarks.targets import Variant, local_target

    config_path = Path(args.out) / "configs" / f"{spec.name}.yaml"
    config_path.parent.mkdir(parents=True, exist_ok=True)
    config_path.write_text(yaml.safe_dump(pool_config(args, spec)), encoding="utf-8")
    nodes = {"prefill": args.max_prefill, "decode": args.max_decode}
    print(f"\n== {spec.name}: {spec.sizes} {'autoscaled' if spec.autoscale else 'fixed'} ==")
    with multinode_ray(nodes), local_target(Variant(str(config_path)), None) as target:
        target.name = spec.name
        fitted = workload.fit(target.max_model_len)
        bench.warm_up(target, fitted, args.seed + 1)
        isolated = None
        if args.slo_scale and reference is None:
            isolated = bench.measure_isolated(target, fitted, args.isolated_requests, args.seed + 2)
        slo = bench.resolve_slo(args, isolated, reference)
        result = measure_run(spec, target, fitted, slo, args)
    result.update(config=str(config_path), isolated=isolated, model=target.model)
    result["slo"] = asdict(slo) if slo else None
    return result


# ---- report -----------------------------------------------------------------------------
def comparison_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run: attainment, instance-seconds and their ratio to the largest pool's."""
    largest = next((r for r in runs if r["name"] == "largest"), None)
    rows = []
    for run in runs:
        total = run["instance_seconds"]["total"]
        ref = largest["instance_seconds"]["total"] if largest else None
        rows.append({"name": run["name"], "sizes": run["sizes"],
                     "attainment": run["summary"].get("attainment"),
                     "num_ok": run["summary"]["num_ok"],
                     "num_requests": run["summary"]["num_requests"],
                     "instance_seconds": run["instance_seconds"],
                     "ratio_vs_largest": total / ref if ref else None})  # fmt: skip
    return rows


def goal(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Elastic attainment >= the largest pool's at <= 70% of its instance-seconds."""
    by_name = {r["name"]: r for r in rows}
    elastic, largest = by_name.get("elastic"), by_name.get("largest")
    if not elastic or not largest or elastic["attainment"] is None:
        return None
    attained = elastic["attainment"] >= largest["attainment"]
    cheaper = elastic["ratio_vs_largest"] <= GOAL_INSTANCE_SECONDS_RATIO
    return {"attainment_ok": attained, "instance_seconds_ok": cheaper, "met": attained and cheaper}


def summary_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| run | start size | ok/sent | SLO attain | P inst-s | D inst-s | P+D inst-s | "
             "vs largest |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        s, att, ratio = r["instance_seconds"], r["attainment"], r["ratio_vs_largest"]
        lines.append(
            f"| {r['name']} | {r['sizes']['prefill']}P{r['sizes']['decode']}D | "
            f"{r['num_ok']}/{r['num_requests']} | {'—' if att is None else f'{att:.0%}'} | "
            f"{s['prefill']:.0f} | {s['decode']:.0f} | {s['total']:.0f} | "
            f"{'—' if ratio is None else f'{ratio:.2f}'} |"
        )
    return lines


def markdown(results: dict[str, Any]) -> str:
    lines = ["# pdcluster bench --elastic", "", f"`{results['command']}`", "",
             f"Workload: {results['workload']}", "", report._machine_line(results["machine"]),
             "", results["note"], ""]  # fmt: skip
    slo = results["runs"][0].get("slo") if results["runs"] else None
    if slo:
        lines += [f"SLO: TTFT ≤ {slo['ttft_ms']:.1f} ms, TPOT ≤ {slo['tpot_ms']:.1f} ms "
                  f"({results['slo_source']})", ""]  # fmt: skip
    lines += summary_table(results["comparison"])
    g = results.get("goal")
    if g:
        lines += ["", f"**Goal (elastic attainment ≥ largest's at ≤ "
                  f"{GOAL_INSTANCE_SECONDS_RATIO:.0%} of its instance-seconds): "
                  f"{'met' if g['met'] else 'not met'}**"]  # fmt: skip
    return "\n".join(lines) + "\n"


RATE_BIN_S = 5  # arrivals are counted per bin of this many seconds
ROLE_STYLES = {"prefill": ("tab:blue", 3.5), "decode": ("tab:orange", 1.5)}  # colour, width


def plot(results: dict[str, Any], steps: tuple[RateStep, ...], path: Path) -> bool:
    """Request rate over time (scheduled, and arrivals per RATE_BIN_S) above instances per
    role (the elastic run solid, fixed runs dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not results["runs"]:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    _plot_rate(top, steps, [r["arrival_s"] for r in results["runs"][0]["requests"]])
    for run in results["runs"]:
        _plot_instances(bottom, run)
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_ylim(bottom=0)
    bottom.set(xlabel="time since the first request (s)", ylabel="instances in the pool")
    bottom.legend(fontsize=7, ncol=3)
    top.set_title(report._wrap(results["workload"], 100), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_rate(ax: Any, steps: tuple[RateStep, ...], arrivals: list[float]) -> None:
    starts = step_starts(steps)
    rates = [s.rate_rps for s in steps]
    ax.step(starts, [*rates, rates[-1]], where="post", label="scheduled rate")
    bins = list(range(0, int(starts[-1]) + RATE_BIN_S, RATE_BIN_S))
    ax.hist(arrivals, bins=bins, weights=[1 / RATE_BIN_S] * len(arrivals), alpha=0.4,
            label=f"arrivals per {RATE_BIN_S} s")  # fmt: skip
    ax.set(ylabel="req/s")
    ax.legend(fontsize=8)


def _plot_instances(ax: Any, run: dict[str, Any]) -> None:
    elastic_run = run["autoscale"] is not None
    times = [s["t_s"] for s in run["samples"]]
    for role, (color, width) in ROLE_STYLES.items():
        counts = [s["counts"].get(role, 0) for s in run["samples"]]
        ax.step(times, counts, where="post", color=color, linewidth=width,
                linestyle="-" if elastic_run else ":", alpha=0.8 if elastic_run else 0.4,
                label=f"{run['name']} {role}")  # fmt: skip


def write_all(results: dict[str, Any], steps: tuple[RateStep, ...], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    results["comparison"] = comparison_rows(results["runs"])
    results["goal"] = goal(results["comparison"])
    paths = [out / "results.json", out / "summary.md"]
    paths[0].write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(results), encoding="utf-8")
    if plot(results, steps, out / "elastic.png"):
        paths.append(out / "elastic.png")
    return paths


# ---- command line -----------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from benchmarks.workload import default_trace

    p = argparse.ArgumentParser(prog="pdcluster bench --elastic", description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)  # fmt: skip
    w = p.add_argument_group("workload")
    w.add_argument("--rate-steps", default="0.3:60,1.2:60,0.3:60", help="RATE:SECONDS,...")
    w.add_argument("--trace", default=str(default_trace()), help="trace CSV (default: %(default)s)")
    w.add_argument("--window-start-s", type=float, default=0.0, help="trace window start")
    w.add_argument("--token-scale", type=float, default=1.0, help="× trace prompt/output lengths")
    w.add_argument("--min-prompt-len", type=int, default=4)
    w.add_argument("--max-prompt-len", type=int, default=1536)
    w.add_argument("--min-output-len", type=int, default=2)
    w.add_argument("--max-output-len", type=int, default=512)
    w.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("pools")
    c.add_argument("--config", default="local-1p1d", help="base topology (engine settings)")
    c.add_argument("--model", default="preset:small-llama", help="model of every pool")
    c.add_argument("--runs", default="elastic,smallest,largest", help="which runs, in order")
    for role, letter in (("prefill", "P"), ("decode", "D")):
        c.add_argument(f"--min-{role}", type=int, default=1, help=f"smallest {letter} count")
        c.add_argument(f"--max-{role}", type=int, default=3, help=f"largest {letter} count")
    a = p.add_argument_group("autoscaling (elastic run)")
    a.add_argument("--interval-s", type=float, default=2.0)
    a.add_argument("--scale-up-cooldown-s", type=float, default=6.0)
    a.add_argument("--scale-down-cooldown-s", type=float, default=15.0)
    a.add_argument("--scale-down-fraction", type=float, default=0.5)
    a.add_argument("--target-queued-prefill-tokens", type=int, default=1024)
    a.add_argument("--target-running-per-decode", type=int, default=8)
    a.add_argument("--target-kv-usage", type=float, default=0.8)
    s = p.add_argument_group("SLOs")
    s.add_argument("--ttft-slo-ms", type=float, default=None)
    s.add_argument("--tpot-slo-ms", type=float, default=None)
    s.add_argument("--slo-scale", help="K or K_ttft,K_tpot × isolated TTFT/TPOT (first run's)")
    s.add_argument("--isolated-requests", type=int, default=3, help="for --slo-scale")
    p.add_argument("--drain-s", type=float, default=120.0, help="run limit past the last arrival")
    p.add_argument("--out", default="elastic-out", help="output folder")
    return p


def slo_source(args: argparse.Namespace) -> str:
    if not args.slo_scale:
        return "absolute (--ttft-slo-ms/--tpot-slo-ms)"
    return f"{args.slo_scale} × the first run's isolated TTFT,TPOT"


def build_workload(args: argparse.Namespace, steps: tuple[RateStep, ...]) -> Workload:
    arrivals = poisson_arrivals(steps, args.seed)
    lengths = LengthScaling(args.token_scale, args.min_prompt_len, args.max_prompt_len,
                            args.min_output_len, args.max_output_len)  # fmt: skip
    base = trace_workload(args.trace, lengths, args.window_start_s, max(1, len(arrivals)))
    return stepped_workload(base, arrivals, steps)


def _check(args: argparse.Namespace) -> None:
    if set(args.runs.split(",")) - {"elastic", "smallest", "largest"} or not args.runs:
        raise ValueError("--runs is a comma list of elastic, smallest, largest")
    if not (1 <= args.min_prefill <= args.max_prefill and 1 <= args.min_decode <= args.max_decode):
        raise ValueError("need 1 <= --min-<role> <= --max-<role>")
    if not (args.slo_scale or args.ttft_slo_ms or args.tpot_slo_ms):
        raise ValueError("SLO attainment needs SLOs: --slo-scale or --ttft-slo-ms/--tpot-slo-ms")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        _check(args)
        steps = parse_rate_steps(args.rate_steps)
        workload = build_workload(args, steps)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback-only local clusters
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    print(f"workload: {describe(workload)}")
    results: dict[str, Any] = {
        "command": "pdcluster bench --elastic " + shlex.join(argv),
        "argv": argv,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": report.machine_info(),
        "workload": describe(workload),
        "rate_steps": [asdict(s) for s in steps],
        "slo_source": slo_source(args),
        "note": NOTE,
        "runs": [],
    }
    reference: Slo | None = None
    for spec in run_specs(args):
        run = bench_run(spec, args, workload, reference)
        results["runs"].append(run)
        if reference is None and run["slo"]:
            reference = Slo(**run["slo"])
    results["machine"]["loadavg_end"] = report.loadavg()
    paths = write_all(results, steps, Path(args.out))
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


if __name__ == "__main__":
    sys.exit(main())
