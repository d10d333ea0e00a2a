"""Benchmark outputs: results.json, summary.md (tables per topology, comparison ratios) and
PNG plots (SLO attainment vs rate; TTFT and TPOT CDFs at one rate). Every table and plot
states the workload's scaling."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pdcluster.benchmarks.metrics import vllm_result
from pdcluster.benchmarks.stages import STAGES
from pdcluster.benchmarks.targets import REPO_ROOT


# ---- machine ----------------------------------------------------------------------------
def save_results(out: Path | None, result: Any) -> None:
    """Write `result` as `out`/results.json (nothing when `out` is None)."""
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": _memory_gib(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "loadavg_start": loadavg(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain")),
    }
    with contextlib.suppress(Exception):
        import ray

        info["ray"] = ray.__version__
    return info


def _cpu_model() -> str:
    with contextlib.suppress(Exception):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _memory_gib() -> float | None:
    with contextlib.suppress(Exception):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=10, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


# ---- text -------------------------------------------------------------------------------
def _f(x: float | None, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def run_line(name: str, rate: float, s: dict[str, Any]) -> str:
    """One printed line per run."""
    attain = f", SLO {s['attainment']:.0%}" if "attainment" in s else ""
    t, p = s["ttft_ms"], s["tpot_ms"]
    return (
        f"{name} @ {rate:.3g} req/s: {s['num_ok']}/{s['num_requests']} ok, "
        f"TTFT p50/p90/p99 {_f(t['p50'])}/{_f(t['p90'])}/{_f(t['p99'])} ms, "
        f"TPOT {_f(p['p50'])}/{_f(p['p90'])}/{_f(p['p99'])} ms, "
        f"{_f(s['output_tokens_per_s'])} tok/s{attain}{_spec_decode(s)}"
    )


def _spec_decode(s: dict[str, Any]) -> str:
    """The run's drafts, where the server speculates (vLLM's spec-decode counters)."""
    spec = s.get("spec_decode")
    if spec is None:
        return ""
    return (
        f", drafts: {spec['num_accepted_tokens']} of {spec['num_draft_tokens']} tokens "
        f"accepted ({_f(spec['acceptance_rate'], 2)}), per draft by position "
        f"{spec['accepted_per_draft_by_position']}"
    )


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# pdcluster bench",
        "",
        f"`{results['command']}`",
        "",
        f"Workload: {results['workload']['description']}",
        "",
        _machine_line(results["machine"]),
        "",
    ]
    for topo in results["topologies"]:
        lines += _topology_section(topo)
    lines += comparison_section(results)
    return "\n".join(lines) + "\n"


def _machine_line(m: dict[str, Any]) -> str:
    return (
        f"Machine: {m.get('processor')}, {m.get('cpus_usable')} usable CPUs, "
        f"{m.get('memory_gib')} GiB, torch {m.get('torch')}, ray {m.get('ray')}, "
        f"load average {m.get('loadavg_start')} → {m.get('loadavg_end')}, "
        f"commit {str(m.get('git_commit'))[:10]}{' (dirty)' if m.get('git_dirty') else ''}"
    )


def _topology_section(topo: dict[str, Any]) -> list[str]:
    lines = [f"## {topo['name']} ({topo.get('topology') or 'remote'}, {topo['model']})", ""]
    lines.append(f"Workload: {topo['workload']}")
    lines.append("")
    if "isolated" in topo:
        iso = topo["isolated"]
        lines.append(
            f"Isolated (1 request at a time, prompt {iso['prompt_len']}, output "
            f"{iso['output_len']}): TTFT {iso['ttft_ms']:.1f} ms, TPOT {iso['tpot_ms']:.1f} ms"
        )
    if "slo" in topo:
        slo = topo["slo"]
        lines.append(
            f"SLO: TTFT ≤ {slo['ttft_ms']:.1f} ms, TPOT ≤ {slo['tpot_ms']:.1f} ms ({slo['source']})"
        )
    if "goodput" in topo:
        g = topo["goodput"]
        lines.append(
            f"**Goodput: {_f(g['rps'], 3)} req/s** (highest swept rate with ≥ "
            f"{g['target_attainment']:.0%} attainment at it and every lower swept rate; interpolated "
            f"{_f(g['interpolated_rps'], 3)}; highest passing swept rate "
            f"{_f(g.get('max_passing_rps'), 3)})"
        )
    lines += ["", _TABLE_HEAD, _TABLE_RULE]
    lines += [_run_row(run) for run in topo["runs"]]
    spec = [(run["rate_rps"], _spec_decode(run["summary"])) for run in topo["runs"]]
    if any(text for _, text in spec):
        lines += ["", "Speculative decoding (`/metrics`):", ""]
        lines += [f"- {rate:.3g} req/s{text}" for rate, text in spec if text]
    lines += _stage_table(topo)
    if "gateway_overhead" in topo:
        o = topo["gateway_overhead"]
        lines += [
            "",
            f"Gateway overhead at concurrency 1 ({o['num_requests']} pairs, prompt "
            f"{o['prompt_len']}, output {o['output_len']}): HTTP TTFT "
            f"{o['http_ttft_ms_median']:.2f} ms − Python API TTFT {o['api_ttft_ms_median']:.2f} "
            f"ms; median paired difference **{o['overhead_ms_median']:.2f} ms**",
        ]
    return [*lines, ""]


_TABLE_HEAD = (
    "| rate req/s | ok/sent | SLO attain | TTFT ok | TPOT ok | TTFT p50/p90/p99 ms | "
    "TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms | 1st ITL p50/p90/p99 ms | e2e p50/p90/p99 ms | req/s | out tok/s | "
    "load avg 1 min |"
)
_TABLE_RULE = "|" + "---|" * 13


def _run_row(run: dict[str, Any]) -> str:
    s = run["summary"]

    def pct(key: str) -> str:
        v = s[key]
        return f"{_f(v['p50'])} / {_f(v['p90'])} / {_f(v['p99'])}"

    def frac(key: str) -> str:
        return f"{s[key]:.0%}" if key in s else "—"

    return (
        f"| {run['rate_rps']:.3g} | {s['num_ok']}/{s['num_requests']} | {frac('attainment')} | "
        f"{frac('ttft_attainment')} | {frac('tpot_attainment')} | {pct('ttft_ms')} | "
        f"{pct('tpot_ms')} | {pct('itl_ms')} | {pct('first_itl_ms')} | {pct('e2e_ms')} | "
        f"{_f(s['throughput_rps'], 2)} | {_f(s['output_tokens_per_s'])} | {_load(run)} |"
    )


def _load(run: dict[str, Any]) -> str:
    """The machine's 1-minute load average before → after the run (a shared machine?)."""
    load = run.get("loadavg") or {}
    before, after = load.get("before"), load.get("after")
    return f"{before[0]} → {after[0]}" if before and after else "—"


def _stage_table(topo: dict[str, Any]) -> list[str]:
    """Where the time went at each rate: p50 / p90 ms of every stage (benchmarks/stages.py)
    that some request passed; empty unless the topology was launched here."""
    summaries = [(r["rate_rps"], r["summary"].get("stages_ms")) for r in topo["runs"]]
    summaries = [(rate, s) for rate, s in summaries if s and s["num_traced"]]
    if not summaries:
        return []
    names = [n for n in STAGES if any(n in s for _, s in summaries)]
    lines = [
        "",
        "Where the time went (server-side stage times, ms p50 / p90; see benchmarks/stages.py):",
        "",
        "| rate req/s | traced | " + " | ".join(names) + " |",
        "|" + "---|" * (len(names) + 2),
    ]
    for rate, s in summaries:
        cells = [f"{_f(s[n]['p50'])} / {_f(s[n]['p90'])}" if n in s else "—" for n in names]
        lines.append(f"| {rate:.3g} | {s['num_traced']} | " + " | ".join(cells) + " |")
    return lines


def comparisons(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The first topology against each other one: goodput ratio, and p90 TTFT / TPOT ratios
    at every rate both ran."""
    topos = results["topologies"]
    out = []
    for other in topos[1:]:
        first = topos[0]
        entry: dict[str, Any] = {"first": first["name"], "second": other["name"]}
        g1, g2 = first.get("goodput"), other.get("goodput")
        if g1 and g2:
            for key in ("rps", "interpolated_rps", "max_passing_rps"):
                a, b = g1[key], g2[key]
                entry[f"goodput_ratio_{key}"] = a / b if a is not None and b else None
            for topo, g in ((first, g1), (other, g2)):
                if g["rps"] is None:
                    entry.setdefault("notes", []).append(
                        f"{topo['name']} reaches {g['target_attainment']:.0%} attainment at no "
                        f"swept rate (lowest: {min(r['rate_rps'] for r in topo['runs']):.3g} req/s)"
                    )
        entry["per_rate"] = _per_rate(first, other)
        out.append(entry)
    return out


def _per_rate(first: dict[str, Any], other: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    theirs = {round(r["rate_rps"], 6): r["summary"] for r in other["runs"]}
    for run in first["runs"]:
        s2 = theirs.get(round(run["rate_rps"], 6))
        if s2 is None:
            continue
        s1 = run["summary"]
        rows.append(
            {
                "rate_rps": run["rate_rps"],
                "p90_ttft_ratio": _ratio(s1["ttft_ms"]["p90"], s2["ttft_ms"]["p90"]),
                "p90_tpot_ratio": _ratio(s1["tpot_ms"]["p90"], s2["tpot_ms"]["p90"]),
                "attainment": [s1.get("attainment"), s2.get("attainment")],
            }
        )
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def comparison_section(results: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    for c in results.get("comparisons", []):
        lines += [f"## Ratios: {c['first']} ÷ {c['second']}", ""]
        if "goodput_ratio_rps" in c:
            lines.append(
                f"**Goodput ratio: {_f(c['goodput_ratio_rps'], 2)}** (swept rates; interpolated "
                f"{_f(c['goodput_ratio_interpolated_rps'], 2)}; highest passing rates "
                f"{_f(c.get('goodput_ratio_max_passing_rps'), 2)})"
            )
            lines.append("")
        lines += [f"Note: {note}" for note in c.get("notes", [])] + [""] * bool(c.get("notes"))
        lines += ["| rate req/s | p90 TTFT ratio | p90 TPOT ratio | SLO attain (first, second) |"]
        lines += ["|---|---|---|---|"]
        for row in c["per_rate"]:
            a1, a2 = row["attainment"]
            att = "—" if a1 is None else f"{a1:.0%}, {a2:.0%}"
            lines.append(
                f"| {row['rate_rps']:.3g} | {_f(row['p90_ttft_ratio'], 2)} | "
                f"{_f(row['p90_tpot_ratio'], 2)} | {att} |"
            )
        lines.append("")
    return lines


# ---- plots ------------------------------------------------------------------------------
def plot_attainment(results: dict[str, Any], path: Path) -> bool:
    import matplotlib.pyplot as plt

    topos = [
        t for t in results["topologies"] if t["runs"] and "attainment" in t["runs"][0]["summary"]
    ]
    if not topos:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for topo in topos:
        rates = [r["rate_rps"] for r in topo["runs"]]
        ax.plot(rates, [r["summary"]["attainment"] for r in topo["runs"]], "o-", label=topo["name"])
    ax.axhline(0.9, color="gray", linestyle="--", linewidth=1, label="90% target")
    ax.set(xlabel="request rate (req/s)", ylabel="SLO attainment (both SLOs)", ylim=(-0.02, 1.02))
    ax.set_title(_wrap(results["workload"]["description"]), fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_cdf(results: dict[str, Any], metric: str, rate: float | None, path: Path) -> float | None:
    """CDF of `metric` (ttft_ms or tpot_ms) per topology at the run nearest `rate` (default:
    the middle of the rates every topology ran); returns the rate plotted."""
    import matplotlib.pyplot as plt

    rate = rate if rate is not None else _cdf_rate(results)
    if rate is None:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for topo in results["topologies"]:
        run = min(topo["runs"], key=lambda r: abs(r["rate_rps"] - rate))
        values = sorted(v for r in run["requests"] if (v := r[metric]) is not None)
        if values:
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, ys, where="post", label=f"{topo['name']} @ {run['rate_rps']:.3g} req/s")
    ax.set(xlabel=metric.replace("_ms", " (ms)").upper(), ylabel="fraction of requests")
    ax.set_title(_wrap(f"{metric} CDF; {results['workload']['description']}"), fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return rate


def _cdf_rate(results: dict[str, Any]) -> float | None:
    per_topo = [{round(r["rate_rps"], 6) for r in t["runs"]} for t in results["topologies"]]
    common = sorted(set.intersection(*per_topo)) if per_topo else []
    if not common:
        runs = results["topologies"][0]["runs"] if per_topo else []
        common = sorted(r["rate_rps"] for r in runs)
    return common[len(common) // 2] if common else None


def _wrap(text: str, width: int = 110) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def write_all(results: dict[str, Any], out: Path, cdf_rate: float | None = None) -> dict[str, Path]:
    """results.json, summary.md and the plots; returns their paths by kind."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    results["comparisons"] = comparisons(results)
    paths: dict[str, Path] = {}
    if plot_attainment(results, out / "attainment_vs_rate.png"):
        paths["attainment_plot"] = out / "attainment_vs_rate.png"
    for metric in ("ttft_ms", "tpot_ms"):
        path = out / f"{metric.removesuffix('_ms')}_cdf.png"
        plotted = plot_cdf(results, metric, cdf_rate, path)
        if plotted is not None:
            results["cdf_rate_rps"] = plotted
            paths[f"{metric}_cdf"] = path
    paths["results"] = out / "results.json"
    paths["results"].write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    paths["summary"] = out / "summary.md"
    paths["summary"].write_text(markdown(results), encoding="utf-8")
    return paths


def write_vllm_json(results: dict[str, Any], path: Path) -> Path:
    """Every run as a `vllm bench serve` result object, one JSON object per line (as its
    --append-result writes them; a single run makes a plain JSON file)."""
    date = time.strftime("%Y%m%d-%H%M%S")
    lines = [
        json.dumps(vllm_result(topo, run, date))
        for topo in results["topologies"]
        for run in topo["runs"]
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
