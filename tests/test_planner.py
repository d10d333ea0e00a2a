"""Autoscaling policy: synthetic signals and an injected clock, no Ray."""

from __future__ import annotations

from typing import Any

import pytest

from pdcluster.actors.messages import InstanceStats, SchedulerStats
from pdcluster.cluster.autoscale_config import AutoscaleSettings
from pdcluster.cluster.control.planner import Decision, Planner, RoleSignals, signals_from_stats

UP_COOLDOWN_S, DOWN_COOLDOWN_S = 30.0, 120.0


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds


def make_planner(**fields: Any) -> tuple[Planner, FakeClock]:
    """A planner of P in [1, 4] and D in [1, 4] with default targets, `fields` on top."""
    settings = {
        "prefill": {"min": 1, "max": 4},
        "decode": {"min": 1, "max": 4},
        "scale_up_cooldown_s": UP_COOLDOWN_S,
        "scale_down_cooldown_s": DOWN_COOLDOWN_S,
        **fields,
    }
    clock = FakeClock()
    return Planner(AutoscaleSettings.model_validate(settings), clock=clock), clock


def prefill(count: int, queued_per_p: int = 0, ttft_p90_ms: float | None = None) -> RoleSignals:
    return RoleSignals(
        count=count,
        queued_prefill_tokens=queued_per_p * count,
        num_running=0,
        num_waiting=0,
        kv_usage=0.0,
        ttft_p90_ms=ttft_p90_ms,
    )


def decode(
    count: int, kv_usage: float = 0.0, running_per_d: int = 0, tpot_p90_ms: float | None = None
) -> RoleSignals:
    return RoleSignals(
        count=count,
        queued_prefill_tokens=0,
        num_running=running_per_d * count,
        num_waiting=0,
        kv_usage=kv_usage,
        tpot_p90_ms=tpot_p90_ms,
    )


def decision_of(planner: Planner, role: str, signals: RoleSignals) -> Decision:
    """The planner's decision for `role` given its signals (the other role idle at 1)."""
    idle = {"prefill": prefill(1), "decode": decode(1)}
    decisions = {d.role: d for d in planner.decide({**idle, role: signals})}
    return decisions[role]


def desired_of(planner: Planner, role: str, signals: RoleSignals) -> int:
    return decision_of(planner, role, signals).desired


# ---- scaling up and down -----------------------------------------------------------------


def test_prefill_burst_adds_one_p_then_the_end_of_it_removes_one_after_cooldown():
    planner, clock = make_planner()
    burst = decision_of(planner, "prefill", prefill(1, queued_per_p=5120))
    assert (burst.current, burst.desired) == (1, 2)
    assert burst.reason == "queued prefill tokens per P 5120 > 2048"

    clock.advance(DOWN_COOLDOWN_S - 1)  # burst over, but too soon after the scale-up
    assert desired_of(planner, "prefill", prefill(2, queued_per_p=100)) == 2
    clock.advance(1)
    calm = decision_of(planner, "prefill", prefill(2, queued_per_p=100))
    assert (calm.current, calm.desired) == (2, 1)
    assert calm.reason == "queued prefill tokens per P with one P fewer 200 < 1024 (0.5 × 2048)"


@pytest.mark.parametrize(
    ("signals", "reason"),
    [
        (decode(1, kv_usage=0.9), "KV usage per D 0.90 > 0.80"),
        (decode(1, running_per_d=60), "running sequences per D 60 > 48"),
    ],
    ids=["kv-usage", "running"],
)
def test_decode_load_adds_one_d(signals, reason):
    planner, _ = make_planner()
    decision = decision_of(planner, "decode", signals)
    assert (decision.current, decision.desired, decision.reason) == (1, 2, reason)


def test_roles_scale_independently():
    planner, _ = make_planner()
    decisions = planner.decide({"prefill": prefill(2, queued_per_p=4096), "decode": decode(3)})
    assert [(d.role, d.current, d.desired) for d in decisions] == [
        ("prefill", 2, 3),
        ("decode", 3, 2),
    ]


def test_sustained_load_adds_one_instance_per_up_cooldown():
    planner, clock = make_planner()
    counts = [1]
    for _ in range(4):
        counts.append(desired_of(planner, "prefill", prefill(counts[-1], queued_per_p=9000)))
        clock.advance(UP_COOLDOWN_S / 2)
        mid_cooldown = desired_of(planner, "prefill", prefill(counts[-1], queued_per_p=9000))
        assert mid_cooldown == counts[-1]
        clock.advance(UP_COOLDOWN_S / 2)
    assert counts == [1, 2, 3, 4, 4]  # one step at a time, never past max


# ---- hysteresis and cooldown -------------------------------------------------------------


@pytest.mark.parametrize("queued_per_p", [700, 1024, 1500, 2048])
def test_load_between_the_thresholds_holds_the_count(queued_per_p):
    # With 3 P, one fewer would put 1.5 × queued_per_p on each: >= 0.5 × 2048 from 683 up.
    planner, clock = make_planner()
    for _ in range(10):
        decision = decision_of(planner, "prefill", prefill(3, queued_per_p=queued_per_p))
        assert decision.desired == 3 and "<= 2048" in decision.reason
        clock.advance(DOWN_COOLDOWN_S)


def test_after_a_scale_down_the_same_load_neither_scales_up_nor_down():
    planner, clock = make_planner()
    total = 1200  # queued prefill tokens of the whole role
    assert desired_of(planner, "prefill", prefill(4, queued_per_p=total // 4)) == 3
    clock.advance(DOWN_COOLDOWN_S)
    assert desired_of(planner, "prefill", prefill(3, queued_per_p=total // 3)) == 2
    for _ in range(10):  # 600 per P: under 2048, and 1200 on one P fewer is not under 1024
        clock.advance(DOWN_COOLDOWN_S)
        assert desired_of(planner, "prefill", prefill(2, queued_per_p=total // 2)) == 2


def test_scale_up_right_after_a_scale_down_waits_for_the_up_cooldown():
    planner, clock = make_planner()
    assert desired_of(planner, "decode", decode(2)) == 1
    clock.advance(UP_COOLDOWN_S - 5)
    held = decision_of(planner, "decode", decode(1, kv_usage=0.95))
    assert held.desired == 1
    assert held.reason == "KV usage per D 0.95 > 0.80, but cooling down 5s"
    clock.advance(5)
    assert desired_of(planner, "decode", decode(1, kv_usage=0.95)) == 2


def test_cooldown_is_per_role():
    planner, _ = make_planner()
    assert desired_of(planner, "prefill", prefill(1, queued_per_p=5000)) == 2
    assert desired_of(planner, "decode", decode(1, running_per_d=100)) == 2


# ---- bounds ------------------------------------------------------------------------------


def test_at_max_load_over_target_holds_and_says_so():
    planner, _ = make_planner()
    decision = decision_of(planner, "decode", decode(4, kv_usage=0.99))
    assert decision.desired == 4
    assert decision.reason == "KV usage per D 0.99 > 0.80, but at max 4"


def test_idle_role_at_min_stays_there():
    planner, _ = make_planner(prefill={"min": 2, "max": 4})
    decision = decision_of(planner, "prefill", prefill(2))
    assert decision.desired == 2 and decision.reason.endswith("at min 2")


def test_role_below_min_is_restored_at_once_despite_cooldown():
    planner, _ = make_planner(decode={"min": 3, "max": 6})
    assert desired_of(planner, "decode", decode(3, kv_usage=0.95)) == 4
    restored = decision_of(planner, "decode", decode(1))  # three instances died
    assert (restored.current, restored.desired, restored.reason) == (1, 3, "1 D < min 3")


def test_role_without_live_instances_is_brought_back_to_min():
    planner, _ = make_planner(prefill={"min": 2, "max": 4})
    (decision,) = [d for d in planner.decide({"decode": decode(1)}) if d.role == "prefill"]
    assert (decision.current, decision.desired) == (0, 2)


def test_role_above_max_is_brought_down_to_max():
    planner, _ = make_planner()
    decision = decision_of(planner, "decode", decode(6, kv_usage=0.99))
    assert (decision.desired, decision.reason) == (4, "6 D > max 4")


def test_only_configured_roles_are_decided():
    planner, _ = make_planner(prefill=None)
    assert [d.role for d in planner.decide({"decode": decode(1)})] == ["decode"]


# ---- latency targets ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "fields", "signals", "reason"),
    [
        (
            "prefill",
            {"prefill": {"max": 4, "target_ttft_p90_ms": 500}},
            prefill(2, queued_per_p=10, ttft_p90_ms=812),
            "TTFT p90 ms 812 > 500",
        ),
        (
            "decode",
            {"decode": {"max": 4, "target_tpot_p90_ms": 40}},
            decode(2, kv_usage=0.1, tpot_p90_ms=55),
            "TPOT p90 ms 55 > 40",
        ),
    ],
    ids=["ttft", "tpot"],
)
def test_latency_over_target_scales_up_with_low_queues(role, fields, signals, reason):
    planner, _ = make_planner(**fields)
    decision = decision_of(planner, role, signals)
    assert (decision.current, decision.desired, decision.reason) == (2, 3, reason)


def test_latency_near_target_blocks_scale_down():
    planner, _ = make_planner(decode={"max": 4, "target_tpot_p90_ms": 40})
    assert desired_of(planner, "decode", decode(2, tpot_p90_ms=30)) == 2  # 30 >= 0.5 × 40
    assert desired_of(planner, "decode", decode(2, tpot_p90_ms=15)) == 1


def test_latency_without_a_target_is_ignored():
    planner, _ = make_planner()
    assert desired_of(planner, "prefill", prefill(1, ttft_p90_ms=60_000)) == 1


# ---- bookkeeping -------------------------------------------------------------------------


def test_every_decision_has_a_reason_and_is_kept_for_metrics():
    planner, clock = make_planner()
    loads = [prefill(1, 5000), prefill(2, 5000), prefill(2, 1500), prefill(2, 10), prefill(0)]
    for signals in loads:
        decision = decision_of(planner, "prefill", signals)
        assert decision.reason and decision in planner.last_decisions
        assert planner.desired["prefill"] == decision.desired
        assert len(planner.last_decisions) == 2  # one per autoscaled role
        clock.advance(10)


# ---- signals from instance stats ---------------------------------------------------------


def instance(role: str, healthy: bool = True, **scheduler: int) -> InstanceStats:
    blocks = {"num_blocks_free": 100, "num_blocks_total": 100}
    stats = SchedulerStats(**{**blocks, **scheduler})
    return InstanceStats("i", role, healthy=healthy, scheduler=stats)


def test_signals_sum_totals_and_average_kv_usage_over_healthy_instances():
    stats = [
        instance("prefill", prefill_tokens_queued=3000, num_waiting=2),
        instance("prefill", prefill_tokens_queued=1000, num_waiting=1),
        instance("decode", num_running=10, num_blocks_free=20),  # 80% used
        instance("decode", num_running=30, num_blocks_free=60, num_waiting=4),  # 40% used
    ]
    signals = signals_from_stats(stats)
    assert signals["prefill"] == RoleSignals(
        count=2, queued_prefill_tokens=4000, num_running=0, num_waiting=3, kv_usage=0.0
    )
    d = signals["decode"]
    assert (d.count, d.num_running, d.num_waiting) == (2, 40, 4)
    assert d.kv_usage == pytest.approx(0.6)


def test_signals_ignore_unhealthy_instances():
    stats = [
        instance("decode", num_running=5, num_blocks_free=50),
        instance("decode", healthy=False, num_running=99, num_blocks_free=0),
        instance("prefill", healthy=False, prefill_tokens_queued=9999),
    ]
    signals = signals_from_stats(stats)
    assert (signals["decode"].count, signals["decode"].num_running) == (1, 5)
    assert signals["decode"].kv_usage == pytest.approx(0.5)
    assert signals["prefill"] == RoleSignals(0, 0, 0, 0, 0.0)  # no live P: restore to min


def test_signals_take_gateway_latencies_per_role():
    signals = signals_from_stats(
        [instance("prefill"), instance("decode")], ttft_p90_ms=300.0, tpot_p90_ms=25.0
    )
    assert (signals["prefill"].ttft_p90_ms, signals["prefill"].tpot_p90_ms) == (300.0, None)
    assert (signals["decode"].ttft_p90_ms, signals["decode"].tpot_p90_ms) == (None, 25.0)


def test_instance_without_kv_blocks_counts_as_empty():
    (signals,) = signals_from_stats([instance("decode", num_blocks_total=0)]).values()
    assert signals.kv_usage == 0.0


def test_planner_runs_on_signals_built_from_stats():
    planner, _ = make_planner()
    stats = [instance("prefill", prefill_tokens_queued=8000)] + [
        instance("decode", num_blocks_free=5) for _ in range(2)
    ]
    decisions = planner.decide(signals_from_stats(stats))
    assert [(d.role, d.current, d.desired) for d in decisions] == [
        ("prefill", 1, 2),
        ("decode", 2, 3),
    ]
