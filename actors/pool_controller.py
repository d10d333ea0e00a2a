"""PoolController: one instance pool's membership, and the only thing that changes it.

A named actor (`<pool>-controller`) on the control plane only: gateway replicas read its
membership when they start and then wait on it (a long-poll) for instances that join or
leave; no request ever calls it. It launches the pool, adds instances of a role and drains them away at run time
(`scale`), and runs the autoscaling planner when the config has an `autoscale:` section.
What to launch, how to size it and what the planner decides are the pool's plan
(cluster/control/pool.py, plain Python); this actor carries them out with Ray.

Every instance is a detached, restartable actor (Ray restarts one whose process died, under
its name), so the pool survives a restart of its controller (the membership is kept by a
named actor of its own, actors/pool_members.py), and an instance whose resources are not
free is a pending actor whose demand makes Ray's autoscaler add a node. Instances are not
put in placement groups: Ray kills an actor with its group and cannot restart it there.
Removal drains: the instance stops being offered new requests, finishes what it holds
(including KV held for a D until acked or leased), then leaves the membership and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

import ray

from pdcluster.actors.encoder_instance import EncoderInstanceActor
from pdcluster.actors.instance import InstanceActor
from pdcluster.actors.kv_pool import KVPoolActor, kv_pool_actor_name, kv_pool_capacity_bytes
from pdcluster.actors.messages import InstanceStats
from pdcluster.actors.pool_adapters import load_adapters, unload_adapter
from pdcluster.actors.pool_members import PoolMembers, members_actor_name
from pdcluster.actors.pool_messages import MemberList, PlannerState
from pdcluster.connectors.base import new_epoch
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.routing.role import Role

if TYPE_CHECKING:  # built by the launcher above this layer and handed in
    from pdcluster.cluster.control.pool import PoolPlan

logger = logging.getLogger(__name__)
HEAD_RESOURCE = "node:__internal_head__"  # Ray gives the head node this resource
ON_HEAD = {HEAD_RESOURCE: 0.001}  # never on a worker an autoscaler may remove
STATS_TIMEOUT_S = 5.0  # a planner round's stats call per instance


class PlacementTimeout(TimeoutError):
    """New instances found no room (no node had their resources free) in time."""


class PoolController:
    """Wrap with `ray.remote(PoolController)`, named `<pool>-controller`."""

    def __init__(self, plan: PoolPlan) -> None:
        self.plan = plan
        self.pool = plan.pool
        self._store = (
            ray.remote(PoolMembers)
            .options(
                name=members_actor_name(self.pool), get_if_exists=True, num_cpus=0,
                lifetime="detached", max_restarts=-1, max_task_retries=-1, resources=ON_HEAD,
            )
            .remote()
        )  # fmt: skip
        self._members: dict[str, Role] = {}  # read from the store before first use
        self._adapters: dict[str, LoRARequest] = {}  # LoRA adapters served, likewise
        self._loaded = False
        self._epoch = new_epoch()  # this incarnation's: see MemberList
        self._version = 0
        self._changed: asyncio.Event | None = None  # set (and replaced) at every change
        self._handles: dict[str, ray.actor.ActorHandle] = {}  # instance id -> its actor
        self._next_index: Counter[Role] = Counter()
        self._lock: asyncio.Lock | None = None
        self._started: asyncio.Task | None = None
        self._planner_task: asyncio.Task | None = None
        self.decisions: Counter[tuple[Role, str]] = Counter()  # (role, up|down) -> count
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
        size_gib = self.plan.kv_pool_size_gib
        if size_gib == 0:
            return None
        capacity = kv_pool_capacity_bytes(size_gib)
        return (
            ray.remote(KVPoolActor)
            .options(
                name=kv_pool_actor_name(self.pool), get_if_exists=True, num_cpus=0,
                max_concurrency=1000, lifetime="detached", max_restarts=-1, resources=ON_HEAD,
            )
            .remote(capacity, self.plan.kv_load_timeout_s)
        )  # fmt: skip

    # ---- membership (read by every gateway replica) ------------------------------------
    async def start(self) -> dict[str, Role]:
        """Launch the pool's configured instances, once (every caller waits for that one
        launch); then the members."""
        await self._load()
        if self._started is None:
            self._started = asyncio.get_running_loop().create_task(self._launch())
        await asyncio.shield(self._started)
        self._ensure_planner()
        return dict(self._members)

    async def members(self) -> dict[str, Role]:
        """instance id (its actor name) -> role."""
        return (await self.members_after(None, -1, 0.0)).members

    async def members_after(self, epoch: str | None, version: int, wait_s: float) -> MemberList:
        """The membership once it is not (`epoch`, `version`), a reader's last answer, or
        after `wait_s` seconds if it stays so: a replica with nothing new to hear makes one
        call per `wait_s`."""
        await self._load()
        self._ensure_planner()  # also after a restart of this actor
        if (epoch, version) == (self._epoch, self._version) and wait_s > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed_event().wait(), wait_s)
        return MemberList(self._epoch, self._version, dict(self._members), dict(self._adapters))

    async def planner_state(self) -> PlannerState:
        """See `PoolPlan.planner_state`."""
        await self._load()
        return self.plan.planner_state(self._members, self.decisions, self._round_s)

    async def report_latency(
        self, replica_id: str, ttft_p90_ms: float | None, tpot_p90_ms: float | None
    ) -> None:
        """A gateway replica's recent latencies, for the planner's latency targets."""
        self._latencies[replica_id] = (time.monotonic(), ttft_p90_ms, tpot_p90_ms)

    # ---- scaling -----------------------------------------------------------------------
    async def scale(self, role: Role, count: int) -> dict[str, Role]:
        """Add instances of `role`, or drain the newest ones, until it has `count`; returns
        the members. Raises ValueError for a count that would leave nothing to serve."""
        await self._load()
        self.plan.check_scale(role, count, self._members)
        async with self._get_lock():
            self.plan.check_scale(role, count, self._members)  # members may have changed
            current = self.plan.newest_first(role, self._members)
            if count > len(current):
                await self._add(role, count - len(current))
            for iid in current[: max(0, len(current) - count)]:
                await self._remove(iid)
            return dict(self._members)

    async def shutdown(self) -> None:
        """End the pool: every instance, the KV pool and the kept membership."""
        await self._load()
        for task in (self._planner_task, self._started):
            if task is not None:
                task.cancel()
        handles = [self._actor(iid) for iid in self._members]
        with contextlib.suppress(ray.exceptions.RayError, asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(h.shutdown.remote() for h in handles if h)), 30)
        for iid in list(self._members):
            self._kill(iid)
        self._members = {}
        ray.kill(self._store, no_restart=True)
        if self._kv_pool is not None:
            ray.kill(self._kv_pool, no_restart=True)

    async def _launch(self) -> None:
        if self._members:  # a restarted controller: the pool is up already
            return
        async with self._get_lock():
            await asyncio.gather(*(self._add(r, 1) for r in self.plan.initial_roles()))
        logger.info("pool %s is up: %s", self.pool, self.plan.config.topology_name())

    async def _add(self, role: Role, count: int) -> None:
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
            if role != Role.ENCODER:  # it serves the pool's adapters from its first request
                await load_adapters(started, list(self._adapters.values()))
        except asyncio.TimeoutError:
            for iid, _ in started:
                self._kill(iid)
            raise self.plan.placement_timeout(role, count, _free_resources()) from None
        except BaseException:
            for iid, _ in started:
                self._kill(iid)
            raise
        for iid, _ in started:
            self._members[iid] = role
            logger.info("instance %s (%s) joined pool %s", iid, role, self.pool)
        await self._save()

    async def _until_up(self, handles: list[ray.actor.ActorHandle]) -> None:
        """Wait until every one of `handles` answers. asyncio.TimeoutError once the ready
        timeout passed with no new instance of the pool answering: many instances on a small
        host start a few at a time (each imports torch and Ray), so what is bounded is the
        wait for progress, not the whole launch."""
        pending = {asyncio.ensure_future(self._health(h)) for h in handles}
        try:
            while pending:
                left_s = self._last_up + self.plan.ready_timeout_s - time.monotonic()
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

    def _start(self, role: Role, iid: str) -> ray.actor.ActorHandle:
        kv_pool = None if self._kv_pool is None else kv_pool_actor_name(self.pool)
        return (
            ray.remote(EncoderInstanceActor if role == Role.ENCODER else InstanceActor)
            .options(
                name=iid,
                **self.plan.resources(role),
                max_concurrency=100_000,
                max_restarts=3,
                lifetime="detached",  # fate-shares with no process: the pool outlives them
            )
            .remote(self.plan.instance_spec(role, iid, kv_pool))
        )

    async def _remove(self, iid: str) -> None:
        """Drain an instance, then take it out of the pool and end it."""
        handle = self._actor(iid)
        if handle is not None:
            with contextlib.suppress(ray.exceptions.RayError):
                timeout_s = self.plan.drain_timeout_s(self._members[iid])
                if not await handle.drain.remote(timeout_s):
                    logger.warning("instance %s did not drain in time; removing it", iid)
        self._members.pop(iid, None)
        await self._save()
        self._kill(iid)
        logger.info("instance %s left pool %s", iid, self.pool)

    # ---- LoRA adapters (gateway replicas load and unload them for clients) -------------
    async def load_lora_adapter(self, lora: LoRARequest) -> dict[str, LoRARequest]:
        """Load an adapter on every instance that runs requests (and on each that joins
        later); the adapters served. ValueError, with no instance keeping it, when the name
        is taken or an instance cannot serve it (a bad folder, another base model)."""
        await self._load()
        async with self._get_lock():
            if lora.name in self._adapters:
                raise ValueError(f"LoRA adapter {lora.name!r} is already loaded")
            runners = self._runners()
            try:
                await load_adapters(runners, [lora])
            except ValueError:
                await unload_adapter(runners, lora.name)
                raise
            self._adapters[lora.name] = lora
            await self._save()
            logger.info("LoRA adapter %s loaded from %s", lora.name, lora.path)
            return dict(self._adapters)

    async def unload_lora_adapter(self, name: str) -> dict[str, LoRARequest]:
        """Stop serving an adapter (requests running on it finish); the adapters served.
        LookupError when it is not loaded."""
        await self._load()
        async with self._get_lock():
            if name not in self._adapters:
                raise LookupError(f"LoRA adapter {name!r} is not loaded")
            del self._adapters[name]
            await self._save()
            await unload_adapter(self._runners(), name)
            logger.info("LoRA adapter %s unloaded", name)
            return dict(self._adapters)

    def _runners(self) -> list[tuple[str, ray.actor.ActorHandle]]:
        """(id, actor) of every member that runs requests (not an encoder)."""
        handles = ((iid, self._actor(iid)) for iid, r in self._members.items() if r != Role.ENCODER)
        return [(iid, h) for iid, h in handles if h is not None]

    # ---- planner -----------------------------------------------------------------------
    def _ensure_planner(self) -> None:
        plan = self.plan
        if plan.planner is not None and self._planner_task is None and self._members:
            self._planner_task = asyncio.get_running_loop().create_task(self._plan_loop())

    async def _plan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.plan.planner_interval_s)
            try:
                await self._plan_once()
            except Exception:  # noqa: BLE001 - a failed round must not stop the planner
                logger.exception("planner round failed")

    async def _plan_once(self) -> None:
        started = time.monotonic()
        stats = await self._stats()
        decisions = self.plan.decide(stats, self._latencies, time.monotonic())
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

    async def _stats(self) -> list[InstanceStats]:
        """Every member's stats, asked of all at once (a round costs one call's time, not
        one per instance); one that fails or is slower than STATS_TIMEOUT_S is unhealthy."""
        members = list(self._members.items())
        return list(await asyncio.gather(*(self._instance_stats(i, r) for i, r in members)))

    async def _instance_stats(self, iid: str, role: Role) -> InstanceStats:
        handle = self._actor(iid)
        if handle is None:
            return InstanceStats.unreachable(iid, role)
        try:
            return await asyncio.wait_for(handle.stats.remote(), STATS_TIMEOUT_S)
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            return InstanceStats.unreachable(iid, role)

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

    async def _load(self) -> None:
        """The membership a previous incarnation of this controller kept (none for a new
        pool), read once, before anything reads or changes it."""
        if not self._loaded:
            self._members = await self._store.get.remote()
            kept = await self._store.get_adapters.remote()
            self._adapters = self.plan.lora_adapters() if kept is None else kept
            self._next_index = self.plan.next_indices(self._members)
            self._loaded = True

    def _changed_event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    async def _save(self) -> None:
        """Wake the replicas waiting on the membership (it changed), and keep it in its own
        actor (for a restarted controller). A failed write is logged: this controller still
        holds the membership, and writes it whole at the next change."""
        self._version += 1
        self._changed_event().set()
        self._changed = None
        try:
            await self._store.put.remote(dict(self._members))
            await self._store.put_adapters.remote(dict(self._adapters))
        except ray.exceptions.RayError as exc:
            logger.warning("pool %s: membership not kept (%s)", self.pool, exc)


def _free_resources() -> dict[str, float]:
    free = ray.available_resources()
    return {k: round(v, 2) for k, v in free.items() if k in ("CPU", "GPU") or "pdcluster" in k}
