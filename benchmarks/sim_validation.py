"""Simulator vs real engine: one table from two `pdcluster bench` results.json files that ran
the same topologies, trace and rates, one on the real model and one on its fitted `sim:`
profile. Each cell is real / sim (sim ÷ real); a ratio outside ±tolerance is marked.

    python -m pdcluster.benchmarks.sim_validation --real REAL/results.json --sim SIM/results.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("tpot_ms", "p50"), ("tpot_ms", "p90"))


def _cell(real: float | None, sim: float | None, tolerance: float, digits: int = 0) -> str:
    if real is None or sim is None:
        return "n/a"
    values = f"{real:.{digits}f} / {sim:.{digits}f}"
    if real == 0:
        return values
    ratio = sim / real
    mark = "" if abs(ratio - 1) <= tolerance else " **✗**"
    return f"{values} ({ratio:.2f}{mark})"


def _by_name(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["topology"] or t["name"]: t for t in results["topologies"]}


def table(real: dict[str, Any], sim: dict[str, Any], tolerance: float = 0.15) -> str:
    """Markdown rows per (topology, rate) of both runs, then goodput per topology."""
    head = " | ".join(f"{m.split('_')[0].upper()} {q} ms" for m, q in METRICS)
    lines = [f"| topology | rate req/s | {head} | attainment |", "|---" * (len(METRICS) + 3) + "|"]
    sims = _by_name(sim)
    for name, topo in _by_name(real).items():
        sim_runs = {r["rate_rps"]: r for r in sims.get(name, {}).get("runs", [])}
        for run in topo.get("runs", []):
            other = sim_runs.get(run["rate_rps"])
            if other is None:
                continue
            a, b = run["summary"], other["summary"]
            cells = [_cell(a[m][q], b[m][q], tolerance) for m, q in METRICS]
            attain = _cell(100 * a.get("attainment", 0), 100 * b.get("attainment", 0), tolerance)
            lines.append(f"| {name} | {run['rate_rps']:g} | {' | '.join(cells)} | {attain} |")
    lines += ["", "| topology | goodput req/s real / sim (interpolated) |", "|---|---|"]
    for name, topo in _by_name(real).items():
        g_real = topo.get("goodput", {}).get("interpolated_rps")
        g_sim = sims.get(name, {}).get("goodput", {}).get("interpolated_rps")
        lines.append(f"| {name} | {_cell(g_real, g_sim, tolerance, digits=3)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--real", required=True, type=Path, help="results.json of the real model")
    p.add_argument("--sim", required=True, type=Path, help="results.json of its sim: profile")
    p.add_argument("--tolerance", type=float, default=0.15, help="allowed |sim/real - 1|")
    args = p.parse_args(argv)
    load = lambda path: json.loads(path.read_text(encoding="utf-8"))  # noqa: E731
    print(table(load(args.real), load(args.sim), args.tolerance))
    return 0


if __name__ == "__main__":
    sys.exit(main())
