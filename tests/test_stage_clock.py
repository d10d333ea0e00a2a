"""Stage times stamped by an instance's step thread (no Ray), and the stage durations the
benchmark derives from them."""

from pdcluster.actors.messages import RequestTrace, StageTimes
from pdcluster.actors.stage_clock import StageClock
from pdcluster.benchmarks.stages import request_stages, summarize_stages
from pdcluster.engine.outputs import EngineCoreOutput


def test_clock_stamps_each_stage_and_forgets_finished_requests():
    clock = StageClock("p-0", "prefill")
    clock.received("a", 1.0)
    clock.received("b", 1.5)
    # step 1 runs a's first prefill chunk: a is running, no output yet
    assert clock.after_step(2.0, 3.0, ["a"], []) == {}
    # step 2: a's last chunk gives its first token; b ran and finished within the step
    outputs = [EngineCoreOutput("a", [7]), EngineCoreOutput("b", [8], finish_reason="length")]
    done = clock.after_step(3.0, 4.0, ["a"], outputs)
    assert done == {"b": StageTimes("b", "p-0", "prefill", 1.5, 3.0, 4.0, 4.0)}
    assert len(clock) == 1
    done = clock.after_step(4.0, 5.0, [], [EngineCoreOutput("a", [9], finish_reason="stop")])
    assert done == {"a": StageTimes("a", "p-0", "prefill", 1.0, 2.0, 4.0, 5.0)}
    assert len(clock) == 0


def test_clock_forgets_aborted_requests_and_ignores_unknown_outputs():
    clock = StageClock("m-0", "mixed")
    clock.received("a", 1.0)
    clock.forget(["a", "never-seen"])
    assert len(clock) == 0
    assert (
        clock.after_step(2.0, 3.0, ["a"], [EngineCoreOutput("a", [1], finish_reason="stop")]) == {}
    )


def test_request_stages_of_a_handoff():
    prefill = StageTimes("r", "p-0", "prefill", 10.0, 10.5, 11.0, 11.0)
    decode = StageTimes("r", "d-0", "decode", 11.01, 11.05, 11.1, 12.0)
    trace = RequestTrace("r", (1, 2), 2, 11, 9.9, 11.02, 12.01, [prefill, decode])
    stages = request_stages(trace, client_ttft_s=1.2)
    expected = {
        "to_instance": 100.0,
        "queue": 500.0,
        "prefill": 500.0,
        "to_replica": 20.0,
        "gateway_http": 1200.0 - 1120.0,
        "to_decode": 10.0,
        "kv_wait": 40.0,
        "first_decode_step": 50.0,
        "decode": 1000.0,
        "decode_per_token": 100.0,
    }
    assert stages.keys() == expected.keys()
    for name, value in expected.items():
        assert abs(stages[name] - value) < 1e-6, name
    summary = summarize_stages([stages, None])
    assert summary["num_traced"] == 1 and summary["kv_wait"]["p50"] == stages["kv_wait"]


def test_request_stages_of_a_colocated_request_have_no_handoff():
    mixed = StageTimes("r", "m-0", "mixed", 10.0, 10.0, 10.3, 10.9)
    trace = RequestTrace("r", (1,), 1, 4, 9.99, 10.31, 10.91, [mixed])
    stages = request_stages(trace, client_ttft_s=None)
    assert stages["to_decode"] is None and stages["kv_wait"] is None
    assert stages["gateway_http"] is None
    assert abs(stages["decode"] - 600.0) < 1e-6 and abs(stages["decode_per_token"] - 200.0) < 1e-6
