"""Per-consumer outboxes of one instance: the outputs that a gateway replica pulls.

A gateway replica (the consumer) starts requests with `submit` and reads all of its
requests on an instance with one `pull` per step; each pull returns every output produced
for that consumer since its last one. Replies travel inline, so a consumer that hangs up
or dies mid-stream leaves nothing in the object store. A consumer that has not pulled for
`idle_timeout_s` is gone (its replica died): its requests are aborted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.messages import StageTimes
from engine.outputs import EngineCoreOutput


@dataclass
class _Outbox:
    outputs: list[EngineCoreOutput] = field(default_factory=list)
    stage_times: list[StageTimes] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    request_ids: set[str] = field(default_factory=set)
    last_pull: float = field(default_factory=time.monotonic)
    pulling: bool = False
    num_promised: int = 0  # the consumer's requests still on their way here (see pull)


class Outboxes:
    """The open requests of one instance by consumer; every method runs on the actor's
    event loop."""

    def __init__(self, idle_timeout_s: float) -> None:
        self.idle_timeout_s = idle_timeout_s
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
        box.ready.set()
        if out.finished:
            del self._consumer_of[out.request_id]
            box.request_ids.discard(out.request_id)

    def reject(self, consumer_id: str, out: EngineCoreOutput) -> None:
        """Queue a final output for a request that was never opened (e.g. a reused id)."""
        box = self._box(consumer_id)
        box.outputs.append(out)
        box.ready.set()

    def close(self, request_id: str) -> None:
        """The consumer gave the request up: forget it, queue nothing more for it."""
        consumer_id = self._consumer_of.pop(request_id, None)
        if consumer_id is None:
            self._closed_unopened[request_id] = time.monotonic()
        else:
            self._boxes[consumer_id].request_ids.discard(request_id)

    async def pull(
        self, consumer_id: str, wait_s: float, num_promised: int = 0
    ) -> list[EngineCoreOutput]:
        """Every output queued for the consumer, waiting up to `wait_s` for the first.
        `num_promised`: how many more requests the consumer has sent on their way here."""
        box = self._box(consumer_id)
        box.num_promised = num_promised
        box.pulling = True
        try:
            if not box.outputs:
                await asyncio.wait_for(box.ready.wait(), wait_s)
        except asyncio.TimeoutError:
            pass
        finally:
            box.pulling = False
            box.last_pull = time.monotonic()
        outputs, box.outputs = box.outputs, []
        box.ready.clear()
        return outputs

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
