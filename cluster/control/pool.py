"""PoolController: one instance pool's membership, and the only thing that changes it.

A named actor (`<pool>-controller`) on the control plane only: gateway replicas read its
membership when they start and poll it for instances that join or leave; no request ever
calls it. It launches the pool, adds instances of a role and drains them away at run time
(`scale`), and runs the autoscaling planner when the config has an `autoscale:` section.

Every instance is a detached, restartable actor (Ray restarts one whose process died, under
its name), so the pool survives a restart of its controller (membership is kept in Ray's
GCS key-value store too), and an instance whose resources are not free is a pending actor
whose demand makes Ray's autoscaler add a node. Instances are not put in placement groups:
Ray kills an actor with its group and cannot restart it there. Removal
drains: the instance stops being offered new requests, finishes what it holds (including KV
held for a D until acked or leased), then leaves the membership and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from typing import Any

import ray
from ray.experimental import internal_kv

from pdcluster.actors.instance import InstanceActor, InstanceSpec
from pdcluster.actors.kv_pool import KVPoolActor, kv_pool_actor_name, kv_pool_capacity_bytes
from pdcluster.cluster.config import ROLES, ClusterConfig
from pdcluster.cluster.control.planner import Planner, signals_from_stats

logger = logging.getLogger(__name__)
HEAD_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource

READY_TIMEOUT_S = 300.0  # the longest wait for the next new instance: placement, model load
SERVING_ROLES = ("prefill", "decode", "mixed")
STATS_TIMEOUT_S = 5.0  # a planner round's stats call per instance
LATENCY_FRESH_S = 30.0  # replicas report every few seconds; older reports are dropped


class PlacementTimeout(RuntimeError):
    """New instances found no room (no node had their resources free) in time."""


class PoolController:
    """Wrap with `ray.remote(PoolController)`, named `<pool>-controller`."""

    def __init__(self, pool: str, config: dict[str, Any], model: str) -> None:
        self.pool = pool
        self.config = ClusterConfig.model_validate(config)
        self.model = model
        namespace = ray.get_runtime_context().namespace
        self._key = f"pdcluster/{namespace}/{pool}/members".encode()
        raw = internal_kv._internal_kv_get(self._key)
        self._members: dict[str, str] = json.loads(raw) if raw else {}
        self._handles: dict[str, ray.actor.ActorHandle] = {}  # instance id -> its actor
        self._next_index: Counter[str] = Counter()
        for iid, role in self._members.items():
            index = int(iid.rsplit("-", 1)[1])
            self._next_index[role] = max(self._next_index[role], index + 1)
        self._lock: asyncio.Lock | None = None
        self._started: asyncio.Task | None = None
        self._planner = Planner(self.config.autoscale) if self.config.autoscale else None
        self._planner_task: asyncio.Task | None = None
        self.decisions: Counter[tuple[str, str]] = Counter()  # (role, up|down) -> count
        self._round_s: float | None = None  # the planner's last round: stats and decisions
        self._last_up = 0.0  # when a new instance last answered (bounds the wait for more)
        # gateway replica -> (when, TTFT p90 ms, TPOT p90 ms) it last reported
        self._latencies: dict[str, tuple[float, float | None, float | None]] = {}
        self._kv_pool = self._start_kv_pool()

    def _start_kv_pool(self) -> ray.actor.ActorHandle | None:
        """The cluster KV pool's owner (None when its size is 0): detached like the
        instances, so that it outlives any one of them; it ends with the pool. On the head,
        as this controller is: on a worker it would die with that worker's node (then its
        entries are lost; readers recompute), and Ray restarts it empty wherever it dies."""
        size_gib = self.config.connector.kv_pool_size_gib
        if size_gib == 0:
            return None
        capacity = kv_pool_capacity_bytes(size_gib)
        return (
            ray.remote(KVPoolActor)
            .options(
                name=kv_pool_actor_name(self.pool), get_if_exists=True, num_cpus=0,
                max_concurrency=1000, lifetime="detached", max_restarts=-1,
                resources={HEAD_RESOURCE: 0.001},
            )
            .remote(capacity, self.config.connector.kv_load_timeout_s)
        )  # fmt: skip

    # ---- membership (read by every gateway replica) ------------------------------------
    async def start(self) -> dict[str, str]:
        """Launch the pool's configured instances, once (every caller waits for that one
        launch); then the members."""
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._launch())
        await asyncio.shield(self._started)
        self._ensure_planner()
        return dict(self._members)

    async def members(self) -> dict[str, str]:
        """instance id (its actor name) -> role."""
        self._ensure_planner()  # also after a restart of this actor
        return dict(self._members)

    async def planner_state(self) -> dict[str, Any]:
        """Desired count per role (the planner's, else the actual), decisions made, and how
        long the planner's last round took to read the stats and decide (None: none yet)."""
        actual = Counter(self._members.values())
        desired = dict(actual)
        if self._planner is not None:
            desired.update(self._planner.desired)
        return {
            "desired": {r: desired.get(r, 0) for r in ROLES},
            "decisions": [[r, d, n] for (r, d), n in self.decisions.items()],
            "round_s": self._round_s,
        }

    async def report_latency(
        self, replica_id: str, ttft_p90_ms: float | None, tpot_p90_ms: float | None
    ) -> None:
        """A gateway replica's recent latencies, for the planner's latency targets."""
        self._latencies[replica_id] = (time.monotonic(), ttft_p90_ms, tpot_p90_ms)

    def _latency_p90s(self) -> tuple[float | None, float | None]:
        """The worst p90s that replicas reported lately (a replica that stopped reporting
        is gone)."""
        since = time.monotonic() - LATENCY_FRESH_S
        fresh = [v for t, *v in self._latencies.values() if t >= since]
        ttft = [v[0] for v in fresh if v[0] is not None]
        tpot = [v[1] for v in fresh if v[1] is not None]
        return max(ttft, default=None), max(tpot, default=None)

    # ---- scaling -----------------------------------------------------------------------
    async def scale(self, role: str, count: int) -> dict[str, str]:
        """Add instances of `role`, or drain the newest ones, until it has `count`; returns
        the members. Raises ValueError for a count that would leave nothing to serve."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if not 0 <= count <= 64:
            raise ValueError(f"count must be in [0, 64], got {count}")
        async with self._get_lock():
            current = sorted(
                (i for i, r in self._members.items() if r == role), key=_index, reverse=True
            )
            others = sum(1 for r in self._members.values() if r in SERVING_ROLES and r != role)
            if role in SERVING_ROLES and count == 0 and others == 0:
                raise ValueError(f"removing the last {role} instance leaves none to serve")
            if count > len(current):
                await self._add(role, count - len(current))
            for iid in current[: max(0, len(current) - count)]:
                await self._remove(iid)
            return dict(self._members)

    async def shutdown(self) -> None:
        """End the pool: every instance and the persisted membership."""
        for task in (self._planner_task, self._started):
            if task is not None:
                task.cancel()
        handles = [self._actor(iid) for iid in self._members]
        with contextlib.suppress(ray.exceptions.RayError, asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(h.shutdown.remote() for h in handles if h)), 30)
        for iid in list(self._members):
            self._kill(iid)
        self._members = {}
        internal_kv._internal_kv_del(self._key)
        if self._kv_pool is not None:
            ray.kill(self._kv_pool, no_restart=True)

    async def _launch(self) -> None:
        if self._members:  # a restarted controller: the pool is up already
            return
        async with self._get_lock():
            roles = [r for r in ROLES for _ in range(self.config.role(r).count)]
            await asyncio.gather(*(self._add(r, 1) for r in roles))
        logger.info("pool %s is up: %s", self.pool, self.config.topology_name())

    async def _add(self, role: str, count: int) -> None:
        """Start `count` instances of `role` and admit them once they answer."""
        started = []
        self._last_up = time.monotonic()
        for _ in range(count):
            iid = f"{self.pool}-{role}-{self._next_index[role]}"
            self._next_index[role] += 1
            handle = self._handles[iid] = self._start(role, iid)
            started.append((iid, handle))
        try:
            await self._until_up([h for _, h in started])
        except asyncio.TimeoutError:
            for iid, _ in started:
                self._kill(iid)
            raise PlacementTimeout(
                f"{count} more {role} instance(s) did not come up: no new instance of the "
                f"pool answered for {READY_TIMEOUT_S:.0f} s; each needs {self._demand(role)}; "
                f"free now: {_free_resources()} (add nodes, let an autoscaler add them, or ask "
                "for fewer resources per instance)"
            ) from None
        except BaseException:
            for iid, _ in started:
                self._kill(iid)
            raise
        for iid, _ in started:
            self._members[iid] = role
            logger.info("instance %s (%s) joined pool %s", iid, role, self.pool)
        self._save()

    async def _until_up(self, handles: list[ray.actor.ActorHandle]) -> None:
        """Wait until every one of `handles` answers. asyncio.TimeoutError once READY_TIMEOUT_S
        passed with no new instance of the pool answering: many instances on a small host
        start a few at a time (each imports torch and Ray), so what is bounded is the wait
        for progress, not the whole launch."""
        pending = {asyncio.ensure_future(self._health(h)) for h in handles}
        try:
            while pending:
                left_s = self._last_up + READY_TIMEOUT_S - time.monotonic()
                if left_s <= 0:
                    raise asyncio.TimeoutError
                done, pending = await asyncio.wait(pending, timeout=left_s)
                for task in done:
                    task.result()  # an instance that failed to start fails the launch
        finally:
            for task in pending:
                task.cancel()

    async def _health(self, handle: ray.actor.ActorHandle) -> None:
        await handle.health.remote()
        self._last_up = time.monotonic()

    def _demand(self, role: str) -> dict[str, float]:
        """The resources one instance of `role` asks Ray for."""
        spec = self.config.role(role)
        demand = {"CPU": spec.num_cpus, "GPU": spec.num_gpus, **spec.resources}
        return {k: v for k, v in demand.items() if v}

    def _start(self, role: str, iid: str) -> ray.actor.ActorHandle:
        spec = self.config.role(role)
        instance = InstanceSpec(
            instance_id=iid,
            role=role,
            engine=self.config.engine_config(role, self.model),
            model_name=self.config.served_model_name(self.model),
            kv_lease_s=self.config.connector.kv_lease_s,
            kv_load_timeout_s=self.config.connector.kv_load_timeout_s,
            kv_pool=None if self._kv_pool is None else kv_pool_actor_name(self.pool),
            ec_timeout_s=self.config.connector.ec_timeout_s,
            stream_idle_timeout_s=self.config.router.stream_idle_timeout_s,
        )
        return (
            ray.remote(InstanceActor)
            .options(
                name=iid,
                num_cpus=spec.num_cpus,
                num_gpus=spec.num_gpus,
                resources=dict(spec.resources),
                max_concurrency=100_000,
                max_restarts=3,
                lifetime="detached",  # fate-shares with no process: the pool outlives them
            )
            .remote(instance)
        )

    async def _remove(self, iid: str) -> None:
        """Drain an instance, then take it out of the pool and end it."""
        handle = self._actor(iid)
        if handle is not None:
            with contextlib.suppress(ray.exceptions.RayError):
                timeout_s = getattr(self.config, self._members[iid]).drain_timeout_s
                if not await handle.drain.remote(timeout_s):
                    logger.warning("instance %s did not drain in time; removing it", iid)
        self._members.pop(iid, None)
        self._save()
        self._kill(iid)
        logger.info("instance %s left pool %s", iid, self.pool)

    # ---- planner -----------------------------------------------------------------------
    def _ensure_planner(self) -> None:
        if self._planner is not None and self._planner_task is None and self._members:
            self._planner_task = asyncio.get_running_loop().create_task(self._plan_loop())

    async def _plan_loop(self) -> None:
        interval_s = self.config.autoscale.interval_s
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._plan_once()
            except Exception:  # noqa: BLE001 - a failed round must not stop the planner
                logger.exception("planner round failed")

    async def _plan_once(self) -> None:
        started = time.monotonic()
        stats = await self._stats()
        decisions = self._planner.decide(signals_from_stats(stats, *self._latency_p90s()))
        self._round_s = time.monotonic() - started  # reading and deciding, not scaling
        for decision in decisions:
            if decision.desired == decision.current:
                continue
            direction = "up" if decision.desired > decision.current else "down"
            logger.info(
                "planner: %s %d -> %d (%s)",
                decision.role, decision.current, decision.desired, decision.reason,
            )  # fmt: skip
            self.decisions[(decision.role, direction)] += 1
            await self.scale(decision.role, decision.desired)

    async def _stats(self) -> list[dict[str, Any]]:
        """Every member's stats, asked of all at once (a round costs one call's time, not
        one per instance); one that fails or is slower than STATS_TIMEOUT_S is unhealthy."""
        members = list(self._members.items())
        return list(await asyncio.gather(*(self._instance_stats(i, r) for i, r in members)))

    async def _instance_stats(self, iid: str, role: str) -> dict[str, Any]:
        handle = self._actor(iid)
        try:
            stats = await asyncio.wait_for(handle.stats.remote(), STATS_TIMEOUT_S) if handle else {}
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            return {"id": iid, "role": role, "healthy": False}
        return {**stats, "role": role, "healthy": bool(stats)}

    # ---- helpers -----------------------------------------------------------------------
    def _actor(self, instance_id: str) -> ray.actor.ActorHandle | None:
        """The instance's handle: the one this controller made it with, else by name (a
        restarted controller's pool)."""
        handle = self._handles.get(instance_id)
        if handle is None:
            with contextlib.suppress(ValueError):  # gone
                handle = self._handles[instance_id] = ray.get_actor(instance_id)
        return handle

    def _kill(self, instance_id: str) -> None:
        handle = self._actor(instance_id)
        self._handles.pop(instance_id, None)
        if handle is not None:
            ray.kill(handle, no_restart=True)

    def _get_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def _save(self) -> None:
        internal_kv._internal_kv_put(self._key, json.dumps(self._members).encode())


def _index(instance_id: str) -> int:
    return int(instance_id.rsplit("-", 1)[1])


def _free_resources() -> dict[str, float]:
    free = ray.available_resources()
    return {k: round(v, 2) for k, v in free.items() if k in ("CPU", "GPU") or "pdcluster" in k}
