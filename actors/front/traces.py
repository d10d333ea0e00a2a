"""What one gateway replica saw of its finished requests: a trace each (with the stage
times of every instance it passed) and their latencies, for the planner."""

from __future__ import annotations

import time
from collections import deque

from pdcluster.actors.front.flight import Flight
from pdcluster.actors.messages import RequestTrace

MAX_TRACES = 10_000  # finished requests' traces kept for `Front.traces`
MAX_LATENCIES = 1000  # finished requests' latencies kept for `latency_p90`
TRACE_PROMPT_HEAD = 8  # prompt token ids a trace keeps


class Traces:
    """The latest finished requests' traces and latencies (the Front's loop alone)."""

    def __init__(self) -> None:
        self._traces: deque[RequestTrace] = deque(maxlen=MAX_TRACES)
        # (finished, TTFT, TPOT) in seconds, monotonic
        self._latencies: deque[tuple[float, float, float | None]] = deque(maxlen=MAX_LATENCIES)

    def record(self, flight: Flight) -> None:
        """The flight finished (or was given up) just now."""
        self._traces.append(trace(flight, time.time()))
        now = time.monotonic()
        latency = flight.clock.latency(now)
        if latency is not None:
            self._latencies.append((now, *latency))

    def traces(self) -> list[RequestTrace]:
        """Oldest first."""
        return list(self._traces)

    def latency_p90(self, window_s: float = 60.0) -> tuple[float | None, float | None]:
        """TTFT and TPOT p90 (ms) of the requests finished in the last `window_s`."""
        since = time.monotonic() - window_s
        recent = [(t, p) for end, t, p in list(self._latencies) if end >= since]
        ttft = p90([t for t, _ in recent])
        tpot = p90([p for _, p in recent if p is not None])
        return ttft, tpot


def trace(flight: Flight, finished_s: float) -> RequestTrace:
    request, clock = flight.origin, flight.clock
    return RequestTrace(
        flight.client_id,
        tuple(request.prompt_token_ids[:TRACE_PROMPT_HEAD]),
        request.num_prompt_tokens,
        clock.num_tokens,
        clock.started_wall_s,
        clock.first_token_wall_s,
        finished_s,
        flight.stage_times,
        flight.attempts - 1,
    )


def p90(values: list[float]) -> float | None:
    """The 90th percentile in milliseconds; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1000
