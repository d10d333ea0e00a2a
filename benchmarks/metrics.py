"""Latency percentiles, throughput, SLO attainment and goodput of benchmark runs."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdcluster.benchmarks.client import RequestResult

PERCENTILES = (50, 90, 99)
GOODPUT_ATTAINMENT = 0.9  # DistServe: a rate counts when 90% of requests meet both SLOs


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation between order statistics (numpy's
    default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def percentiles_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for q in PERCENTILES:
        v = percentile(values_s, q)
        out[f"p{q}"] = None if v is None else round(v * 1e3, 3)
    out["mean"] = round(sum(values_s) / len(values_s) * 1e3, 3) if values_s else None
    return out


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float

    def met(self, r: RequestResult) -> bool:
        """Both SLOs met; a single-token request has no TPOT and meets that one."""
        if not r.ok or r.ttft_s * 1e3 > self.ttft_ms:
            return False
        tpot = r.tpot_s
        return tpot is None or tpot * 1e3 <= self.tpot_ms


def summarize(
    results: Sequence[RequestResult], duration_s: float, slo: Slo | None
) -> dict[str, Any]:
    """Every per-run number: counts, latency percentiles (ms), throughput, SLO attainment.
    Attainment is over all requests (a failed one misses), as is each SLO's own share."""
    ok = [r for r in results if r.ok]
    tokens = sum(r.num_output_tokens for r in ok)
    out: dict[str, Any] = {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(results) - len(ok),
        "duration_s": round(duration_s, 3),
        "throughput_rps": len(ok) / duration_s if duration_s > 0 else None,
        "output_tokens_per_s": tokens / duration_s if duration_s > 0 else None,
        "ttft_ms": percentiles_ms([r.ttft_s for r in ok]),
        "tpot_ms": percentiles_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": percentiles_ms([x for r in ok for x in r.itl_s]),
        # first to second token: includes the P->D KV handoff in a disaggregated topology
        "first_itl_ms": percentiles_ms([r.itl_s[0] for r in ok if r.itl_s]),
        "e2e_ms": percentiles_ms([r.e2e_s for r in ok]),
    }
    errors = [r.error for r in results if r.error]
    if errors:
        out["first_error"] = errors[0]
    if slo is not None and results:
        n = len(results)
        out["attainment"] = sum(slo.met(r) for r in results) / n
        out["ttft_attainment"] = sum(r.ok and r.ttft_s * 1e3 <= slo.ttft_ms for r in results) / n
        out["tpot_attainment"] = (
            sum(r.ok and (r.tpot_s is None or r.tpot_s * 1e3 <= slo.tpot_ms) for r in results) / n
        )
    return out


def goodput(
    points: Sequence[tuple[float, float]], target: float = GOODPUT_ATTAINMENT
) -> dict[str, float | None]:
    """From (rate, attainment) points: `rps`, the highest swept rate such that it and every
    lower swept rate reach `target` (so a lucky run past a failing one does not count), and
    `interpolated_rps`, the rate where attainment crosses `target` between that rate and the
    next swept one (linear; equal to `rps` when no higher rate was swept). `max_passing_rps`
    is the highest swept rate that reaches `target` at all (on a noisy machine a low rate can
    miss while a higher one passes; both are reported)."""
    ordered = sorted(points)
    best: float | None = None
    best_attainment = 0.0
    following: tuple[float, float] | None = None
    for rate, attainment in ordered:
        if attainment < target:
            following = (rate, attainment)
            break
        best, best_attainment = rate, attainment
    interpolated = best
    if best is not None and following is not None:
        rate, attainment = following
        fraction = (best_attainment - target) / (best_attainment - attainment)
        interpolated = best + fraction * (rate - best)
    passing = [rate for rate, attainment in ordered if attainment >= target]
    return {
        "rps": best,
        "interpolated_rps": interpolated,
        "max_passing_rps": passing[-1] if passing else None,
        "target_attainment": target,
    }


def search_rates(
    measure: Callable[[float], float],
    start: float,
    target: float = GOODPUT_ATTAINMENT,
    max_expand: int = 5,
    bisect_steps: int = 2,
) -> list[tuple[float, float]]:
    """Automatic goodput search: double (or halve) from `start` until attainment crosses
    `target`, then bisect (geometrically) `bisect_steps` times. `measure(rate)` runs once per
    rate and returns its attainment; returns the (rate, attainment) points measured."""
    points = [(start, measure(start))]
    passing = points[0][1] >= target
    lo, hi = (start, None) if passing else (None, start)
    rate = start
    for _ in range(max_expand):
        if lo is not None and hi is not None:
            break
        rate = rate * 2 if passing else rate / 2
        attainment = measure(rate)
        points.append((rate, attainment))
        if attainment >= target:
            lo = rate if lo is None or rate > lo else lo
        else:
            hi = rate if hi is None or rate < hi else hi
    if lo is None or hi is None:
        return points
    for _ in range(bisect_steps):
        mid = math.sqrt(lo * hi)
        attainment = measure(mid)
        points.append((mid, attainment))
        lo, hi = (mid, hi) if attainment >= target else (lo, mid)
    return points


# ---- `vllm bench serve` result format ---------------------------------------------------
VLLM_STAT_METRICS = ("ttft", "tpot", "itl", "e2el")


def vllm_result(topo: dict[str, Any], run: dict[str, Any], date: str) -> dict[str, Any]:
    """One run (of results.json) as the object `vllm bench serve --save-result --save-detailed
    --percentile-metrics ttft,tpot,itl,e2el` writes: aggregates in ms (numpy mean, median,
    population std, p99; 0 when empty), per-request lists in seconds, failed requests
    included there with 0 / [] / their error. `start_times` are seconds since the run's
    start and `queue_times` the wait for a --max-concurrency slot (or send lag)."""
    reqs = run["requests"]
    ok = [r for r in reqs if _ok(r)]
    duration = run["summary"]["duration_s"]
    total_input = sum(r["prompt_len"] for r in ok)
    total_output = sum(r["num_output_tokens"] for r in ok)
    attainment = run["summary"].get("attainment")
    rate = run["rate_rps"]
    out: dict[str, Any] = {
        "date": date,
        "endpoint_type": "openai",
        "backend": "openai",
        "label": topo["name"],
        "model_id": topo["model"],
        "tokenizer_id": topo["model"],
        "num_prompts": len(reqs),
        "request_rate": rate if rate < math.inf else "inf",
        "burstiness": 1.0 if run["scaling"].get("source") == "synthetic" else None,
        "max_concurrency": run.get("max_concurrency"),
        "duration": duration,
        "completed": len(ok),
        "failed": len(reqs) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": None if attainment is None else attainment * len(reqs) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "input_lens": [r["prompt_len"] for r in reqs],
        "output_lens": [r["num_output_tokens"] if _ok(r) else 0 for r in reqs],
        "ttfts": [_s(r["ttft_ms"]) for r in reqs],
        "itls": [[x / 1e3 for x in r["itl_ms"]] for r in reqs],
        "latencies": [_s(r["e2e_ms"]) for r in reqs],
        "start_times": [r["send_s"] for r in reqs],
        "queue_times": [max(0.0, r["send_s"] - r["arrival_s"]) for r in reqs],
        "errors": [r["error"] or "" for r in reqs],
    }
    samples_ms = {
        "ttft": [r["ttft_ms"] for r in ok],
        "tpot": [r["tpot_ms"] for r in ok if r["tpot_ms"] is not None],
        "itl": [x for r in ok for x in r["itl_ms"]],
        "e2el": [r["e2e_ms"] for r in ok],
    }
    for name in VLLM_STAT_METRICS:
        values = np.asarray(samples_ms[name] or [0.0], dtype=float)
        out[f"mean_{name}_ms"] = float(np.mean(values))
        out[f"median_{name}_ms"] = float(np.median(values))
        out[f"std_{name}_ms"] = float(np.std(values))
        out[f"p99_{name}_ms"] = float(np.percentile(values, 99))
    return out


def _ok(r: dict[str, Any]) -> bool:
    """`RequestResult.ok` of a results.json request."""
    return r["error"] is None and r["ttft_ms"] is not None and r["e2e_ms"] is not None


def _s(ms: float | None) -> float:
    return 0.0 if ms is None else ms / 1e3
