"""The report of `pdcluster bench --elastic` (benchmarks/elastic.py): instance-seconds,
SLO attainment per rate step, the oracle pool, the comparison with the largest fixed pool and
its goal, summary.md and elastic.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdcluster.benchmarks import report
from pdcluster.benchmarks.metrics import GOODPUT_ATTAINMENT, Slo
from pdcluster.benchmarks.rate_profile import RateStep, step_index, step_starts

if TYPE_CHECKING:
    from pdcluster.benchmarks.client import RequestResult
    from pdcluster.benchmarks.elastic import InstanceSample

ROLES = ("prefill", "decode")
GOAL_INSTANCE_SECONDS_RATIO = 0.7  # elastic at most this × the largest pool's instance-seconds


def topology_name(sizes: dict[str, int]) -> str:
    return f"{sizes['prefill']}P{sizes['decode']}D"


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


def step_attainment(
    results: list[RequestResult], steps: tuple[RateStep, ...], slo: Slo, scale: float = 1.0
) -> list[float | None]:
    """Per rate step, the share of the requests that arrived in it (at wall time ÷ `scale`)
    meeting both SLOs; None for a step no request arrived in."""
    met: list[list[bool]] = [[] for _ in steps]
    for r in results:
        i = step_index(steps, r.spec.arrival_s / scale)
        if i is not None:
            met[i].append(slo.met(r))
    return [sum(m) / len(m) if m else None for m in met]


def scale_events(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each change of the planner's desired count of a role, from the elastic run's samples:
    when it was first seen, the count then, and when the live count reached it (None: never
    within the run), so its lag is what a scale-up or drain took."""
    events: list[dict[str, Any]] = []
    for role in ROLES:
        desired_before = None
        for i, sample in enumerate(samples):
            desired = (sample.get("desired") or {}).get(role)
            if desired is None or desired == desired_before:
                continue
            if desired_before is not None:
                reached = next((later["t_s"] for later in samples[i:]
                                if later["counts"].get(role) == desired), None)  # fmt: skip
                events.append({"role": role, "t_s": sample["t_s"], "count": sample["counts"][role],
                               "desired": desired, "reached_s": reached})  # fmt: skip
            desired_before = desired
    return sorted(events, key=lambda e: e["t_s"])


def oracle_instance_seconds(
    runs: list[dict[str, Any]], steps: tuple[RateStep, ...], target: float = GOODPUT_ATTAINMENT
) -> float | None:
    """Instance-seconds over the schedule of a pool that in each step had the fewest
    instances of any fixed run meeting `target` attainment in that step (the largest fixed
    run's where none did), with no time to scale; None without a fixed run."""
    fixed = sorted((r for r in runs if r["autoscale"] is None), key=_num_instances)
    if not fixed:
        return None
    total = 0.0
    for i, step in enumerate(steps):
        meeting = [r for r in fixed if _meets(r["step_attainment"][i], target)]
        total += _num_instances(meeting[0] if meeting else fixed[-1]) * step.duration_s
    return total


def _meets(attainment: float | None, target: float) -> bool:
    return attainment is None or attainment >= target  # no request in the step: nothing missed


def _num_instances(run: dict[str, Any]) -> int:
    return sum(run["sizes"].values())


# ---- report -----------------------------------------------------------------------------
def comparison_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run: attainment, latencies, instance-seconds and their ratio to the largest fixed
    pool's (the one with the most instances)."""
    fixed = [r for r in runs if r.get("autoscale") is None]
    largest = max(fixed, key=_num_instances, default=None)
    ref = largest["instance_seconds"]["total"] if largest else None
    rows = []
    for run in runs:
        total = run["instance_seconds"]["total"]
        steps = run.get("sim_steps")
        rows.append({"name": run["name"], "sizes": run["sizes"], "is_largest": run is largest,
                     "attainment": run["summary"].get("attainment"),
                     "num_ok": run["summary"]["num_ok"],
                     "num_requests": run["summary"]["num_requests"],
                     "modeled_ms": run.get("modeled_ms", {}),
                     "instance_seconds": run["instance_seconds"],
                     "ratio_vs_largest": total / ref if ref else None,
                     "overrun_share": run["sim_steps_overrun"] / steps if steps else None,
                     "all_blocks_free": run.get("all_blocks_free")})  # fmt: skip
    return rows


def goal(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Elastic attainment >= the largest pool's at <= 70% of its instance-seconds."""
    elastic = next((r for r in rows if r["name"] == "elastic"), None)
    largest = next((r for r in rows if r["is_largest"]), None)
    if not elastic or not largest or elastic["attainment"] is None:
        return None
    attained = elastic["attainment"] >= largest["attainment"]
    cheaper = elastic["ratio_vs_largest"] <= GOAL_INSTANCE_SECONDS_RATIO
    return {"attainment_ok": attained, "instance_seconds_ok": cheaper, "met": attained and cheaper,
            "largest": largest["name"]}  # fmt: skip


def _pct(x: float | None, digits: int = 0) -> str:
    return "—" if x is None else f"{x:.{digits}%}"


def _num(x: float | None, fmt: str = ".3g") -> str:
    return "—" if x is None else format(x, fmt)


def summary_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| run | start size | ok/sent | SLO attain | TTFT p50 / p90 ms | TPOT p50 / p90 ms | "
             "P inst-s | D inst-s | P+D inst-s | vs largest | steps overrun | blocks free |",
             "|---" * 12 + "|"]  # fmt: skip
    for r in rows:
        s, ms, free = r["instance_seconds"], r["modeled_ms"], r["all_blocks_free"]
        lines.append(
            f"| {r['name']} | {topology_name(r['sizes'])} | {r['num_ok']}/{r['num_requests']} | "
            f"{_pct(r['attainment'])} | {_num(ms.get('ttft_p50_ms'))} / "
            f"{_num(ms.get('ttft_p90_ms'))} | {_num(ms.get('tpot_p50_ms'))} / "
            f"{_num(ms.get('tpot_p90_ms'))} | {s['prefill']:.1f} | {s['decode']:.1f} | "
            f"{s['total']:.1f} | {_num(r['ratio_vs_largest'], '.2f')} | "
            f"{_pct(r['overrun_share'], 1)} | {'—' if free is None else 'yes' if free else '**no**'} |"
        )
    return lines


def step_table(runs: list[dict[str, Any]], steps: tuple[RateStep, ...]) -> list[str]:
    """SLO attainment of every run in every rate step."""
    head = " | ".join(f"{s.rate_rps:.3g}" for s in steps)
    lines = [f"| run \\ step rate (req/s) | {head} |", "|---" * (len(steps) + 1) + "|"]
    for run in runs:
        cells = " | ".join(_pct(a) for a in run["step_attainment"] or [None] * len(steps))
        lines.append(f"| {run['name']} | {cells} |")
    return lines


def markdown(results: dict[str, Any], steps: tuple[RateStep, ...]) -> str:
    lines = ["# pdcluster bench --elastic", "", f"`{results['command']}`", "",
             f"Workload: {results['workload']}", "", report._machine_line(results["machine"]),
             "", results["note"], ""]  # fmt: skip
    slo = results["runs"][0].get("slo") if results["runs"] else None
    scale = results["time_scale"]
    if slo:
        lines += [f"SLO: TTFT ≤ {slo['ttft_ms'] / scale:.1f} ms, TPOT ≤ "
                  f"{slo['tpot_ms'] / scale:.1f} ms ({results['slo_source']})", ""]  # fmt: skip
    lines += summary_table(results["comparison"])
    g = results.get("goal")
    if g:
        lines += ["", f"**Goal (elastic attainment ≥ {g['largest']}'s at ≤ "
                  f"{GOAL_INSTANCE_SECONDS_RATIO:.0%} of its instance-seconds): "
                  f"{'met' if g['met'] else 'not met'}**"]  # fmt: skip
    if slo:
        lines += ["", "SLO attainment per rate step:", "", *step_table(results["runs"], steps)]
    events = [e for r in results["runs"] if r["autoscale"] for e in scale_events(r["samples"])]
    if events:
        lines += ["", "The planner's changes (elastic run; first sample showing the new desired "
                  "count, and when the pool had it):", ""]  # fmt: skip
        lines += [f"- {e['role']} {e['count']} → {e['desired']} at {e['t_s']:.2f} s, reached "
                  + ("never" if e["reached_s"] is None else f"at {e['reached_s']:.2f} s "
                     f"({e['reached_s'] - e['t_s']:.2f} s later)") for e in events]  # fmt: skip
    oracle = results.get("oracle_instance_seconds")
    if oracle is not None:
        largest = max(_num_instances(r) for r in results["runs"] if r["autoscale"] is None)
        span = step_starts(steps)[-1]
        lines += ["", f"Oracle (per step the smallest fixed pool at ≥ {GOODPUT_ATTAINMENT:.0%} "
                  f"in that step, no time to scale): {oracle:.1f} instance-seconds over the "
                  f"{span:g} s schedule = {oracle / (largest * span):.2f}× the largest pool's "
                  "over the same span"]  # fmt: skip
    return "\n".join(lines) + "\n"


RATE_BINS = 60  # arrivals are counted in this many bins over the schedule
ROLE_STYLES = {"prefill": ("tab:blue", 3.5), "decode": ("tab:orange", 1.5)}  # colour, width


def plot(results: dict[str, Any], steps: tuple[RateStep, ...], path: Path) -> bool:
    """Request rate over time (scheduled, and arrivals per bin) above instances per role
    (the elastic run solid, fixed runs dotted); modeled time for a simulated model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    if not results["runs"]:
        return False
    scale = results["time_scale"]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    _plot_rate(top, steps, [r["arrival_s"] / scale for r in results["runs"][0]["requests"]])
    for run in results["runs"]:
        _plot_instances(bottom, run)
    bottom.yaxis.set_major_locator(MaxNLocator(integer=True))
    bottom.set_ylim(bottom=0)
    clock = "modeled " if scale != 1 else ""
    bottom.set(xlabel=f"{clock}time since the first request (s)", ylabel="instances in the pool")
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
    bin_s = starts[-1] / RATE_BINS
    ax.hist(arrivals, bins=[i * bin_s for i in range(RATE_BINS + 1)],
            weights=[1 / bin_s] * len(arrivals), alpha=0.4,
            label=f"arrivals per {bin_s:.3g} s")  # fmt: skip
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
    if all(r["step_attainment"] is not None for r in results["runs"]):
        results["oracle_instance_seconds"] = oracle_instance_seconds(results["runs"], steps)
    paths = [out / "results.json", out / "summary.md"]
    paths[0].write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    paths[1].write_text(markdown(results, steps), encoding="utf-8")
    if plot(results, steps, out / "elastic.png"):
        paths.append(out / "elastic.png")
    return paths
