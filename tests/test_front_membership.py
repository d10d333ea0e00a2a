"""Joins and leaves at run time, and the KV pool's events (actors/front/membership.py),
against fake members and handles. No Ray."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pdcluster.actors.front import membership as membership_module
from pdcluster.actors.front.bridge import Sink
from pdcluster.actors.front.flights import Flights
from pdcluster.actors.front.instances import Instances
from pdcluster.actors.front.membership import Membership
from pdcluster.actors.front.traces import Traces
from pdcluster.actors.messages import KVEvents
from pdcluster.actors.pool_messages import MemberList
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.routing.policy import RouterConfig, RouterPolicy
from tests.front_fakes import FakeHandle


@dataclass
class Pool:
    """What the replica reads: the members, the actors that exist, the pool's events."""

    members: dict[str, str] | None = field(default_factory=dict)
    actors: dict[str, FakeHandle] = field(default_factory=dict)
    events: list[KVEvents] = field(default_factory=list)
    member_reads: list[tuple[str | None, int, float]] = field(default_factory=list)
    event_reads: list[tuple[str | None, int, float]] = field(default_factory=list)
    pulling: list[str] = field(default_factory=list)  # instances a pull loop reads now

    def join(self, iid: str, role: str) -> None:
        self.actors[iid] = FakeHandle(iid)
        self.members[iid] = role

    async def read_members(
        self, epoch: str | None, version: int, wait_s: float
    ) -> MemberList | None:
        """The members, numbered by how many reads saw them change (as the controller would)."""
        self.member_reads.append((epoch, version, wait_s))
        if self.members is None:
            return None
        return MemberList("e1", hash(tuple(sorted(self.members.items()))), dict(self.members))

    async def read_events(self, epoch: str | None, cursor: int, wait_s: float) -> KVEvents | None:
        self.event_reads.append((epoch, cursor, wait_s))
        return self.events.pop(0) if self.events else None


def make(pool: Pool) -> tuple[Membership, Instances, Flights]:
    instances = Instances()
    policy = RouterPolicy({}, RouterConfig(block_size=4, max_model_len=64))
    flights = Flights("front-test", policy, policy.config, instances, lambda *a: None,
                      Traces().record)  # fmt: skip
    membership = Membership(
        pool.read_members,
        instances,
        flights,
        pool.pulling.append,
        pool.pulling.remove,
        pool.read_events,
        lookup=pool.actors.get,
    )
    return membership, instances, flights


def test_joined_instances_are_pulled_and_routed_to():
    pool = Pool()
    pool.join("P0", "prefill")
    pool.join("D0", "decode")
    membership, instances, flights = make(pool)
    asyncio.run(membership.sync())
    assert set(instances.handles) == {"P0", "D0"} and pool.pulling == ["P0", "D0"]
    assert {i: load.role for i, load in flights.policy.instances.items()} == pool.members
    asyncio.run(membership.sync())  # nothing changed: no second loop
    assert pool.pulling == ["P0", "D0"]


def test_an_instance_gone_before_its_lookup_is_not_added():
    pool = Pool()
    pool.join("D0", "decode")
    pool.members["D1"] = "decode"  # listed, its actor already gone
    membership, instances, _ = make(pool)
    asyncio.run(membership.sync())
    assert set(instances.handles) == {"D0"} and pool.pulling == ["D0"]


def test_an_unknown_membership_changes_nothing():
    pool = Pool()
    pool.join("D0", "decode")
    membership, instances, _ = make(pool)
    asyncio.run(membership.sync())
    pool.members = None
    asyncio.run(membership.sync())
    assert set(instances.handles) == {"D0"} and pool.pulling == ["D0"]


def test_a_left_instance_stops_being_pulled_and_its_requests_move():
    pool = Pool()
    for iid, role in (("P0", "prefill"), ("P1", "prefill"), ("D0", "decode")):
        pool.join(iid, role)
    membership, instances, flights = make(pool)
    asyncio.run(membership.sync())
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    flights.start([Request("r", list(range(12)), params)], [Sink(None, None, 0)])
    prefill = next(i for i in ("P0", "P1") if pool.actors[i].names("submit"))
    del pool.members[prefill]
    asyncio.run(membership.sync())
    assert prefill not in instances and prefill not in flights.policy.instances
    assert set(pool.pulling) == {"P0", "P1", "D0"} - {prefill}
    assert flights.num_moves == 1 and pool.actors[prefill].names("abort") == [(["r"],)]
    other = ({"P0", "P1"} - {prefill}).pop()
    assert pool.actors[other].names("submit")[0][0].request_id == "r~2"
    assert flights.accounting.num_promised("D0") == 1  # the moved attempt's, once


def test_a_joined_instance_is_found_at_run_time():
    pool = Pool()
    pool.join("D0", "decode")
    membership, instances, _ = make(pool)
    asyncio.run(membership.sync())
    pool.join("D1", "decode")
    asyncio.run(membership.sync())
    assert set(instances.handles) == {"D0", "D1"} and pool.pulling == ["D0", "D1"]


def test_kv_pool_events_feed_routing_after_their_cursor():
    pool = Pool(events=[KVEvents("p1", 2, [1, 2]), KVEvents("p1", 3, [3], [1]),
                        KVEvents("p2", 0, [9])])  # fmt: skip
    membership, _, flights = make(pool)
    for _ in range(4):
        asyncio.run(membership.sync_kv_pool(wait_s=7.0))
    assert pool.event_reads == [(None, -1, 7.0), ("p1", 2, 7.0), ("p1", 3, 7.0), ("p2", 0, 7.0)]
    assert list(flights.policy.pool_blocks) == [9]  # a new epoch starts over


def test_watch_long_polls_from_its_last_answer_and_reports_latency(monkeypatch):
    monkeypatch.setattr(membership_module, "MIN_READ_INTERVAL_S", 0.0)
    monkeypatch.setattr(membership_module, "LATENCY_REPORT_S", 0.0)
    pool = Pool()
    pool.join("D0", "decode")
    membership, instances, _ = make(pool)
    asyncio.run(membership.sync())
    reports = []
    latencies = iter([(12.0, 3.0), (None, None), (None, None), (None, None), (5.0, None)])

    async def watch_a_while() -> None:
        task = asyncio.ensure_future(membership.watch(
            lambda ttft, tpot: reports.append((ttft, tpot)), lambda: next(latencies, (None, None))
        ))  # fmt: skip
        while len(reports) < 3 or len(pool.member_reads) < 3:
            await asyncio.sleep(0.01)
        task.cancel()

    asyncio.run(asyncio.wait_for(watch_a_while(), 10))
    # nothing again is not reported again: an idle replica goes quiet
    assert reports[:3] == [(12.0, 3.0), (None, None), (5.0, None)] and "D0" in instances
    version = hash((("D0", "decode"),))
    assert pool.member_reads[0] == (None, -1, 0.0)  # the first read answers at once
    assert set(pool.member_reads[1:]) == {("e1", version, membership_module.READ_WAIT_S)}


def test_an_instance_not_found_yet_is_looked_up_again_at_the_next_read():
    pool = Pool()
    pool.join("D0", "decode")
    pool.members["D1"] = "decode"  # listed before its actor can be found
    membership, instances, _ = make(pool)
    asyncio.run(membership.sync())
    pool.actors["D1"] = FakeHandle("D1")
    asyncio.run(membership.sync(wait_s=5.0))
    assert pool.member_reads[1][:2] == (None, -1)  # not waiting on a membership it holds half of
    assert set(instances.handles) == {"D0", "D1"}
