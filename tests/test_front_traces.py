"""Finished requests' traces and latencies (actors/front/traces.py) and the pulls a leak
check must not count (actors/front/leaks.py). No Ray."""

from __future__ import annotations

import time

from pdcluster.actors.front import leaks
from pdcluster.actors.front.bridge import Sink
from pdcluster.actors.front.flight import Clock, Flight
from pdcluster.actors.front.traces import TRACE_PROMPT_HEAD, Traces, p90
from pdcluster.actors.messages import StageTimes
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams


def flight(client_id: str = "r", num_prompt: int = 20) -> Flight:
    request = Request(client_id, list(range(num_prompt)), SamplingParams(max_tokens=4))
    return Flight(request, Sink(None, None, 0), client_id)


def test_clock_ttft_and_tpot():
    clock = Clock(started_s=10.0)
    assert clock.latency(now=11.0) is None  # no token came
    clock.on_tokens(0, now=10.5)
    assert clock.first_token_s is None
    clock.on_tokens(1, now=10.5)
    clock.on_tokens(2, now=10.7)
    assert clock.first_token_s == 10.5 and clock.num_tokens == 3
    ttft, tpot = clock.latency(now=10.9)
    assert abs(ttft - 0.5) < 1e-9 and abs(tpot - 0.2) < 1e-9
    one = Clock(started_s=0.0)
    one.on_tokens(1, now=1.0)
    assert one.latency(now=2.0) == (1.0, None)


def test_a_trace_names_the_client_request_its_stages_and_moves():
    f = flight(num_prompt=20)
    f.request = Request("r~3", list(range(30)), SamplingParams())  # a later attempt
    f.attempts = 3
    f.stage_times.append(StageTimes("r~3", "D0", "decode", received_s=1.0))
    f.clock.on_tokens(5, time.monotonic())
    traces = Traces()
    traces.record(f)
    (trace,) = traces.traces()
    assert trace.request_id == "r" and trace.num_moves == 2
    assert trace.prompt_head == tuple(range(TRACE_PROMPT_HEAD)) and trace.num_prompt_tokens == 20
    assert trace.num_output_tokens == 5 and trace.first_token_s is not None
    assert trace.stage_times == f.stage_times and trace.finished_s >= trace.started_s


def test_latency_p90_counts_requests_with_tokens_in_the_window():
    traces = Traces()
    assert traces.latency_p90() == (None, None)
    for i in range(10):
        f = flight(f"r{i}")
        f.clock = Clock(started_s=time.monotonic() - 0.1 * (i + 1))
        f.clock.on_tokens(1, time.monotonic())
        traces.record(f)
    traces.record(flight("none"))  # no token: a trace, no latency
    ttft, tpot = traces.latency_p90()
    assert len(traces.traces()) == 11
    assert 900 <= ttft <= 1100 and tpot is None
    assert traces.latency_p90(window_s=-1.0) == (None, None)


def test_p90():
    assert p90([]) is None
    assert p90([0.001 * i for i in range(1, 11)]) == 10.0
    assert p90([0.5]) == 500.0


def test_pull_object_ids_are_in_flight_or_recent_of_every_replica():
    first, second = leaks.PullIds(), leaks.PullIds()
    before = time.monotonic()
    first.started("a")
    first.done("a")
    second.started("b")
    after = time.monotonic() + 1
    assert first.since(before) == {"a"} and first.since(after) == set()
    assert second.since(after) == {"b"}  # still in flight
    assert {"a", "b"} <= leaks.pull_object_ids(before)
    assert "a" not in leaks.pull_object_ids(after)
    del second
    assert "b" not in leaks.pull_object_ids(after)  # a replica gone is forgotten
