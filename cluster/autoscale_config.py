"""Autoscaling settings: bounds and SLO targets of prefill and decode, each scaled on its own."""

from __future__ import annotations

from pydantic import Field, model_validator

from pdcluster.cluster.config_yaml import StrictSection
from pdcluster.routing.role import Role

AUTOSCALED_ROLES = (Role.PREFILL, Role.DECODE)


class _RoleAutoscale(StrictSection):
    """Bounds of one autoscaled role; the planner steps its count by one inside them."""

    min: int = Field(1, ge=1, le=64, description="instances of the role at least")
    max: int = Field(..., ge=1, le=64, description="instances of the role at most")

    @model_validator(mode="after")
    def _check_bounds(self) -> _RoleAutoscale:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        return self


class PrefillAutoscale(_RoleAutoscale):
    target_queued_prefill_tokens: int = Field(
        2048, ge=1, description="add a P when queued prefill tokens per P exceed this"
    )
    target_ttft_p90_ms: float | None = Field(
        None, gt=0, description="add a P when TTFT p90 exceeds this (None: ignore TTFT)"
    )


class DecodeAutoscale(_RoleAutoscale):
    target_kv_usage: float = Field(
        0.8, gt=0, le=1, description="add a D when mean KV-cache usage per D exceeds this"
    )
    target_running_per_instance: int = Field(
        48, ge=1, description="add a D when running sequences per D exceed this"
    )
    target_tpot_p90_ms: float | None = Field(
        None, gt=0, description="add a D when TPOT p90 exceeds this (None: ignore TPOT)"
    )


class AutoscaleSettings(StrictSection):
    """SLO-driven autoscaling of prefill and decode, each independently (cluster/control/planner.py).

    A role's configured `count` is its starting size and must lie within its [min, max]."""

    prefill: PrefillAutoscale | None = Field(None, description="scale P (None: fixed count)")
    decode: DecodeAutoscale | None = Field(None, description="scale D (None: fixed count)")
    interval_s: float = Field(10.0, gt=0, description="seconds between two planner decisions")
    scale_up_cooldown_s: float = Field(
        60.0, ge=0, description="no scale-up of a role this soon after its last change"
    )
    scale_down_cooldown_s: float = Field(
        180.0, ge=0, description="no scale-down of a role this soon after its last change"
    )
    scale_down_fraction: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="remove one instance only while every signal would stay under this "
        "fraction of its target with one instance fewer (latency p90s: as they are)",
    )

    @model_validator(mode="after")
    def _check_roles(self) -> AutoscaleSettings:
        if self.prefill is None and self.decode is None:
            raise ValueError("autoscale needs a prefill or decode section")
        return self

    def role(self, role: str) -> PrefillAutoscale | DecodeAutoscale | None:
        return getattr(self, role)
