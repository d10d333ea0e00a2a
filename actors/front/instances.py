"""The instances as one gateway replica sees them: their actor handles, and every call the
replica makes to them but the pull (pulls.py): submit, encode, abort and the stats fan-out."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import ray
from ray.actor import ActorHandle

from pdcluster.actors.messages import InstanceStats, Route
from pdcluster.engine.request import Request
from pdcluster.routing.policy import RouterPolicy


class Instances:
    """Instance id -> actor handle, for the members this replica reads."""

    def __init__(self) -> None:
        self.handles: dict[str, ActorHandle] = {}

    def __contains__(self, instance_id: str) -> bool:
        return instance_id in self.handles

    def add(self, instance_id: str, handle: ActorHandle) -> None:
        self.handles[instance_id] = handle

    def remove(self, instance_id: str) -> None:
        del self.handles[instance_id]

    def encode(self, instance_id: str, request: Request) -> list[ray.ObjectRef]:
        """Start E on the request's images; the refs its P (or colocated D) reads them by."""
        return [self.handles[instance_id].encode.remote(request)]

    def submit(self, instance_id: str, request: Request, route: Route) -> None:
        self.handles[instance_id].submit.remote(request, route)

    def abort(self, instance_id: str, request_ids: list[str]) -> None:
        """Drop the requests' state on the instance, if it is still a member."""
        handle = self.handles.get(instance_id)
        if handle is not None:
            handle.abort.remote(request_ids)

    def pull(
        self, instance_id: str, replica_id: str, epoch: str | None, cursor: int, promised: int
    ) -> ray.ObjectRef:
        return self.handles[instance_id].pull.remote(replica_id, epoch, cursor, promised)

    async def stats(self, policy: RouterPolicy, timeout_s: float) -> list[InstanceStats]:
        """Every instance's stats; one that does not answer within `timeout_s` is unhealthy
        and, with only its id and role, not `reachable`."""
        ids = list(self.handles)
        results = await asyncio.gather(
            *(_answer(self.handles[i].stats.remote(), timeout_s) for i in ids),
            return_exceptions=True,
        )
        stats = []
        for iid, result in zip(ids, results):
            load = policy.instances[iid]
            if isinstance(result, BaseException):
                stats.append(InstanceStats.unreachable(iid, load.role))
            else:
                stats.append(dataclasses.replace(result, healthy=load.healthy))
        return stats


async def _answer(ref: Any, timeout_s: float) -> Any:
    return await asyncio.wait_for(ref, timeout_s)
