"""Instances join and leave at run time: scaling under a streaming load, drains that lose
nothing (a P holding KV for a D included), the planner, and a pool that outlives its
controller's and its gateway's restarts."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import ray

from pdcluster.cluster.control.launch import launch
from pdcluster.routing.role import Role
from tests.cluster_utils import (
    GREEDY,
    assert_clean,
    cluster_config,
    collect,
    live_object_ids,
    start,
    stats_by_id,
    until,
    wait_until,
)

LONG = dataclasses.replace(GREEDY, max_tokens=48)
PROMPTS = [f"Request number {i} asks about the sea" for i in range(12)]


def _ids(cluster, role: str) -> list[str]:
    return sorted((i for i, (r, _) in cluster.instances.items() if r == role), key=_index)


def _index(instance_id: str) -> int:
    return int(instance_id.rsplit("-", 1)[1])


async def _stream_all(cluster, prompts, params=LONG):
    requests = [cluster.make_request(p, params) for p in prompts]
    return [asyncio.create_task(collect(cluster, r)) for r in requests]


def test_scale_up_then_down_under_load_serves_on_the_new_instance_and_loses_nothing(
    ray_session, model_dir, reference
):
    with start(model_dir, prefill=1, decode=1) as cluster:
        baseline = live_object_ids()

        before = ray.get(cluster.controller.members_after.remote(None, -1, 0.0))
        # a replica's long-poll: answered when the pool changes, not after its wait
        waiting = cluster.controller.members_after.remote(before.epoch, before.version, 600.0)

        async def scale_up():
            first = await _stream_all(cluster, PROMPTS[:6])
            members = await cluster.scale("decode", 2)  # while those stream
            assert await until(lambda: len(_ids(cluster, "decode")) == 2)
            second = await _stream_all(cluster, PROMPTS[6:])
            return members, await asyncio.gather(*first, *second)

        members, outs = asyncio.run(scale_up())
        assert sorted(members.values()) == ["decode", "decode", "prefill"]
        assert ray.get(waiting, timeout=60).members == members
        del waiting  # a live ref would count as a leaked object
        for prompt, out in zip(PROMPTS, outs):
            assert out.finish_reason == "length"
            assert out.token_ids == reference(prompt, LONG).token_ids  # colocated's tokens
        leaving = _ids(cluster, "decode")[1]  # the new D, the newest: it drains first

        async def scale_down():
            tasks = await _stream_all(cluster, PROMPTS)
            # the new D takes traffic (right after it joined, a busy host may have made its
            # first answer late, and the router send the second batch to the old D first)
            assert await until(lambda: stats_by_id(cluster)[leaving].scheduler.num_running > 0)
            members = await cluster.scale("decode", 1)  # drains the newest D mid-stream
            return members, await asyncio.gather(*tasks)

        members, outs = asyncio.run(scale_down())
        assert leaving not in members
        assert wait_until(lambda: leaving not in cluster.instances)
        assert [o.finish_reason for o in outs] == ["length"] * len(PROMPTS)
        assert all(o.token_ids == reference(p, LONG).token_ids for p, o in zip(PROMPTS, outs))
        assert_clean(cluster, baseline)


def test_a_draining_prefill_holds_its_kv_until_decode_reads_it(ray_session, model_dir, reference):
    """P1, the newest P, holds a prompt's KV for a paused D when it is told to leave: the
    drain waits for D's read, and nothing is lost or leaked."""
    with start(model_dir, prefill=2, decode=1) as cluster:
        baseline = live_object_ids()
        p0_id, p1_id = _ids(cluster, "prefill")
        p0, p1 = cluster.instances[p0_id][1], cluster.instances[p1_id][1]
        decode = cluster.instances[_ids(cluster, "decode")[0]][1]
        ray.get([p0.pause.remote(), p1.pause.remote(), decode.pause.remote()])
        waiting = lambda iid: stats_by_id(cluster)[iid].scheduler.num_waiting  # noqa: E731

        async def scenario():
            tasks = await _stream_all(cluster, ["first prompt", "second prompt"], GREEDY)
            assert await until(lambda: waiting(p0_id) == 1 and waiting(p1_id) == 1)
            ray.get(p1.resume.remote())  # P1 prefills its prompt and holds the KV for D
            assert await until(lambda: stats_by_id(cluster)[p1_id].scheduler.num_pending_sends == 1)
            scaling = asyncio.ensure_future(cluster.scale("prefill", 1))
            assert await until(lambda: not cluster.front.policy.instances[p1_id].healthy)
            assert not scaling.done()  # P1 drains: it still holds the KV D has not read
            ray.get([p0.resume.remote(), decode.resume.remote()])
            return await scaling, await asyncio.gather(*tasks)

        members, (first, second) = asyncio.run(scenario())
        assert p1_id not in members and len(members) == 2
        assert first.token_ids == reference("first prompt").token_ids
        assert second.token_ids == reference("second prompt").token_ids
        assert_clean(cluster, baseline)


@pytest.mark.slow  # ~20 s; the planner's decisions have unit tests (test_planner.py)
def test_the_planner_scales_prefill_up_on_a_burst_and_down_after_it(ray_session, model_dir):
    autoscale = {
        "prefill": {"min": 1, "max": 2, "target_queued_prefill_tokens": 64},
        "interval_s": 0.2,
        "scale_up_cooldown_s": 0.5,
        "scale_down_cooldown_s": 1.0,
    }
    config = cluster_config(model_dir, prefill=1, decode=1, autoscale=autoscale)
    with launch(config) as cluster:
        p0 = cluster.instances[_ids(cluster, "prefill")[0]][1]
        ray.get(p0.pause.remote())  # a prefill-heavy burst that P0 cannot drain

        async def burst():
            tasks = await _stream_all(cluster, [p * 6 for p in PROMPTS[:6]], GREEDY)
            assert await until(lambda: len(_ids(cluster, "prefill")) == 2, 120)
            ray.get(p0.resume.remote())
            return await asyncio.gather(*tasks)

        outs = asyncio.run(burst())
        assert [o.finish_reason for o in outs] == ["length"] * 6
        assert wait_until(lambda: len(_ids(cluster, "prefill")) == 1, 120)  # burst over
        state = ray.get(cluster.controller.planner_state.remote())
        decisions = {(d.role, d.direction): d.count for d in state.decisions}
        assert decisions[(Role.PREFILL, "up")] >= 1 and decisions[(Role.PREFILL, "down")] >= 1
        assert state.desired[Role.PREFILL] == 1
        assert state.round_s > 0  # a round (reading every instance, deciding) was timed


def test_the_pool_survives_restarts_of_its_controller_and_gateway(ray_session, model_dir):
    config = cluster_config(model_dir, prefill=1, decode=1)
    with launch(config) as cluster:
        asyncio.run(cluster.scale("decode", 2))
        members = ray.get(cluster.controller.members.remote())
        ray.kill(cluster.controller, no_restart=False)  # restarted by Ray

        def controller_back() -> bool:
            try:
                return ray.get(cluster.controller.members.remote(), timeout=5) == members
            except ray.exceptions.RayError:
                return False

        assert wait_until(controller_back, 60)
        second = launch(config, pool=cluster.pool)  # a restarted gateway attaches
        try:
            assert sorted(second.instances) == sorted(members)
            out = second.generate("after both restarts", GREEDY)[0]
            assert out.finish_reason == "length"
        finally:
            second.shutdown()


def test_scale_through_the_api_the_gateway_and_the_cli(ray_session, model_dir, capsys):
    import httpx

    from pdcluster.cluster.cli import main
    from pdcluster.cluster.replicas import gateway_app
    from tests.gateway_utils import running

    key = "sekret"
    cluster = start(model_dir, mixed=1, gateway={"api_key": key})
    with cluster, running(gateway_app(cluster)) as url:
        with pytest.raises(ValueError, match="leaves none to serve"):
            asyncio.run(cluster.scale("mixed", 0))
        with pytest.raises(ValueError, match="role must be one of"):
            asyncio.run(cluster.scale("gpu", 1))
        assert len(cluster.instances) == 1
        endpoint = f"{url}/v1/admin/scale"
        body = {"role": "mixed", "count": 2}
        assert httpx.post(endpoint, json=body, timeout=60).status_code == 401
        auth = {"Authorization": f"Bearer {key}"}
        bad = httpx.post(endpoint, json={"role": "gpu", "count": 1}, headers=auth)
        assert bad.status_code == 400 and "role" in bad.json()["error"]["message"]
        response = httpx.post(endpoint, json=body, headers=auth, timeout=300)
        assert response.status_code == 200, response.text
        assert response.json()["count"] == 2
        args = ["scale", "--url", url, "--api-key", key, "--role", "mixed", "--count", "1"]
        assert main(args) == 0
        assert capsys.readouterr().out.startswith("mixed: 1 instances")
        assert wait_until(lambda: len(cluster.instances) == 1)
        refused = ["scale", "--url", url, "--api-key", key, "--role", "mixed", "--count", "0"]
        assert main(refused) == 2
        assert "leaves none to serve" in capsys.readouterr().err
