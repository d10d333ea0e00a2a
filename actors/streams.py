"""Per-consumer outboxes of one instance: the outputs that a gateway replica pulls.

A gateway replica (the consumer) starts requests with `submit` and reads all of its
requests on an instance with one `pull` per step; each pull returns every output produced
for that consumer since its last one. A pull is a long-poll: it waits, on the actor's event
loop, until the consumer has outputs, or until the instance's load or prefix cache changed
(`notify`, answered at most every `refresh_s` per consumer, so that every replica routes on
fresh load without the busy instance answering each step to replicas with nothing there),
or until its wait ends. An idle instance so answers each consumer about once per wait, and a
busy one once per step with all of that consumer's outputs: a request's outputs of several
steps since the consumer's last pull go as one (`coalesce`). Replies travel inline, so a
consumer that hangs up or dies mid-stream leaves nothing in the object store. A consumer
that has not pulled (nor been waiting in a pull) for `idle_timeout_s` is gone (its replica
died): its requests are aborted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdcluster.actors.messages import StageTimes
from pdcluster.engine.outputs import EngineCoreOutput, coalesce

PULL_WAIT_S = 5.0  # a pull with no output and no change to report returns after this
REFRESH_S = 0.1  # a consumer hears of load changes at most this often (10 Hz) without outputs


@dataclass
class _Outbox:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stage_times: list[StageTimes] = field(default_factory=list)
    request_ids: set[str] = field(default_factory=set)
    last_pull: float = field(default_factory=time.monotonic)  # a pull ended (liveness)
    last_reply: float = 0.0  # when a pull last answered (paces the answers to `notify`)
    changed: bool = False  # load or prefix cache changed since the last answer
    waiter: asyncio.Future | None = None  # the pull waiting now, woken by put or notify
    pulling: bool = False
    num_promised: int = 0  # the consumer's requests still on their way here (see pull)

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class Outboxes:
    """The open requests of one instance by consumer; every method runs on the actor's
    event loop."""

    def __init__(self, idle_timeout_s: float, refresh_s: float = REFRESH_S) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.refresh_s = refresh_s
        self._boxes: dict[str, _Outbox] = {}
        self._consumer_of: dict[str, str] = {}  # open request id -> consumer id
        self._closed_unopened: dict[str, float] = {}  # aborts that overtook their start

    def __len__(self) -> int:
        """Open requests: started and not yet finished or aborted."""
        return len(self._consumer_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._consumer_of

    def open(self, request_id: str, consumer_id: str) -> None:
        if request_id in self._consumer_of:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._consumer_of[request_id] = consumer_id
        self._box(consumer_id).request_ids.add(request_id)

    def consumer_of(self, request_id: str) -> str:
        return self._consumer_of[request_id]

    def aborted_before_start(self, request_id: str) -> bool:
        """Whether the request's abort arrived before the call that starts it (Ray may run
        a call whose arguments are still in transfer after a later call)."""
        return self._closed_unopened.pop(request_id, None) is not None

    def put(self, out: EngineCoreOutput, stage_times: StageTimes | None = None) -> None:
        """Queue an output (and the request's stage times here, with its last output) for
        its consumer; dropped when the request was closed. A finished output closes the
        request."""
        consumer_id = self._consumer_of.get(out.request_id)
        if consumer_id is None:
            return
        box = self._boxes[consumer_id]
        if stage_times is not None:
            box.stage_times.append(stage_times)
        box.outputs.append(out)
        box.wake()
        if out.finished:
            del self._consumer_of[out.request_id]
            box.request_ids.discard(out.request_id)

    def reject(self, consumer_id: str, out: EngineCoreOutput) -> None:
        """Queue a final output for a request that was never opened (e.g. a reused id)."""
        box = self._box(consumer_id)
        box.outputs.append(out)
        box.wake()

    def close(self, request_id: str) -> None:
        """The consumer gave the request up: forget it, queue nothing more for it."""
        consumer_id = self._consumer_of.pop(request_id, None)
        if consumer_id is None:
            self._closed_unopened[request_id] = time.monotonic()
        else:
            self._boxes[consumer_id].request_ids.discard(request_id)

    def notify(self) -> None:
        """The instance's load or prefix cache changed: every consumer hears of it soon."""
        for box in self._boxes.values():
            box.changed = True
            box.wake()

    async def pull(
        self, consumer_id: str, wait_s: float, num_promised: int = 0
    ) -> list[EngineCoreOutput]:
        """Every output queued for the consumer, waiting up to `wait_s` for the first or
        for a change to report (see the module's docstring). `num_promised`: how many more
        requests the consumer has sent on their way here."""
        box = self._box(consumer_id)
        box.num_promised = num_promised
        box.pulling = True
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + wait_s
        try:
            while not box.outputs:
                timeout = self._wait_left(box, deadline - time.monotonic())
                if timeout <= 0:
                    break
                box.waiter = loop.create_future()
                timer = loop.call_later(timeout, box.wake)
                try:
                    await box.waiter
                finally:
                    timer.cancel()
                    box.waiter = None
        finally:
            box.pulling = False
            box.last_pull = box.last_reply = time.monotonic()
        box.changed = False
        outputs, box.outputs = box.outputs, []
        return coalesce(outputs)  # a request's steps since the last pull: one output

    def _wait_left(self, box: _Outbox, left_s: float) -> float:
        """How long a pull with no output still waits: a change is answered once
        `refresh_s` passed since the consumer's last answer."""
        if box.changed:
            return min(left_s, box.last_reply + self.refresh_s - time.monotonic())
        return left_s

    def take_stage_times(self, consumer_id: str) -> list[StageTimes]:
        """The stage times queued for the consumer (with the outputs its pull just took)."""
        box = self._boxes.get(consumer_id)
        if box is None or not box.stage_times:
            return []
        stage_times, box.stage_times = box.stage_times, []
        return stage_times

    def num_promised(self) -> int:
        return sum(box.num_promised for box in self._boxes.values())

    def orphaned(self) -> list[str]:
        """Open requests of consumers that stopped pulling (with none waiting) for
        `idle_timeout_s`: their consumer died. Such consumers are forgotten."""
        deadline = time.monotonic() - self.idle_timeout_s
        for rid in [r for r, t in self._closed_unopened.items() if t < deadline]:
            del self._closed_unopened[rid]
        gone = [c for c, b in self._boxes.items() if not b.pulling and b.last_pull < deadline]
        orphans = []
        for consumer_id in gone:
            orphans += self._boxes.pop(consumer_id).request_ids
        for rid in orphans:
            self._consumer_of.pop(rid, None)
        return orphans

    def _box(self, consumer_id: str) -> _Outbox:
        box = self._boxes.get(consumer_id)
        if box is None:
            box = self._boxes[consumer_id] = _Outbox()
        return box


async def reap_orphans(outboxes: Outboxes, abort: Callable[[list[str]], None]) -> None:
    """Run for an actor's lifetime: abort the requests whose consumers went away."""
    while True:
        await asyncio.sleep(min(1.0, outboxes.idle_timeout_s / 4))
        if orphans := outboxes.orphaned():
            abort(orphans)
