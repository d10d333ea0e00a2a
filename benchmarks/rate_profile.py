"""Rate profiles: a piecewise-constant request rate (steps of req/s for seconds), Poisson
arrivals under it, and a profile taken from a trace's own rate over time.

`--rate-steps 0.3:60,1.2:60` is 0.3 req/s for 60 s, then 1.2 req/s for 60 s.
`trace_rate_steps` turns a trace (the Azure LLM conversation trace by default) into steps: its
arrival rate per window of `bin_s` seconds, scaled so that the busiest window runs at a chosen
peak, each window lasting `step_s` in the run: the trace's rate shape, compressed in time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

from pdcluster.benchmarks.workload import Workload, load_trace


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
    return ",".join(f"{s.rate_rps:.3g}:{s.duration_s:g}" for s in steps)


def step_starts(steps: tuple[RateStep, ...]) -> list[float]:
    """Start time of each step, and the schedule's end last."""
    starts = [0.0]
    for step in steps:
        starts.append(starts[-1] + step.duration_s)
    return starts


def step_index(steps: tuple[RateStep, ...], t_s: float) -> int | None:
    """The index of the step holding `t_s` (None outside the schedule)."""
    starts = step_starts(steps)
    for i, (start, end) in enumerate(zip(starts, starts[1:])):
        if start <= t_s < end:
            return i
    return None


def rate_at(steps: tuple[RateStep, ...], t_s: float) -> float:
    """The scheduled rate at `t_s` (0 outside the schedule)."""
    i = step_index(steps, t_s)
    return 0.0 if i is None else steps[i].rate_rps


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


def trace_rate_steps(
    path: str | Path, bin_s: float, peak_rps: float, step_s: float
) -> tuple[RateStep, ...]:
    """The trace's arrival rate in each full window of `bin_s` seconds (a partial last window
    is dropped), scaled so that the busiest window's rate is `peak_rps`, each window one step
    of `step_s` seconds."""
    if bin_s <= 0 or peak_rps <= 0 or step_s <= 0:
        raise ValueError("a trace rate profile needs a window, a peak rate and a step above 0")
    rows = load_trace(path)
    num_bins = int(rows[-1].arrival_s // bin_s)
    if num_bins < 1:
        raise ValueError(
            f"trace {path} spans {rows[-1].arrival_s:.0f} s: no full {bin_s:g} s window"
        )
    counts = [0] * num_bins
    for row in rows:
        i = int(row.arrival_s // bin_s)
        if i < num_bins:
            counts[i] += 1
    return tuple(RateStep(peak_rps * c / max(counts), step_s) for c in counts)


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
