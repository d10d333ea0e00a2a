"""Autoscaling policy: how many prefill and decode instances each role should have. No Ray, no I/O.

Every `interval_s` the caller turns the instances' published stats into one `RoleSignals` per
role (`signals_from_stats`), asks `Planner.decide` for one `Decision` per autoscaled role, and
adds or drains instances until each role has `desired` of them. The policy, per role:

- outside [min, max] (an instance died, or the bounds changed): straight back to the bound;
- any signal over its target: one instance more, once the scale-up cooldown has passed;
- every signal under `scale_down_fraction` of its target even with one instance fewer: one
  instance fewer, once the (longer) scale-down cooldown has passed;
- otherwise hold. The gap between the two thresholds is the hysteresis: right after a scale
  down the load per instance is under fraction × target < target, so it never scales up again
  for the same load.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdcluster.actors.messages import InstanceStats
from pdcluster.cluster.autoscale_config import AUTOSCALED_ROLES, AutoscaleSettings
from pdcluster.routing.role import Role

_LETTERS = {Role.PREFILL: "P", Role.DECODE: "D"}


@dataclass(frozen=True)
class RoleSignals:
    """Load of one role, over its live (healthy) instances: totals, and means per instance."""

    count: int  # live instances of the role
    queued_prefill_tokens: int  # total
    num_running: int  # total
    num_waiting: int  # total
    kv_usage: float  # mean fraction of KV blocks in use, 0..1
    ttft_p90_ms: float | None = None  # None: not measured
    tpot_p90_ms: float | None = None


@dataclass(frozen=True)
class Decision:
    """What one role should have; `desired == current` holds. `reason` names the deciding
    signal and its value against its threshold."""

    role: Role
    current: int
    desired: int
    reason: str


@dataclass(frozen=True)
class _Signal:
    """One load measure of a role against its scale-up target. A per-instance measure is
    spread over the instances (one fewer raises it by count / (count - 1)); a latency is not."""

    name: str
    value: float
    target: float
    per_instance: bool

    def after_removal(self, count: int) -> float:
        return self.value * count / (count - 1) if self.per_instance else self.value


def signals_from_stats(
    stats: Iterable[InstanceStats],
    ttft_p90_ms: float | None = None,
    tpot_p90_ms: float | None = None,
) -> dict[Role, RoleSignals]:
    """`RoleSignals` of every role that has instances in `stats` (one per instance, as the
    instances publish them), counting healthy instances only. TTFT p90, measured at the
    gateway, goes to prefill; TPOT p90 to decode."""
    healthy: dict[Role, list[InstanceStats]] = {}
    for s in stats:
        healthy.setdefault(s.role, [])
        if s.healthy:
            healthy[s.role].append(s)
    latency = {Role.PREFILL: (ttft_p90_ms, None), Role.DECODE: (None, tpot_p90_ms)}
    return {
        role: _role_signals(instances, *latency.get(role, (None, None)))
        for role, instances in healthy.items()
    }


def _role_signals(
    instances: list[InstanceStats], ttft_p90_ms: float | None, tpot_p90_ms: float | None
) -> RoleSignals:
    scheds = [s.scheduler for s in instances]
    usages = [s.kv_usage for s in scheds]
    return RoleSignals(
        count=len(instances),
        queued_prefill_tokens=sum(s.prefill_tokens_queued for s in scheds),
        num_running=sum(s.num_running for s in scheds),
        num_waiting=sum(s.num_waiting for s in scheds),
        kv_usage=sum(usages) / len(usages) if usages else 0.0,
        ttft_p90_ms=ttft_p90_ms,
        tpot_p90_ms=tpot_p90_ms,
    )


class Planner:
    """Decides, one step at a time, how many instances each autoscaled role should have."""

    def __init__(
        self, settings: AutoscaleSettings, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.roles = [r for r in AUTOSCALED_ROLES if settings.role(r) is not None]
        self.desired: dict[Role, int] = {}  # per role, as last decided (for metrics)
        self.last_decisions: list[Decision] = []
        self._last_change_s: dict[Role, float] = {}  # per role, clock time of its last change

    def decide(self, signals: dict[Role, RoleSignals]) -> list[Decision]:
        """One decision per autoscaled role. A role missing from `signals` has no live
        instance (it is brought back to its min)."""
        now = self.clock()
        decisions = [self._decide_role(role, signals.get(role), now) for role in self.roles]
        for d in decisions:
            self.desired[d.role] = d.desired
            if d.desired != d.current:
                self._last_change_s[d.role] = now
        self.last_decisions = decisions
        return decisions

    def _decide_role(self, role: Role, s: RoleSignals | None, now: float) -> Decision:
        bounds = self.settings.role(role)
        count = s.count if s else 0
        letter = _LETTERS[role]
        if count < bounds.min:  # regardless of cooldown: the role is short of its floor
            return Decision(role, count, bounds.min, f"{count} {letter} < min {bounds.min}")
        if count > bounds.max:
            return Decision(role, count, bounds.max, f"{count} {letter} > max {bounds.max}")
        assert s is not None  # count >= min >= 1
        measures = self._signals(role, s)
        over = next((m for m in measures if m.value > m.target), None)
        if over:
            reason = f"{over.name} {_fmt(over.value)} > {_fmt(over.target)}"
            return self._step(role, count, count + 1, reason, now)
        busiest = max(measures, key=lambda m: m.value / m.target)
        held = f"{busiest.name} {_fmt(busiest.value)} <= {_fmt(busiest.target)}"
        if count == bounds.min:
            return Decision(role, count, count, f"{held}, at min {bounds.min}")
        return self._scale_down_or_hold(role, count, measures, held, now)

    def _scale_down_or_hold(
        self, role: Role, count: int, measures: list[_Signal], held: str, now: float
    ) -> Decision:
        """One instance fewer when every measure would stay under its scale-down threshold
        (`scale_down_fraction` × target) with that instance gone; `count` is at least 2."""
        fraction = self.settings.scale_down_fraction
        closest = max(measures, key=lambda m: m.after_removal(count) / m.target)
        after, threshold = closest.after_removal(count), fraction * closest.target
        if after >= threshold:
            return Decision(role, count, count, held)
        reason = (
            f"{closest.name} with one {_LETTERS[role]} fewer {_fmt(after)} < {_fmt(threshold)}"
            f" ({fraction:g} × {_fmt(closest.target)})"
        )
        return self._step(role, count, count - 1, reason, now)

    def _step(self, role: Role, count: int, desired: int, reason: str, now: float) -> Decision:
        """A one-instance step to `desired` (never below min: callers check), unless max or
        the cooldown holds it."""
        up = desired > count
        max_count = self.settings.role(role).max
        if desired > max_count:
            return Decision(role, count, count, f"{reason}, but at max {max_count}")
        cooldown_s = (
            self.settings.scale_up_cooldown_s if up else self.settings.scale_down_cooldown_s
        )
        wait_s = self._last_change_s.get(role, -float("inf")) + cooldown_s - now
        if wait_s > 0:
            return Decision(role, count, count, f"{reason}, but cooling down {wait_s:.0f}s")
        return Decision(role, count, desired, reason)

    def _signals(self, role: Role, s: RoleSignals) -> list[_Signal]:
        """The role's load measures against their scale-up targets (latencies when set)."""
        if role == Role.PREFILL:
            p = self.settings.prefill
            per_p = s.queued_prefill_tokens / s.count
            target = p.target_queued_prefill_tokens
            measures = [_Signal("queued prefill tokens per P", per_p, target, True)]
            latencies = [("TTFT p90 ms", s.ttft_p90_ms, p.target_ttft_p90_ms)]
        else:
            d = self.settings.decode
            measures = [
                _Signal("KV usage per D", s.kv_usage, d.target_kv_usage, True),
                _Signal(
                    "running sequences per D",
                    s.num_running / s.count,
                    d.target_running_per_instance,
                    True,
                ),
            ]
            latencies = [("TPOT p90 ms", s.tpot_p90_ms, d.target_tpot_p90_ms)]
        measures += [
            _Signal(name, value, target, False)
            for name, value, target in latencies
            if value is not None and target is not None
        ]
        return measures


def _fmt(x: float) -> str:
    """A value for a reason: whole numbers from 10 up, two decimals below."""
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.2f}"
