"""`pdcluster plan`: which split of N instances serves the most under an SLO, on the simulator.

Like NVIDIA Dynamo's pre-deployment profiler: every candidate split of `--instances N` (each
P:D split with at least one of each, and N mixed) is launched with `model: sim:PROFILE` (the
real scheduler, connectors, instances, Front and routing; only the forward pass simulated)
and measured with `pdcluster bench`'s machinery (warm-up, open-loop streaming runs of the
trace or a synthetic workload, SLO attainment, goodput over a rate list or a rate search).

Rates, SLOs and latencies are in **modeled** time. With `--time-scale S` every modeled
duration runs S times slower, so the runs send at rate ÷ S and check latencies against
SLO × S; what is reported is divided back. Each split reports the share of simulated steps
that overran their modeled time (the host, not the model, was the bottleneck: the instances'
`sim_steps_overrun`); a split above `--max-overrun-share` is flagged untrustworthy and is
chosen only when no split is trustworthy (then: raise the time scale).

    pdcluster plan --profile h100-llama-3.1-8b --instances 4 --slo-ttft-ms 250 \\
        --slo-tpot-ms 100 --rates 2,4,8,16 --num-requests 100 --time-scale 4
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from pdcluster.benchmarks import plan_plot, report
from pdcluster.benchmarks.bench import add_workload_arguments, build_workload, start_target
from pdcluster.benchmarks.metrics import GOODPUT_ATTAINMENT, goodput, search_rates
from pdcluster.benchmarks.targets import Target, Variant, embedded_ray, load_variant, local_target
from pdcluster.benchmarks.workload import Workload

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "plan-sim.yaml"
MAX_OVERRUN_SHARE = 0.05  # a split with more of its steps overrun is not trusted
IDLE_TIMEOUT_S = 60.0  # after a split's runs, its instances must free every block by then


# ---- candidate splits --------------------------------------------------------------------
@dataclass(frozen=True)
class Split:
    num_prefill: int
    num_decode: int
    num_mixed: int = 0
    num_encoder: int = 0

    @property
    def num_instances(self) -> int:
        return self.num_encoder + self.num_prefill + self.num_decode + self.num_mixed

    @property
    def name(self) -> str:
        if self.num_mixed:
            return f"{self.num_mixed}mixed"
        encoders = f"{self.num_encoder}E" if self.num_encoder else ""
        return f"{encoders}{self.num_prefill}P{self.num_decode}D"

    def settings(self) -> dict[str, int]:
        """The role counts as dotted config settings."""
        return {"encoder.count": self.num_encoder, "prefill.count": self.num_prefill,
                "decode.count": self.num_decode, "mixed.count": self.num_mixed}  # fmt: skip


def candidate_splits(num_instances: int, with_encoder: bool = False) -> list[Split]:
    """Every P:D split of `num_instances` with at least one of each (1P first), then (with
    `with_encoder`) every E:P:D split with at least one of each (1E first), then all of them
    mixed. Without an E, P (or mixed) encodes its requests' images itself."""
    if num_instances < 1:
        raise ValueError(f"--instances must be at least 1 (got {num_instances})")
    pd = [Split(p, num_instances - p) for p in range(1, num_instances)]
    epd = [
        Split(p, num_instances - e - p, num_encoder=e)
        for e in range(1, num_instances - 1)
        for p in range(1, num_instances - e)
    ]
    return [*pd, *(epd if with_encoder else []), Split(0, 0, num_instances)]


def select_splits(candidates: list[Split], names: str | None) -> list[Split]:
    """The candidates named in a comma list (all when None); ValueError for a name that is
    not a candidate."""
    if not names:
        return candidates
    by_name = {s.name.lower(): s for s in candidates}
    wanted = [n.strip().lower() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in by_name]
    if unknown or not wanted:
        raise ValueError(f"--splits {names!r}: not candidates of this instance count "
                         f"({', '.join(s.name for s in candidates)})")  # fmt: skip
    return [by_name[n] for n in wanted]


# ---- results -----------------------------------------------------------------------------
@dataclass(frozen=True)
class RatePoint:
    """One run of a split, in modeled time."""

    rate_rps: float
    attainment: float
    num_ok: int
    num_requests: int
    ttft_p90_ms: float | None
    tpot_p90_ms: float | None
    sim_steps: int
    sim_steps_overrun: int
    ttft_p50_ms: float | None = None
    tpot_p50_ms: float | None = None


@dataclass(frozen=True)
class SplitResult:
    split: Split
    points: tuple[RatePoint, ...]
    all_blocks_free: bool = True  # every instance back to all blocks free after the runs

    @property
    def overrun_share(self) -> float:
        steps = sum(p.sim_steps for p in self.points)
        return sum(p.sim_steps_overrun for p in self.points) / steps if steps else 0.0

    def goodput(self, target: float = GOODPUT_ATTAINMENT) -> dict[str, float | None]:
        return goodput([(p.rate_rps, p.attainment) for p in self.points], target)

    def trusted(self, max_overrun_share: float = MAX_OVERRUN_SHARE) -> bool:
        return self.overrun_share <= max_overrun_share


def _rank(r: SplitResult, target: float, max_overrun_share: float) -> tuple[bool, float, float]:
    """Trusted first, then goodput per instance (interpolated, then the highest passing rate)."""
    g, n = r.goodput(target), r.split.num_instances
    return (r.trusted(max_overrun_share), (g["interpolated_rps"] or 0.0) / n, (g["rps"] or 0.0) / n)


def best_split(
    results: list[SplitResult],
    target: float = GOODPUT_ATTAINMENT,
    max_overrun_share: float = MAX_OVERRUN_SHARE,
) -> SplitResult | None:
    """The trustworthy split with the highest goodput per instance; an untrustworthy one only
    when none is trustworthy; the first of equals. None when no split reaches the goal at
    any rate."""
    reaching = [r for r in results if r.goodput(target)["rps"] is not None]
    return max(reaching, key=lambda r: _rank(r, target, max_overrun_share), default=None)


def _rate(value: float | None, num_instances: int = 1) -> str:
    return "—" if value is None else f"{value / num_instances:.3g}"


def format_table(
    results: list[SplitResult],
    target: float = GOODPUT_ATTAINMENT,
    max_overrun_share: float = MAX_OVERRUN_SHARE,
) -> str:
    """One markdown row per split: goodput (modeled req/s), per instance, attainment at each
    rate, overrun share and whether it is trusted."""
    head = ("| split | goodput req/s | interpolated | per instance | attainment by rate "
            "| steps overrun | trusted | blocks free |")  # fmt: skip
    lines = [head, "|---" * 8 + "|"]
    for r in results:
        g, n = r.goodput(target), r.split.num_instances
        by_rate = ", ".join(f"{p.rate_rps:.3g}: {p.attainment:.0%}" for p in r.points)
        trusted = "yes" if r.trusted(max_overrun_share) else "**no**"
        lines.append(f"| {r.split.name} | {_rate(g['rps'])} | {_rate(g['interpolated_rps'])} "
                     f"| {_rate(g['interpolated_rps'], n)} | {by_rate} | {r.overrun_share:.1%} "
                     f"| {trusted} | {'yes' if r.all_blocks_free else '**no**'} |")  # fmt: skip
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value:.3g}"


def latency_table(results: list[SplitResult]) -> str:
    """One markdown row per split and rate: TTFT and TPOT p50 / p90 (modeled ms) and the
    attainment there."""
    lines = ["| split | rate req/s | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms "
             "| attainment |", "|---" * 7 + "|"]  # fmt: skip
    for r in results:
        for p in r.points:
            lines.append(f"| {r.split.name} | {p.rate_rps:.3g} | {_ms(p.ttft_p50_ms)} | "
                         f"{_ms(p.ttft_p90_ms)} | {_ms(p.tpot_p50_ms)} | {_ms(p.tpot_p90_ms)} "
                         f"| {p.attainment:.0%} |")  # fmt: skip
    return "\n".join(lines)


def verdict(
    results: list[SplitResult],
    target: float = GOODPUT_ATTAINMENT,
    max_overrun_share: float = MAX_OVERRUN_SHARE,
) -> str:
    best = best_split(results, target, max_overrun_share)
    if best is None:
        return f"best split: none (no split holds {target:.0%} attainment at any rate run)"
    g = best.goodput(target)
    at_least = "≥ " if best.points[-1].attainment >= target else ""  # passed at the top rate
    line = (f"best split: {best.split.name}, goodput {at_least}{_rate(g['interpolated_rps'])} "
            f"req/s ({at_least}{_rate(g['interpolated_rps'], best.split.num_instances)} per "
            "instance)")  # fmt: skip
    rank = _rank(best, target, max_overrun_share)
    tied = [r.split.name for r in results
            if r is not best and _rank(r, target, max_overrun_share) == rank]  # fmt: skip
    if tied:
        line += f", tied with {', '.join(tied)}"
    if at_least:
        line += "; it held at the highest rate run: add higher --rates to separate"
    if not best.trusted(max_overrun_share):
        line += (f" — untrustworthy: {best.overrun_share:.0%} of its steps overran (limit "
                 f"{max_overrun_share:.0%}); rerun with a larger --time-scale")  # fmt: skip
    return line


# ---- running the splits ------------------------------------------------------------------
def sim_step_counts(target: Target) -> tuple[int, int]:
    """(steps, overrun steps) summed over the target's instances so far."""
    stats = target.cluster.stats()
    sims = [s.sim for s in stats if s.sim is not None]
    return sum(s.steps for s in sims), sum(s.steps_overrun for s in sims)


def all_blocks_free(target: Target) -> bool:
    """Whether every instance is idle with all its blocks free within IDLE_TIMEOUT_S."""
    try:
        stats = target.cluster.wait_idle(IDLE_TIMEOUT_S)
    except TimeoutError:
        return False
    return all(s.scheduler.num_blocks_free == s.scheduler.num_blocks_total for s in stats)


def _point(run: dict[str, Any], scale: float, steps: int, overrun: int) -> RatePoint:
    summary = run["summary"]

    def modeled(metric: str, q: str = "p90") -> float | None:
        value = summary[metric][q]
        return None if value is None else value / scale

    return RatePoint(
        rate_rps=run["rate_rps"] * scale,
        attainment=summary.get("attainment", 0.0),
        num_ok=summary["num_ok"],
        num_requests=summary["num_requests"],
        ttft_p90_ms=modeled("ttft_ms"),
        tpot_p90_ms=modeled("tpot_ms"),
        sim_steps=steps,
        sim_steps_overrun=overrun,
        ttft_p50_ms=modeled("ttft_ms", "p50"),
        tpot_p50_ms=modeled("tpot_ms", "p50"),
    )


def plan_split(split: Split, args: argparse.Namespace, workload: Workload) -> SplitResult:
    """Launch the split, run it at every rate (or the search's), and check it ends clean."""
    scale = args.time_scale
    bench_args = _bench_args(args)
    with local_target(_variant(split, args), _model(args)) as target:
        bench = start_target(target, bench_args, workload, None)
        points: list[RatePoint] = []

        def measure(modeled_rate: float) -> float:
            steps_before, overrun_before = sim_step_counts(target)
            attainment = bench.measure(modeled_rate / scale)
            steps, overrun = sim_step_counts(target)
            points.append(_point(bench.runs[-1], scale, steps - steps_before,
                                 overrun - overrun_before))  # fmt: skip
            return attainment

        if args.rates == "auto":
            start = args.rate or bench.workload.mean_rate
            search_rates(measure, start, args.goodput_target, bisect_steps=args.search_steps)
        else:
            for rate in _rates(args):
                measure(rate)
        free = all_blocks_free(target)
    result = SplitResult(split, tuple(sorted(points, key=lambda p: p.rate_rps)), free)
    print(f"{split.name}: goodput {_rate(result.goodput(args.goodput_target)['rps'])} req/s "
          f"(modeled), {result.overrun_share:.1%} of steps overran")  # fmt: skip
    return result


def _model(args: argparse.Namespace) -> str:
    return "sim:" + args.profile.removeprefix("sim:")


def _variant(split: Split, args: argparse.Namespace) -> Variant:
    settings: dict[str, Any] = {}
    for assignment in args.set:
        key, sep, value = assignment.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {assignment!r}: expected KEY=VALUE (KEY dotted as in YAML)")
        settings[key] = yaml.safe_load(value)
    settings.update(split.settings())
    settings["engine.sim_time_scale"] = args.time_scale
    return Variant(str(args.config), settings, label=split.name)


def _rates(args: argparse.Namespace) -> list[float]:
    try:
        rates = sorted(float(r) for r in args.rates.split(","))
    except ValueError:
        raise ValueError(f"--rates {args.rates!r}: a comma list of req/s, or auto") from None
    if not rates or rates[0] <= 0:
        raise ValueError(f"--rates {args.rates!r}: rates are above 0")
    return rates


def _bench_args(args: argparse.Namespace) -> argparse.Namespace:
    """The options `pdcluster bench`'s machinery reads: wall-clock SLOs (modeled × scale)."""
    return argparse.Namespace(**{
        **vars(args), "slo_scale": None, "ttft_slo_ms": args.slo_ttft_ms * args.time_scale,
        "tpot_slo_ms": args.slo_tpot_ms * args.time_scale, "isolated_requests": 0,
        "lora_models": [],  # every request on the base model
    })  # fmt: skip


def _ray_cpus(splits: list[Split], args: argparse.Namespace) -> int:
    """CPUs an embedded Ray needs for the largest split's reservations."""
    needed = 1.0
    for split in splits:
        config = load_variant(_variant(split, args), _model(args))
        roles = ("encoder", "prefill", "decode", "mixed")
        needed = max(needed, sum(config.role(r).count * config.role(r).num_cpus for r in roles))
    return math.ceil(needed)


# ---- command line ------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdcluster plan", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    c = p.add_argument_group("what to plan")
    c.add_argument("--profile", required=True, help="sim profile: built-in name or JSON path")
    c.add_argument("--instances", type=int, required=True, help="instances to split (N)")
    c.add_argument("--slo-ttft-ms", type=float, required=True, help="TTFT SLO (modeled ms)")
    c.add_argument("--slo-tpot-ms", type=float, required=True, help="TPOT SLO (modeled ms)")
    c.add_argument("--splits", default=None, help="run only these candidates (e.g. 1P3D,4mixed)")
    c.add_argument("--with-encoder", action="store_true",
                   help="also the E:P:D splits (a multimodal profile; see --image-fraction)")  # fmt: skip
    c.add_argument("--config", default=str(DEFAULT_CONFIG), help="base config of every split")
    c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config setting for every split, dotted as in the YAML (repeat)")  # fmt: skip
    add_workload_arguments(p)
    r = p.add_argument_group("rates, time scale and limits")
    r.add_argument("--rates", default="auto", help="comma list of modeled req/s, or 'auto'")
    r.add_argument("--search-steps", type=int, default=2, help="bisections of --rates auto")
    r.add_argument("--goodput-target", type=float, default=GOODPUT_ATTAINMENT)
    r.add_argument("--time-scale", type=float, default=1.0, help="run modeled time S× slower")
    r.add_argument("--max-overrun-share", type=float, default=MAX_OVERRUN_SHARE,
                   help="a split with more of its steps overrun is untrustworthy")  # fmt: skip
    r.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    r.add_argument("--max-run-s", type=float, default=600.0, help="one run stops after (wall)")
    r.add_argument("--drain-s", type=float, default=120.0, help="past the last arrival (wall)")
    r.add_argument("--out", default="plan-out", help="folder for plan.json and plan.md")
    return p


def _check(args: argparse.Namespace) -> list[Split]:
    if args.slo_ttft_ms <= 0 or args.slo_tpot_ms <= 0:
        raise ValueError("--slo-ttft-ms and --slo-tpot-ms are above 0")
    if args.time_scale <= 0:
        raise ValueError(f"--time-scale must be above 0 (got {args.time_scale})")
    if not 0 < args.goodput_target <= 1:
        raise ValueError("--goodput-target is a fraction in (0, 1]")
    if args.rates != "auto":
        _rates(args)
    elif args.synthetic and args.rate is None:
        raise ValueError("--synthetic with --rates auto needs --rate (the search's start)")
    splits = select_splits(candidate_splits(args.instances, args.with_encoder), args.splits)
    for split in splits:  # every split's config is valid before anything launches
        load_variant(_variant(split, args), _model(args))
    return splits


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        splits = _check(args)
        workload = build_workload(_bench_args(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"workload: {workload.describe(with_rate=False)}")
    print(f"time scale {args.time_scale:g}: modeled durations run {args.time_scale:g}× slower; "
          "the run lines below are wall clock, the table is modeled")  # fmt: skip
    load_before = report.loadavg()
    with embedded_ray(_ray_cpus(splits, args)):
        results = [plan_split(split, args, workload) for split in splits]
    table = format_table(results, args.goodput_target, args.max_overrun_share)
    best = verdict(results, args.goodput_target, args.max_overrun_share)
    text = f"{table}\n\n{best}\n\nModeled latencies:\n\n{latency_table(results)}"
    print(f"\n{text}")
    _write(args, argv, workload, results, text, load_before)
    return 0


def _write(
    args: argparse.Namespace,
    argv: list[str],
    workload: Workload,
    results: list[SplitResult],
    text: str,
    load_before: Any,
) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    best = best_split(results, args.goodput_target, args.max_overrun_share)
    data = {
        "command": "pdcluster plan " + shlex.join(argv),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {
            **report.machine_info(),
            "loadavg_before": load_before,
            "loadavg_end": report.loadavg(),
        },  # fmt: skip
        "workload": workload.describe(with_rate=False),
        "time_scale": args.time_scale,
        "slo_ms": {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms},
        "splits": [
            {
                **asdict(r),
                "name": r.split.name,
                "goodput": r.goodput(args.goodput_target),
                "overrun_share": r.overrun_share,
                "trusted": r.trusted(args.max_overrun_share),
            }
            for r in results
        ],  # fmt: skip
        "best": best.split.name if best else None,
    }
    (out / "plan.json").write_text(json.dumps(data, indent=2), encoding="utf-8")
    (out / "plan.md").write_text(f"`{data['command']}`\n\n{text}\n", encoding="utf-8")
    plan_plot.plot(results, args.slo_ttft_ms, args.goodput_target, out / "plan.png")
    print(f"wrote {out / 'plan.json'}, {out / 'plan.md'}, {out / 'plan.png'}")


if __name__ == "__main__":
    sys.exit(main())
