"""An instance pool's plain-Python decisions: what to launch, how each instance is specified
and sized, which scale requests are allowed, how long a launch may wait, and what the
autoscaling planner decides. No Ray calls: the pool controller actor
(actors/pool_controller.py) carries these out, and tests check them without Ray.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from pdcluster.actors.instance_base import InstanceSpec
from pdcluster.actors.messages import InstanceStats
from pdcluster.actors.pool_controller import PlacementTimeout
from pdcluster.actors.pool_messages import PlannerState, ScalingCount
from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.control.planner import Decision, Planner, signals_from_stats
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.routing.role import Role

READY_TIMEOUT_S = 300.0  # the longest wait for the next new instance: placement, model load
SERVING_ROLES = (Role.PREFILL, Role.DECODE, Role.MIXED)
LATENCY_FRESH_S = 30.0  # replicas report every few seconds; older reports are dropped
MAX_COUNT = 64  # instances of one role that `scale` accepts


def controller_name(pool: str) -> str:
    """The pool controller's actor name: gateway replicas and the CLI find the pool by it."""
    return f"{pool}-controller"


def instance_index(instance_id: str) -> int:
    """The index in `<pool>-<role>-<index>`."""
    return int(instance_id.rsplit("-", 1)[1])


def next_indices(members: dict[str, Role]) -> Counter[Role]:
    """Per role, the first index no member uses (a restarted controller never reuses one)."""
    indices: Counter[Role] = Counter()
    for iid, role in members.items():
        indices[role] = max(indices[role], instance_index(iid) + 1)
    return indices


def latency_p90s(
    reports: dict[str, tuple[float, float | None, float | None]], now: float
) -> tuple[float | None, float | None]:
    """The worst (TTFT, TPOT) p90s of the replicas' reports {replica: (when, ttft, tpot)}
    made within LATENCY_FRESH_S of `now` (a replica that stopped reporting is gone)."""
    fresh = [v for t, *v in reports.values() if t >= now - LATENCY_FRESH_S]
    ttft = [v[0] for v in fresh if v[0] is not None]
    tpot = [v[1] for v in fresh if v[1] is not None]
    return max(ttft, default=None), max(tpot, default=None)


class PoolPlan:
    """What the pool controller needs of a pool's config: built by the launcher, handed to
    the controller actor (and so pickled), and holding the planner's state there."""

    def __init__(self, pool: str, config: ClusterConfig, model: str) -> None:
        self.pool = pool
        self.config = config
        self.model = model
        self.planner = Planner(config.autoscale) if config.autoscale else None
        self.ready_timeout_s = READY_TIMEOUT_S

    next_indices = staticmethod(next_indices)

    @staticmethod
    def newest_first(role: Role, members: dict[str, Role]) -> list[str]:
        """The members of `role`, the newest (highest index) first: the first to drain."""
        ids = (i for i, r in members.items() if r == role)
        return sorted(ids, key=instance_index, reverse=True)

    @property
    def kv_pool_size_gib(self) -> float | None:
        """The cluster KV pool's size; 0: no pool, None: a share of the object store."""
        return self.config.connector.kv_pool_size_gib

    @property
    def kv_load_timeout_s(self) -> float:
        return self.config.connector.kv_load_timeout_s

    @property
    def planner_interval_s(self) -> float:
        return self.config.autoscale.interval_s

    def lora_adapters(self) -> dict[str, LoRARequest]:
        """The LoRA adapters served from the start (the config's lora_modules)."""
        return self.config.lora.adapters()

    def initial_roles(self) -> list[Role]:
        """One entry per instance the topology starts with."""
        return [r for r in Role for _ in range(self.config.role(r).count)]

    def instance_spec(self, role: Role, instance_id: str, kv_pool: str | None) -> InstanceSpec:
        c = self.config
        return InstanceSpec(
            instance_id=instance_id,
            role=role,
            engine=c.engine_config(role, self.model),
            model_name=c.served_model_name(self.model),
            kv_lease_s=c.connector.kv_lease_s,
            kv_load_timeout_s=c.connector.kv_load_timeout_s,
            kv_pool=kv_pool,
            ec_timeout_s=c.connector.ec_timeout_s,
            stream_idle_timeout_s=c.router.stream_idle_timeout_s,
        )

    def resources(self, role: Role) -> dict[str, Any]:
        """Ray's resource options for one instance of `role`."""
        spec = self.config.role(role)
        return {
            "num_cpus": spec.num_cpus,
            "num_gpus": spec.num_gpus,
            "resources": dict(spec.resources),
        }

    def demand(self, role: Role) -> dict[str, float]:
        """The resources one instance of `role` asks Ray for (zeros left out)."""
        spec = self.config.role(role)
        demand = {"CPU": spec.num_cpus, "GPU": spec.num_gpus, **spec.resources}
        return {k: v for k, v in demand.items() if v}

    def drain_timeout_s(self, role: Role) -> float:
        return self.config.role(role).drain_timeout_s

    def check_scale(self, role: Role, count: int, members: dict[str, Role]) -> None:
        """ValueError for a scale request that cannot be: a count out of range, or one that
        leaves no instance to serve."""
        if not 0 <= count <= MAX_COUNT:
            raise ValueError(f"count must be in [0, {MAX_COUNT}], got {count}")
        others = sum(1 for r in members.values() if r in SERVING_ROLES and r != role)
        if role in SERVING_ROLES and count == 0 and others == 0:
            raise ValueError(f"removing the last {role} instance leaves none to serve")

    def placement_timeout(self, role: Role, count: int, free: dict[str, float]) -> PlacementTimeout:
        return PlacementTimeout(
            f"{count} more {role} instance(s) did not come up: no new instance of the "
            f"pool answered for {self.ready_timeout_s:.0f} s; each needs {self.demand(role)}; "
            f"free now: {free} (add nodes, let an autoscaler add them, or ask "
            "for fewer resources per instance)"
        )

    def decide(
        self,
        stats: list[InstanceStats],
        latencies: dict[str, tuple[float, float | None, float | None]],
        now: float,
    ) -> list[Decision]:
        """The planner's decisions for one round (only when the config autoscales), from
        the instances' stats and the replicas' latency reports (see `latency_p90s`)."""
        return self.planner.decide(signals_from_stats(stats, *latency_p90s(latencies, now)))

    def planner_state(
        self,
        members: dict[str, Role],
        decisions: Counter[tuple[Role, str]],
        round_s: float | None,
    ) -> PlannerState:
        """Desired count per role (the planner's, else the actual), decisions made
        ({(role, direction): count}), and how long the planner's last round took."""
        desired = dict(Counter(members.values()))
        if self.planner is not None:
            desired.update(self.planner.desired)
        return PlannerState(
            desired={r: desired.get(r, 0) for r in Role},
            decisions=tuple(ScalingCount(r, d, n) for (r, d), n in decisions.items()),
            round_s=round_s,
        )


def topology_demand(config: ClusterConfig) -> dict[str, float]:
    """The resources every instance of the topology asks Ray for, together (zeros left out)."""
    total: Counter[str] = Counter()
    for role in _roles(config):
        spec = config.role(role)
        one = {"CPU": spec.num_cpus, "GPU": spec.num_gpus, **spec.resources}
        for key, amount in one.items():
            total[key] += spec.count * amount
    return {k: round(v, 3) for k, v in total.items() if v}


def _roles(config: ClusterConfig) -> list[Role]:
    return [r for r in Role if config.role(r).count]


def embedded_ray_cpus(config: ClusterConfig, cores: int) -> int:
    """The logical CPUs an embedded Ray gets: the machine's cores, or as many as the
    topology reserves when that is more (as the built-in YAML configs set `ray.num_cpus`).
    Instances share the cores then; what Ray's CPU count bounds is only placement."""
    return max(cores, math.ceil(topology_demand(config).get("CPU", 0.0)))


def unplaceable(demand: dict[str, float], have: dict[str, float]) -> dict[str, float]:
    """The resources of `demand` that `have` lacks (an empty dict: it fits)."""
    return {k: v for k, v in demand.items() if v > have.get(k, 0.0) + 1e-9}
