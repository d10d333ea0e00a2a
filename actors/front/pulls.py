"""One pull loop per instance: each long-polls its instance for the outputs of all of this
replica's requests there, one call per step, with the instance's load and prefix-cache
events, and reports an instance that dies or restarts (Ray's word: the pull fails with
RayActorError, or its reply names a new process), or answers late.

Lateness is no death: on a starved host every pull is late, and taking late instances for
dead would route every new request to none. A late instance gets new requests only when no
instance of its role answers in time, and its streams go on."""

from __future__ import annotations

import asyncio
import logging

import ray

from pdcluster.actors.front.flights import Flights
from pdcluster.actors.front.instances import Instances
from pdcluster.actors.front.leaks import PullIds
from pdcluster.actors.messages import PullReply
from pdcluster.actors.replies import Replies
from pdcluster.actors.streams import PULL_WAIT_S
from pdcluster.routing.policy import Load

logger = logging.getLogger(__name__)

PULL_TIMEOUT_S = PULL_WAIT_S + 5.0  # a pull unanswered this long: its instance is late
RETRY_PULL_S = 0.5  # pause between pulls of an instance that failed


class Pulls:
    """The pull loops of one replica (started, stopped and run on its event loop)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        replica_id: str,
        instances: Instances,
        flights: Flights,
    ) -> None:
        self._loop = loop
        self._replica_id = replica_id
        self._instances = instances
        self._flights = flights
        self._policy = flights.policy
        self._replies = Replies(loop)
        self._tasks: dict[str, asyncio.Task] = {}
        self.object_ids = PullIds()  # a pull is no leaked object

    def start(self, instance_id: str) -> None:
        self._tasks[instance_id] = self._loop.create_task(self._pull_loop(instance_id))

    def stop(self, instance_id: str) -> None:
        self._tasks.pop(instance_id).cancel()

    def tasks(self) -> list[asyncio.Task]:
        return list(self._tasks.values())

    async def _pull_loop(self, instance_id: str) -> None:
        """Read one instance for as long as it is a member."""
        epoch: str | None = None
        cursor = -1
        while True:
            promised = self._flights.accounting.num_promised(instance_id)
            ref = self._instances.pull(instance_id, self._replica_id, epoch, cursor, promised)
            ref_id = ref.hex()
            self.object_ids.started(ref_id)
            try:
                reply = await self._pull_reply(instance_id, ref)
            except ray.exceptions.RayActorError:
                if self._policy.instances[instance_id].healthy or epoch is not None:
                    self._flights.instance_lost(instance_id, "died")
                epoch, cursor = None, -1
                await asyncio.sleep(RETRY_PULL_S)
                continue
            finally:
                self.object_ids.done(ref_id)
            events = reply.events
            if epoch is not None and events.epoch != epoch:
                self._flights.instance_lost(instance_id, "restarted")
            epoch, cursor = events.epoch, events.cursor
            self._apply(instance_id, reply)

    async def _pull_reply(self, instance_id: str, ref: ray.ObjectRef) -> PullReply:
        """A pull's reply. One unanswered for PULL_TIMEOUT_S marks its instance late (new
        requests go elsewhere first), and is still waited for: the outputs it carries are its
        streams'."""
        late = self._loop.call_later(PULL_TIMEOUT_S, self._unanswered, instance_id)
        try:
            return await self._replies.future(ref)
        finally:
            late.cancel()

    def _unanswered(self, instance_id: str) -> None:
        logger.warning(
            "instance %s has not answered for %.0f s; new requests go elsewhere first",
            instance_id, PULL_TIMEOUT_S,
        )  # fmt: skip
        self._policy.mark_late(instance_id)

    def _apply(self, instance_id: str, reply: PullReply) -> None:
        policy = self._policy
        if reply.accepting:
            policy.mark_alive(instance_id)
        else:
            policy.mark_dead(instance_id)
        load = reply.load
        policy.apply_report(
            instance_id,
            Load(load.num_active, load.queued_prefill_tokens, load.kv_tokens),
            load.num_blocks_total,
            load.lora_adapters,
        )
        events = reply.events
        policy.apply_kv_events(instance_id, events.stored, events.removed, events.reset)
        self._flights.add_stage_times(reply.stage_times)  # first: outputs may end the flight
        if reply.outputs:
            self._flights.dispatch(instance_id, reply.outputs)
