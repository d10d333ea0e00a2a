"""Front: one gateway replica's client of the instance pool (control and data plane).

Each replica plans its own requests with a `RouterPolicy` (no call to any central actor),
submits them straight to the chosen instances (flights.py), and reads its tokens straight
from the instance that generates them: one pull loop per instance (pulls.py) carries the
outputs of all of this replica's requests there, one call per step. The pool's membership
is followed at run time (membership.py). All of it runs on an event loop of the Front's own
thread (bridge.py), so callers on any event loop can stream; a gateway that serves on that
loop itself (`run_coroutine`) streams with no hop between threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Coroutine
from concurrent.futures import Future
from typing import Any

from ray.actor import ActorHandle

from pdcluster.actors.front.bridge import Batch, LoopThread, Outbox, Sink
from pdcluster.actors.front.flights import Flights
from pdcluster.actors.front.instances import Instances
from pdcluster.actors.front.membership import Members, Membership, PoolEvents, ReportLatency
from pdcluster.actors.front.pulls import Pulls
from pdcluster.actors.front.traces import Traces
from pdcluster.actors.messages import InstanceStats, RequestTrace
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.engine.outputs import EngineCoreOutput, coalesce
from pdcluster.engine.request import Request
from pdcluster.routing.policy import RouterConfig, RouterPolicy

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 5.0  # an instance's stats call, when the caller names no bound
CLOSE_TIMEOUT_S = 10.0


class Front:
    """`members`: an async callable returning the membership after a version, or None when
    it cannot tell (long-polled for joins and leaves). `kv_pool_events`: one returning the
    cluster KV pool's events after a cursor (epoch, cursor), or None when it cannot tell
    (long-polled as the membership is; absent when there is no pool). `report_latency` hears this replica's
    TTFT and TPOT p90 now and then (for the planner)."""

    def __init__(
        self,
        members: Members,
        config: RouterConfig,
        report_latency: ReportLatency | None = None,
        kv_pool_events: PoolEvents | None = None,
    ) -> None:
        self.config = config
        self.replica_id = f"front-{uuid.uuid4().hex[:12]}"
        self.policy = RouterPolicy({}, config)
        self._thread = LoopThread("front")
        loop = self._thread.loop
        self._traces = Traces()
        self._instances = Instances()
        self._outbox = Outbox(loop, self._abort)
        self._flights = Flights(
            self.replica_id,
            self.policy,
            config,
            self._instances,
            self._outbox.send,
            self._traces.record,
        )
        self._pulls = Pulls(loop, self.replica_id, self._instances, self._flights)
        self._membership = Membership(
            members,
            self._instances,
            self._flights,
            self._pulls.start,
            self._pulls.stop,
            kv_pool_events,
        )
        self._thread.call(self._membership.sync()).result()
        watch = self._membership.watch(report_latency, self._traces.latency_p90)
        self._watcher = self.run_coroutine(watch)

    # ---- client API (any thread, any event loop) ---------------------------------------
    async def stream(self, request: Request) -> AsyncIterator[EngineCoreOutput]:
        """Outputs of one request as they arrive; leaving early aborts it everywhere."""
        async with contextlib.aclosing(self.stream_group([request])) as outputs:
            async for _, out in outputs:
                yield out

    async def stream_group(
        self, requests: list[Request]
    ) -> AsyncIterator[tuple[int, EngineCoreOutput]]:
        """(index in `requests`, output) as outputs arrive. The requests sample one prompt
        (a client's n > 1, see routing/fanout.py): they share one plan, so their P (or mixed
        instance) computes the prompt once and the others hit its prefix cache. Leaving
        early aborts every unfinished one everywhere."""
        loop = asyncio.get_running_loop()
        batches: asyncio.Queue[Batch] = asyncio.Queue()
        sinks = [Sink(loop, batches, i) for i in range(len(requests))]
        self._thread.on_loop(loop, self._flights.start, requests, sinks)
        unfinished = set(range(len(requests)))
        try:
            while unfinished:
                for index, out in _behind(await batches.get(), batches):
                    if out.finished:
                        unfinished.discard(index)
                    yield index, out
        finally:
            if unfinished:
                rids = [requests[i].request_id for i in unfinished]
                self._thread.on_loop(loop, self._abort, rids)

    @property
    def adapters(self) -> dict[str, LoRARequest]:
        """The LoRA adapters the pool serves, by name, as this replica last heard."""
        return self._membership.adapters

    @adapters.setter
    def adapters(self, adapters: dict[str, LoRARequest]) -> None:
        """What a load or unload through this replica answered: it need not wait to hear."""
        self._membership.adapters = dict(adapters)

    def handles(self) -> dict[str, tuple[str, ActorHandle]]:
        """The pool as this replica sees it: instance id -> (role, handle)."""
        handles = self._instances.handles
        return {iid: (self.policy.instances[iid].role, h) for iid, h in handles.items()}

    def cluster_stats(self, timeout_s: float = STATS_TIMEOUT_S) -> Future[list[InstanceStats]]:
        """Every instance's stats; one that does not answer within `timeout_s` is unhealthy
        and, with only its id and role, not `reachable`."""
        return self.run_coroutine(self._instances.stats(self.policy, timeout_s))

    def traces(self) -> list[RequestTrace]:
        """The latest finished requests' traces (at most MAX_TRACES), oldest first."""
        return self._thread.call(self._traces.traces).result()

    def latency_p90(self, window_s: float = 60.0) -> tuple[float | None, float | None]:
        """TTFT and TPOT p90 (ms) of the requests this replica finished in the window."""
        return self._traces.latency_p90(window_s)

    def num_in_flight(self) -> int:
        return len(self._flights)

    @property
    def num_started(self) -> int:
        """Requests this replica has served (or is serving)."""
        return self._flights.num_started

    @property
    def num_moves(self) -> int:
        """Attempts planned again after their instance was lost."""
        return self._flights.num_moves

    def pull_object_ids(self, since: float) -> set[str]:
        """Object ids of pulls in flight or started after `since` (time.monotonic())."""
        return self._pulls.object_ids.since(since)

    def close(self) -> None:
        try:
            self._thread.call(self._stop()).result(timeout=CLOSE_TIMEOUT_S)
        except TimeoutError:  # something blocked the loop: stop it all the same
            logger.warning("the front did not stop within %.0f s", CLOSE_TIMEOUT_S)
        self._thread.stop(CLOSE_TIMEOUT_S)

    def run_coroutine(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        """Run `coro` on the Front's event loop (e.g. the gateway's HTTP server, whose
        streams then get their outputs with no cross-thread hop)."""
        return self._thread.call(coro)

    # ---- the Front's loop --------------------------------------------------------------
    def _abort(self, client_ids: list[str]) -> None:
        self._flights.abort(client_ids)

    async def _stop(self) -> None:
        self._abort(self._flights.client_ids())
        tasks = [*self._pulls.tasks(), asyncio.wrap_future(self._watcher)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _behind(first: Batch, batches: asyncio.Queue[Batch]) -> list[tuple[int, EngineCoreOutput]]:
    """`first` and every batch queued behind it (the caller fell behind its pulls), as one
    output per request: a stream then sends the tokens that waited as one event."""
    if batches.empty():
        return [(first[0], out) for out in coalesce(first[1])]
    by_index: dict[int, list[EngineCoreOutput]] = {first[0]: list(first[1])}
    while not batches.empty():
        index, batch = batches.get_nowait()
        by_index.setdefault(index, []).extend(batch)
    return [(index, out) for index, outs in by_index.items() for out in coalesce(outs)]
