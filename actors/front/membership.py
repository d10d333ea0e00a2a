"""The pool as one gateway replica follows it: instances join and leave at run time (a
joined one is pulled, a left one's requests move), the cluster KV pool's block events feed
routing, and now and then the planner hears this replica's latencies."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable

import ray
from ray.actor import ActorHandle

from pdcluster.actors.front.flights import Flights
from pdcluster.actors.front.instances import Instances
from pdcluster.actors.messages import KVEvents
from pdcluster.routing.role import Role

logger = logging.getLogger(__name__)

MEMBERS_POLL_S = 1.0  # how often the pool's membership is re-read
LATENCY_REPORT_ROUNDS = 5  # membership polls between two latency reports to the planner

Members = Callable[[], dict[str, Role] | None]  # instance id -> role; None: cannot tell
PoolEvents = Callable[[str | None, int], KVEvents | None]  # after (epoch, cursor)
ReportLatency = Callable[[float | None, float | None], None]  # TTFT, TPOT p90 (ms)


class Membership:
    """Applies joins and leaves to the replica's instances, routing, pulls and flights.
    `start_pull` / `stop_pull` start and cancel one instance's pull loop; `lookup` finds a
    joined instance's actor by its id (blocking; None when it is gone again)."""

    def __init__(
        self,
        members: Members,
        instances: Instances,
        flights: Flights,
        start_pull: Callable[[str], None],
        stop_pull: Callable[[str], None],
        kv_pool_events: PoolEvents | None = None,
        lookup: Callable[[str], ActorHandle | None] | None = None,
    ) -> None:
        self._members = members
        self._instances = instances
        self._flights = flights
        self._policy = flights.policy
        self._start_pull = start_pull
        self._stop_pull = stop_pull
        self._kv_pool_events = kv_pool_events
        self._kv_pool_cursor: tuple[str | None, int] = (None, -1)
        self._lookup = lookup or _get_actor

    async def watch(
        self,
        report_latency: ReportLatency | None = None,
        latency_p90: Callable[[], tuple[float | None, float | None]] | None = None,
    ) -> None:
        """Poll the membership; every LATENCY_REPORT_ROUNDS polls, report `latency_p90()`."""
        for round_index in itertools.count(1):
            await asyncio.sleep(MEMBERS_POLL_S)
            try:
                await self.sync_async()
                await self.sync_kv_pool_async()
                if report_latency and round_index % LATENCY_REPORT_ROUNDS == 0:
                    await asyncio.get_running_loop().run_in_executor(
                        None, report_latency, *latency_p90()
                    )
            except Exception:  # noqa: BLE001 - a failed read keeps the last membership
                logger.exception("reading the instance pool failed")

    def sync(self) -> None:
        """Read and apply the membership now (blocking: before the loop serves)."""
        self._apply(*self._read())

    async def sync_async(self) -> None:
        """Read the membership and look up joined instances' handles off the loop (both
        are blocking Ray calls), then apply it."""
        members, handles = await asyncio.get_running_loop().run_in_executor(None, self._read)
        self._apply(members, handles)

    async def sync_kv_pool_async(self) -> None:
        """Read the cluster KV pool's events since the last read (a blocking Ray call, off
        the loop) into the routing policy."""
        if self._kv_pool_events is None:
            return
        read = self._kv_pool_events
        events = await asyncio.get_running_loop().run_in_executor(None, read, *self._kv_pool_cursor)
        if events is None:
            return
        reset = events.reset or events.epoch != self._kv_pool_cursor[0]
        self._policy.apply_pool_events(events.stored, events.removed, reset)
        self._kv_pool_cursor = (events.epoch, events.cursor)

    def _read(self) -> tuple[dict[str, Role] | None, dict[str, ActorHandle]]:
        members = self._members()
        joined = [iid for iid in members or () if iid not in self._instances]
        handles = {}
        for iid in joined:
            handle = self._lookup(iid)
            if handle is not None:
                handles[iid] = handle
        return members, handles

    def _apply(self, members: dict[str, Role] | None, handles: dict[str, ActorHandle]) -> None:
        """Start pulling joined instances, drop left ones; None (unknown) changes nothing."""
        if members is None:
            return
        for iid, handle in handles.items():
            if iid not in self._instances:
                self._instances.add(iid, handle)
                self._policy.add_instance(iid, members[iid])
                self._start_pull(iid)
        for iid in set(self._instances.handles) - set(members):
            self._stop_pull(iid)
            self._flights.instance_lost(iid, "left the pool")
            self._policy.remove_instance(iid)
            self._instances.remove(iid)
            self._flights.accounting.forget(iid)


def _get_actor(instance_id: str) -> ActorHandle | None:
    with contextlib.suppress(ValueError):  # gone again already
        return ray.get_actor(instance_id)
    return None
