"""The pool as one gateway replica follows it: instances join and leave at run time (a
joined one is pulled, a left one's requests move), the cluster KV pool's block events feed
routing, and now and then the planner hears this replica's latencies.

The membership and the KV pool's events are long-polls: each answers at once when there is
something new and waits up to READ_WAIT_S when there is not, and a replica reads each at
most once per MIN_READ_INTERVAL_S. An idle replica so makes one call per READ_WAIT_S to
each; a busy pool costs it at most one call per second to each."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import ray
from ray.actor import ActorHandle

from pdcluster.actors.front.flights import Flights
from pdcluster.actors.front.instances import Instances
from pdcluster.actors.messages import KVEvents
from pdcluster.actors.pool_messages import MemberList
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.routing.role import Role

logger = logging.getLogger(__name__)

READ_WAIT_S = 30.0  # a long-poll's longest wait with nothing new
MIN_READ_INTERVAL_S = 1.0  # between two reads of one source, however busy the pool is
LATENCY_REPORT_S = 5.0  # between two latency reports to the planner

# After (epoch, version), waiting up to a time: the membership; None: cannot tell
Members = Callable[[str | None, int, float], Awaitable[MemberList | None]]
# After (epoch, cursor), waiting up to a time: the KV pool's events; None: cannot tell
PoolEvents = Callable[[str | None, int, float], Awaitable[KVEvents | None]]
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
        self._members_cursor: tuple[str | None, int] = (None, -1)
        self._kv_pool_cursor: tuple[str | None, int] = (None, -1)
        self._lookup = lookup or _get_actor
        # The LoRA adapters the pool serves, by name, as last read (or set by a load)
        self.adapters: dict[str, LoRARequest] = {}

    async def watch(
        self,
        report_latency: ReportLatency | None = None,
        latency_p90: Callable[[], tuple[float | None, float | None]] | None = None,
    ) -> None:
        """Follow the membership and the KV pool's events; every LATENCY_REPORT_S, report
        `latency_p90()` (unless it is nothing again)."""
        loops = [self._follow(self.sync)]
        if self._kv_pool_events is not None:
            loops.append(self._follow(self.sync_kv_pool))
        if report_latency is not None and latency_p90 is not None:
            loops.append(_report_latency(report_latency, latency_p90))
        await asyncio.gather(*loops)

    async def sync(self, wait_s: float = 0.0) -> None:
        """Read the membership, waiting up to `wait_s` for a change, and look up joined
        instances' handles off the loop (blocking Ray calls); then apply it."""
        members = await self._members(*self._members_cursor, wait_s)
        if members is None:  # cannot tell: nothing changes
            return
        handles = await asyncio.get_running_loop().run_in_executor(None, self._handles, members)
        self._apply(members.members, handles)
        self.adapters = dict(members.adapters)
        if all(iid in self._instances for iid in members.members):  # else: again next read
            self._members_cursor = (members.epoch, members.version)

    async def sync_kv_pool(self, wait_s: float = 0.0) -> None:
        """Read the cluster KV pool's events since the last read, waiting up to `wait_s` for
        one, into the routing policy."""
        if self._kv_pool_events is None:
            return
        events = await self._kv_pool_events(*self._kv_pool_cursor, wait_s)
        if events is None:
            return
        reset = events.reset or events.epoch != self._kv_pool_cursor[0]
        self._policy.apply_pool_events(events.stored, events.removed, reset)
        self._kv_pool_cursor = (events.epoch, events.cursor)

    @staticmethod
    async def _follow(read: Callable[[float], Awaitable[None]]) -> None:
        while True:
            try:
                await read(READ_WAIT_S)
            except Exception:  # noqa: BLE001 - a failed read keeps what was read before
                logger.exception("reading the instance pool failed")
            await asyncio.sleep(MIN_READ_INTERVAL_S)

    def _handles(self, members: MemberList) -> dict[str, ActorHandle]:
        """The actors of instances that joined (those found: one may be gone again)."""
        joined = [iid for iid in members.members if iid not in self._instances]
        handles = {}
        for iid in joined:
            handle = self._lookup(iid)
            if handle is not None:
                handles[iid] = handle
        return handles

    def _apply(self, members: dict[str, Role], handles: dict[str, ActorHandle]) -> None:
        """Start pulling joined instances, drop left ones."""
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


async def _report_latency(
    report: ReportLatency, latency_p90: Callable[[], tuple[float | None, float | None]]
) -> None:
    """Every LATENCY_REPORT_S, `report` (a blocking Ray call, off the loop) the latencies,
    unless there are none, again: an idle replica stops reporting."""
    last: tuple[float | None, float | None] = (None, None)
    while True:
        await asyncio.sleep(LATENCY_REPORT_S)
        latencies = latency_p90()
        if latencies == last == (None, None):
            continue
        try:
            await asyncio.get_running_loop().run_in_executor(None, report, *latencies)
        except Exception:  # noqa: BLE001 - the next report is as good
            logger.exception("reporting latencies to the planner failed")
        last = latencies


def _get_actor(instance_id: str) -> ActorHandle | None:
    with contextlib.suppress(ValueError):  # gone again already
        return ray.get_actor(instance_id)
    return None
