"""One pull loop per instance (actors/front/pulls.py) and the calls to instances
(actors/front/instances.py), against fake instance handles on the Front's loop. No Ray."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import pytest
import ray

from pdcluster.actors.front import pulls as pulls_module
from pdcluster.actors.front.bridge import LoopThread, Sink
from pdcluster.actors.front.flights import Flights
from pdcluster.actors.front.instances import Instances
from pdcluster.actors.front.pulls import Pulls
from pdcluster.actors.front.traces import Traces
from pdcluster.actors.messages import InstanceStats, LoadReport
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.routing.policy import Load, RouterConfig, RouterPolicy
from tests.front_fakes import FakeHandle, reply

REPLICA = "front-test"


@dataclass
class Harness:
    thread: LoopThread
    handles: dict[str, FakeHandle]
    instances: Instances
    policy: RouterPolicy
    flights: Flights
    pulls: Pulls
    sent: list[tuple[str, list[EngineCoreOutput]]]
    got: threading.Condition

    def on_loop(self, fn, *args):
        return self.thread.call(lambda: fn(*args)).result(5)

    def wait_sent(self, count: int) -> list[tuple[str, list[EngineCoreOutput]]]:
        with self.got:
            assert self.got.wait_for(lambda: len(self.sent) >= count, 5)
            return list(self.sent)


@pytest.fixture
def front():
    thread = LoopThread("test-front")
    handles = {iid: FakeHandle(iid) for iid in ("M0", "M1")}
    instances = Instances()
    policy = RouterPolicy({}, RouterConfig(block_size=4, max_model_len=64))
    sent, got = [], threading.Condition()

    def send(sink: Sink, client_id: str, batch: list[EngineCoreOutput]) -> None:
        with got:
            sent.append((client_id, batch))
            got.notify_all()

    flights = Flights(REPLICA, policy, policy.config, instances, send, Traces().record)
    pulls = Pulls(thread.loop, REPLICA, instances, flights)
    for iid, handle in handles.items():
        instances.add(iid, handle)
        policy.add_instance(iid, "mixed")
    yield Harness(thread, handles, instances, policy, flights, pulls, sent, got)
    thread.call(lambda: [task.cancel() for task in pulls.tasks()]).result(5)
    thread.stop(5)


def start_request(h: Harness, rid: str = "r") -> str:
    """Start one request; the instance it went to."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    h.on_loop(h.flights.start, [Request(rid, list(range(12)), params)], [Sink(None, None, 0)])
    return next(iid for iid, handle in h.handles.items() if handle.names("submit"))


def test_a_pull_delivers_outputs_applies_load_and_carries_its_cursor(front):
    h = front
    iid = start_request(h)
    h.on_loop(h.pulls.start, iid)
    first = h.handles[iid].next_pull(0)
    assert first.args == (REPLICA, None, -1, 0)
    assert first.hex() in h.pulls.object_ids.since(time.monotonic())  # in flight: no leak
    load = LoadReport(3, 7, 40, 8, 16)
    first.answer(reply("e1", 5, [EngineCoreOutput("r", [1, 2])], load=load, stored=[11]))
    second = h.handles[iid].next_pull(1)
    assert second.args == (REPLICA, "e1", 5, 0)
    assert h.wait_sent(1)[0][0] == "r"
    instance = h.policy.instances[iid]
    assert instance.published == Load(3, 7, 40) and instance.num_blocks_total == 16
    assert 11 in instance.cached_blocks
    assert first.hex() not in h.pulls.object_ids.since(time.monotonic())


def test_one_pull_loop_per_instance_each_reading_its_own(front):
    h = front
    for iid in h.handles:
        h.on_loop(h.pulls.start, iid)
    for handle in h.handles.values():
        handle.next_pull(0)
    time.sleep(0.1)  # unanswered: no loop pulls again
    assert [len(handle.pulls) for handle in h.handles.values()] == [1, 1]
    assert len(h.on_loop(h.pulls.tasks)) == 2


def test_an_instance_that_died_has_its_requests_moved_and_is_read_afresh(front):
    h = front
    iid = start_request(h)
    other = next(i for i in h.handles if i != iid)
    h.on_loop(h.pulls.start, iid)
    h.handles[iid].next_pull(0).answer(reply("e1", 2))
    h.handles[iid].next_pull(1).answer(ray.exceptions.RayActorError())
    again = h.handles[iid].next_pull(2)  # after RETRY_PULL_S
    assert again.args == (REPLICA, None, -1, 0)
    assert h.flights.num_moves == 1 and not h.policy.instances[iid].healthy
    ((request, _),) = h.handles[other].names("submit")
    assert request.request_id == "r~2"
    assert h.handles[iid].names("abort") == [(["r"],)]


def test_an_instance_that_restarted_has_its_requests_moved(front):
    h = front
    iid = start_request(h)
    h.on_loop(h.pulls.start, iid)
    h.handles[iid].next_pull(0).answer(reply("e1", 2))
    h.handles[iid].next_pull(1).answer(reply("e2", 0))  # a new epoch: a new process
    assert h.handles[iid].next_pull(2).args == (REPLICA, "e2", 0, 0)
    assert h.flights.num_moves == 1


def test_a_late_pull_marks_its_instance_late_not_dead_and_still_delivers(front, monkeypatch):
    h = front
    monkeypatch.setattr(pulls_module, "PULL_TIMEOUT_S", 0.05)
    iid = start_request(h)
    h.on_loop(h.pulls.start, iid)
    late = h.handles[iid].next_pull(0)
    deadline = time.monotonic() + 5
    while not h.policy.instances[iid].late and time.monotonic() < deadline:
        time.sleep(0.01)
    assert h.policy.instances[iid].late and h.policy.instances[iid].healthy
    assert h.flights.num_moves == 0  # its stream stays where it is
    late.answer(reply("e1", 1, [EngineCoreOutput("r", [1], finish_reason="length")]))
    assert h.wait_sent(1)[0][1][0].new_token_ids == [1]
    h.handles[iid].next_pull(1)
    assert not h.policy.instances[iid].late  # it answered


def test_a_stopped_loop_pulls_no_more(front):
    h = front
    h.on_loop(h.pulls.start, "M0")
    pending = h.handles["M0"].next_pull(0)
    h.on_loop(h.pulls.stop, "M0")
    pending.answer(reply("e1", 1))
    time.sleep(0.1)
    assert len(h.handles["M0"].pulls) == 1 and h.on_loop(h.pulls.tasks) == []


def test_stats_fan_out_marks_an_instance_that_does_not_answer(front):
    h = front
    answers = {"M0": InstanceStats("M0", "mixed", num_steps=3)}

    async def stats_call(iid: str):
        if iid in answers:
            return answers[iid]
        await asyncio.sleep(10)  # never in time

    for iid, handle in h.handles.items():
        handle.called = lambda name, args, iid=iid: stats_call(iid)
    h.policy.mark_dead("M0")  # answered, yet unhealthy to routing
    stats = h.thread.call(h.instances.stats(h.policy, timeout_s=0.1)).result(5)
    by_id = {s.instance_id: s for s in stats}
    assert by_id["M0"].num_steps == 3 and by_id["M0"].reachable and not by_id["M0"].healthy
    assert by_id["M1"] == InstanceStats.unreachable("M1", "mixed")
