"""`scheduling_policy: priority` (vLLM's `--scheduling-policy priority`): waiting requests
run by (priority, arrival), lower first; when KV blocks run out the worst-priority running
request is preempted. Scheduler with hand-built runner outputs, the config and CLI, then a
1P1D cluster."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pdcluster.cluster.cli import build_parser
from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.serve_flags import load_serve_config
from pdcluster.engine import SamplingParams
from pdcluster.engine.request import RequestStatus
from pdcluster.engine.request_queue import FCFSQueue, PriorityQueue
from tests.cluster_utils import SMALL_ENGINE, assert_clean, live_object_ids, start, until
from tests.scheduler_utils import (
    FakeECConnector,
    assert_idle,
    image,
    make_requests,
    make_scheduler,
    run_until_done,
    step,
)


def add(scheduler, priorities, num_tokens=8, max_tokens=4):
    requests = []
    for i, priority in enumerate(priorities):
        (r,) = make_requests(1, num_tokens, start=i, max_tokens=max_tokens, priority=priority)
        scheduler.add_request(r)
        requests.append(r)
    return requests


def admission_order(scheduler) -> list[str]:
    order = []
    while scheduler.has_requests():
        so, _ = step(scheduler)
        order += [n.req_id for n in so.scheduled_new_reqs]
    return order


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        ("priority", ["req1", "req3", "req2", "req0"]),  # by priority, ties by arrival
        ("fcfs", ["req0", "req1", "req2", "req3"]),
    ],
)
def test_waiting_requests_are_admitted_in_policy_order(policy, expected):
    s = make_scheduler(max_num_seqs=1, scheduling_policy=policy)
    add(s, [3, 1, 2, 1] if policy == "priority" else [0, 0, 0, 0])
    assert admission_order(s) == expected
    assert_idle(s)


@pytest.mark.parametrize(("policy", "victim"), [("priority", "req1"), ("fcfs", "req2")])
def test_blocks_running_out_preempt_the_worst_priority_not_the_newest(policy, victim):
    # Three 8-token prompts take 6 of 7 blocks; their 9th tokens need 3 more.
    s = make_scheduler(
        num_blocks=7, block_size=4, enable_prefix_caching=False, scheduling_policy=policy
    )
    a, b, c = add(s, [0, 5, 1] if policy == "priority" else [0, 0, 0], max_tokens=6)
    step(s)  # all three prefill and sample a token
    so, _ = step(s)
    assert so.preempted_req_ids == {victim}
    assert s.requests[victim].status == RequestStatus.PREEMPTED
    outputs = run_until_done(s)
    assert all(outputs[r.request_id][-1].finished for r in (a, b, c))
    assert_idle(s)


def test_preempted_request_waits_behind_better_priorities_only():
    s = make_scheduler(
        num_blocks=7, block_size=4, enable_prefix_caching=False, scheduling_policy="priority"
    )
    add(s, [0, 5, 1], max_tokens=6)
    step(s)
    step(s)  # req1 (priority 5) preempted
    (late,) = make_requests(1, 8, start=3, max_tokens=2, priority=9)
    s.add_request(late)
    assert [r.request_id for r in s.waiting] == ["req1", "req3"]
    run_until_done(s)
    assert_idle(s)


@pytest.mark.parametrize(("policy", "first"), [("priority", "text0"), ("fcfs", "mm0")])
def test_a_better_waiting_request_goes_before_a_deferred_one_under_priority(policy, first):
    ec = FakeECConnector()
    s = make_scheduler(max_num_seqs=1, ec_connector=ec, scheduling_policy=policy)
    (mm,) = make_requests(1, 12, mm_features=[image("img", 2, 8)], id_prefix="mm")
    s.add_request(mm)
    step(s)
    assert list(s.skipped_waiting) == [mm]  # deferred: its encoder output is not there yet
    ec.available.add("img")
    (text,) = make_requests(1, 6, id_prefix="text", priority=-1 if policy == "priority" else 0)
    s.add_request(text)
    so, _ = step(s)
    assert [n.req_id for n in so.scheduled_new_reqs] == [first]
    run_until_done(s)
    assert_idle(s)


def test_fcfs_refuses_a_priority_naming_the_field():
    s = make_scheduler()
    (r,) = make_requests(1, 8, priority=2)
    with pytest.raises(ValueError, match="priority"):
        s.add_request(r)
    assert_idle(s)


def test_queues_remove_and_iterate_in_admission_order():
    for queue, expected in ((FCFSQueue(), [0, 2, 3]), (PriorityQueue(), [3, 2, 0])):
        requests = make_requests(4, 4)
        for r, priority in zip(requests, [5, 4, 1, 0]):
            r.priority = priority
            queue.add_request(r)
        queue.remove_requests([requests[1]])
        assert [int(r.request_id[3:]) for r in queue] == expected
        assert queue.pop_request() is requests[expected[0]] and len(queue) == 2


def test_policy_from_yaml_engine_section_and_serve_flag(tmp_path):
    assert not ClusterConfig.model_validate({"prefill": {"count": 1}}).priority_scheduling()
    path = tmp_path / "topology.yaml"
    path.write_text("engine:\n  scheduling_policy: priority\nmixed:\n  count: 1\n")
    config = ClusterConfig.load(path)
    assert config.priority_scheduling()
    assert config.engine_config("mixed", "m").scheduler.scheduling_policy == "priority"
    args = build_parser().parse_args(["serve", "--scheduling-policy", "priority"])
    assert load_serve_config(args).priority_scheduling()
    bad = build_parser().parse_args(["serve", "--scheduling-policy", "lifo"])
    with pytest.raises(ValueError, match="scheduling_policy"):
        load_serve_config(bad)
    # One role scheduling first come, first served: a priority would not be honoured there.
    mixed = {"mixed": {"count": 1, "engine": {"scheduling_policy": "fcfs"}}}
    assert not ClusterConfig.load(path, mixed).priority_scheduling()


# ---- on 1P1D ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(ray_session, model_dir):
    # One request at a time on each instance: the queues decide who goes next.
    engine = {**SMALL_ENGINE, "max_num_seqs": 1, "scheduling_policy": "priority"}
    with start(model_dir, prefill=1, decode=1, engine=engine) as c:
        yield c


NUM_LOW = 6


def test_high_priority_request_behind_a_queue_of_low_ones_finishes_first(cluster):
    baseline = live_object_ids()
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    finished: list[str] = []

    async def run(request) -> None:
        async for out in cluster.stream(request):
            if out.finished:
                assert out.finish_reason == "length", out.error
                finished.append(request.request_id)

    async def main() -> str:
        lows = [cluster.make_request(f"low {i} " * 6, params, priority=10) for i in range(NUM_LOW)]
        tasks = [asyncio.create_task(run(r)) for r in lows]
        assert await until(lambda: cluster.front.num_in_flight() == NUM_LOW)
        high = cluster.make_request("high " * 6, params, priority=-10)
        tasks.append(asyncio.create_task(run(high)))
        await asyncio.gather(*tasks)
        return high.request_id

    high_id = asyncio.run(main())
    assert len(finished) == NUM_LOW + 1
    # At most the low requests already on P or D when it came finish before it.
    assert finished.index(high_id) <= 2, finished
    assert_clean(cluster, baseline)


def test_gateway_takes_priority_on_both_endpoints(cluster, base_url):
    baseline = live_object_ids()
    completion = {"model": cluster.model_name, "prompt": "x", "max_tokens": 2, "priority": -5}
    chat = {**completion, "messages": [{"role": "user", "content": "hi"}]}
    del chat["prompt"]
    for path, body in (("completions", completion), ("chat/completions", chat)):
        response = httpx.post(f"{base_url}/v1/{path}", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 2
    too_big = httpx.post(f"{base_url}/v1/completions", json={**completion, "priority": 2**40})
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "priority"
    assert_clean(cluster, baseline)
