"""The driver's side of a pool's actors: start or find its controller, ask it for members,
scale and planner state, read the cluster KV pool, and end the pool. Thin wrappers over
Ray calls, so that the gateway replica's client (cluster/client.py) and the launcher make
none themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.actor import ActorHandle

from pdcluster.actors.kv_pool import kv_pool_actor_name
from pdcluster.actors.messages import KVEvents
from pdcluster.actors.pool_controller import ON_HEAD, PlacementTimeout, PoolController
from pdcluster.actors.pool_messages import KVPoolStats, MemberList, PlannerState
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.routing.role import Role

if TYPE_CHECKING:  # built by the launcher above this layer and handed in
    from pdcluster.cluster.control.pool import PoolPlan

END_TIMEOUT_S = 120.0  # the controller's shutdown: drains nothing, ends every instance
ANSWER_TIMEOUT_S = 10.0  # a control-plane call's answer, beyond any wait it was asked for


async def answer_or_none(ref: ray.ObjectRef, timeout_s: float) -> Any:
    """The call's result, or None when it failed or took too long. The ref is dropped before
    the wait: a raised error's traceback would hold it in a reference cycle, keeping its
    object alive until the next garbage collection."""
    future = asyncio.wrap_future(ref.future())
    del ref
    try:
        return await asyncio.wait_for(future, timeout_s)
    except (ray.exceptions.RayError, asyncio.TimeoutError):
        return None


class PoolClient:
    """One process's handle on a pool's controller (`actor`) and its cluster KV pool."""

    def __init__(self, pool: str, actor: ActorHandle) -> None:
        self.pool = pool
        self.actor = actor
        self._kv_pool: ActorHandle | None = None  # found once: it restarts under one handle
        self._kv_pool_lookup: asyncio.Future | None = None  # the lookup under way, if any

    # ---- starting, finding and ending a pool -------------------------------------------
    @classmethod
    def start(cls, plan: PoolPlan, controller: str, detached: bool) -> PoolClient:
        """The pool's controller, started (or found, when another process started it)."""
        actor = (
            ray.remote(PoolController)
            .options(
                name=controller, get_if_exists=True, num_cpus=0, max_restarts=-1,
                max_concurrency=1000, lifetime="detached" if detached else None,
                resources=ON_HEAD,
            )
            .remote(plan)
        )  # fmt: skip
        return cls(plan.pool, actor)

    @classmethod
    def find(cls, pool: str, controller: str, namespace: str | None = None) -> PoolClient | None:
        """The running pool's client; None when no such pool is up."""
        try:
            return cls(pool, ray.get_actor(controller, namespace=namespace))
        except ValueError:
            return None

    def wait_started(self, restart_timeout_s: float) -> dict[str, Role]:
        """The pool's members once it is up (the controller bounds that: it gives up once
        no new instance answered for its ready timeout, however long a large pool takes in
        all); a controller that is restarting is waited for up to `restart_timeout_s`.
        Errors the controller raised (ValueError, PlacementTimeout) are raised as they are."""
        deadline = time.monotonic() + restart_timeout_s
        while True:
            try:
                return ray.get(self.actor.start.remote())
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
            except ray.exceptions.RayTaskError as exc:
                raise _cause(exc) from None

    def end(self, timeout_s: float = END_TIMEOUT_S, quiet: bool = False) -> None:
        """End the pool (its instances, KV pool and membership) and its controller. `quiet`:
        a controller that is gone or failing is simply killed."""
        try:
            ray.get(self.actor.shutdown.remote(), timeout=timeout_s)
        except ray.exceptions.RayError:
            if not quiet:
                raise
        ray.kill(self.actor, no_restart=True)

    # ---- the control plane (never on a request's path) ---------------------------------
    async def members_after(
        self, epoch: str | None, version: int, wait_s: float
    ) -> MemberList | None:
        """See `PoolController.members_after`; None when the controller does not answer."""
        call = self.actor.members_after.remote(epoch, version, wait_s)
        return await answer_or_none(call, wait_s + ANSWER_TIMEOUT_S)

    def report_latency(
        self, replica_id: str, ttft_p90_ms: float | None, tpot_p90_ms: float | None
    ) -> None:
        self.actor.report_latency.remote(replica_id, ttft_p90_ms, tpot_p90_ms)

    async def scale(self, role: Role, count: int) -> dict[str, Role]:
        """See `PoolController.scale`; its ValueError or PlacementTimeout raised as it is."""
        try:
            return await self.actor.scale.remote(role, count)
        except ray.exceptions.RayTaskError as exc:
            raise _cause(exc) from None

    async def load_lora_adapter(self, lora: LoRARequest) -> dict[str, LoRARequest]:
        """See `PoolController.load_lora_adapter`; its ValueError raised as it is."""
        try:
            return await self.actor.load_lora_adapter.remote(lora)
        except ray.exceptions.RayTaskError as exc:
            raise _cause(exc) from None

    async def unload_lora_adapter(self, name: str) -> dict[str, LoRARequest]:
        """See `PoolController.unload_lora_adapter`; its LookupError raised as it is."""
        try:
            return await self.actor.unload_lora_adapter.remote(name)
        except ray.exceptions.RayTaskError as exc:
            raise _cause(exc) from None

    async def planner_state(self) -> PlannerState:
        return await self.actor.planner_state.remote()

    # ---- the cluster KV pool -----------------------------------------------------------
    async def kv_pool_events(
        self, epoch: str | None, cursor: int, wait_s: float
    ) -> KVEvents | None:
        """The cluster KV pool's events after (epoch, cursor), waiting up to `wait_s` for
        one; None when it does not answer."""
        kv_pool = await self._kv_pool_actor_async()
        if kv_pool is None:
            return None
        call = kv_pool.events.remote(epoch, cursor, wait_s)
        events = await answer_or_none(call, wait_s + ANSWER_TIMEOUT_S)
        if events is None:  # gone for good, perhaps: look it up again next time
            self._kv_pool = None
        return events

    async def kv_pool_stats(self, timeout_s: float) -> KVPoolStats | None:
        """The cluster KV pool's stats; None when the pool is off or does not answer within
        `timeout_s`."""
        try:
            kv_pool = await asyncio.wait_for(self._kv_pool_actor_async(), timeout_s)
        except asyncio.TimeoutError:  # the GCS does not answer (the lookup goes on)
            return None
        if kv_pool is None:
            return None
        try:
            return await asyncio.wait_for(kv_pool.stats.remote(), timeout_s)
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            return None

    async def _kv_pool_actor_async(self) -> ActorHandle | None:
        """`_kv_pool_actor` off the event loop when it must look up: a lookup is a call to
        Ray's GCS, which blocks while the GCS is down (every stream of the replica would
        stop with its loop). One lookup at a time; the others wait for its answer."""
        if self._kv_pool is not None:
            return self._kv_pool
        if self._kv_pool_lookup is None or self._kv_pool_lookup.done():
            self._kv_pool_lookup = asyncio.ensure_future(asyncio.to_thread(self._kv_pool_actor))
        return await asyncio.shield(self._kv_pool_lookup)

    def _kv_pool_actor(self) -> ActorHandle | None:
        """The KV pool's actor, looked up until found (a lookup is a call to Ray's GCS);
        None while there is none."""
        if self._kv_pool is None:
            with contextlib.suppress(ValueError):  # off, or not up yet
                self._kv_pool = ray.get_actor(kv_pool_actor_name(self.pool))
        return self._kv_pool


def actor_names(namespace: str) -> list[str]:
    """The named actors alive (or restarting) in `namespace`."""
    actors = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in actors if a["namespace"] == namespace]


def _cause(exc: ray.exceptions.RayTaskError) -> BaseException:
    """The error the controller raised when it is one of the pool's own (a request that
    cannot be, instances with no room), else Ray's."""
    if isinstance(exc.cause, (ValueError, LookupError, PlacementTimeout)):
        return exc.cause
    return exc
