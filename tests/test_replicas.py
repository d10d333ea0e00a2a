"""Several gateway replicas over one instance pool: each plans its own requests and reads
its tokens straight from the instances, routing by the prefix-cache events instances
publish; a dead replica's requests are aborted on every instance."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
import ray

from pdcluster.cluster.control.launch import launch
from pdcluster.cluster.replicas import gateway_app, start_replicas
from tests.cluster_utils import (
    GREEDY,
    assert_clean,
    cluster_config,
    handle,
    instance_stats,
    live_object_ids,
    wait_until,
)
from tests.gateway_utils import running

MODEL = "tiny"
LONG = dataclasses.replace(GREEDY, max_tokens=400)


def _config(model_dir, **extra):
    return cluster_config(model_dir, gateway={"served_model_name": MODEL}, **extra)


@pytest.mark.slow  # ~15 s; prefix routing has unit tests (test_routing_policy.py)
def test_two_replicas_route_the_same_prefix_to_the_same_prefill(ray_session, model_dir):
    # decode_prefix_fraction 1.0: the prompt is never prefilled on D, however much D caches
    config = _config(model_dir, prefill=2, decode=1, router={"decode_prefix_fraction": 1.0})
    with launch(config) as first:
        second = launch(config, pool=first.pool)  # attaches: no second pool
        try:
            assert sorted(second.instances) == sorted(first.instances)
            prefix = "The same long system prompt for every request, " * 4
            out = first.generate(prefix + "first question", GREEDY)[0]
            tokens = second.make_request(prefix + "second question").prompt_token_ids
            chosen = {}

            def both_agree() -> bool:  # once P's cache events reached the second replica
                chosen["first"] = first.front.policy.plan(tokens).prefill_id
                chosen["second"] = second.front.policy.plan(tokens).prefill_id
                loads = second.front.policy.instances[chosen["second"]]
                return chosen["first"] == chosen["second"] and len(loads.cached_blocks) > 0

            assert wait_until(both_agree), chosen
            again = second.generate(prefix + "second question", GREEDY)[0]
            assert again.num_cached_tokens > 0  # the prefix was reused on that P
            assert out.finish_reason == again.finish_reason == "length"
        finally:
            second.shutdown()  # detaches only: the pool is the first's


def instance_stats_by_id(cluster, instance_id: str) -> dict:
    return next(s for s in cluster.stats() if s.instance_id == instance_id)


@pytest.mark.slow  # ~22 s; restarts under one replica stay in test_cluster_faults.py
def test_an_instance_restart_is_seen_by_every_replica(ray_session, model_dir):
    config = _config(model_dir, prefill=1, decode=1)
    with launch(config) as first:
        second = launch(config, pool=first.pool)
        try:
            prefill_id = next(i for i, (r, _) in first.instances.items() if r == "prefill")
            pid = instance_stats(first, "prefill").pid
            ray.kill(handle(first, "prefill"), no_restart=False)

            def restarted(cluster) -> bool:
                stats = instance_stats_by_id(cluster, prefill_id)
                return stats.pid != pid and stats.healthy

            for cluster in (first, second):
                assert wait_until(lambda c=cluster: restarted(c), 90)
                assert wait_until(lambda c=cluster: c.front.policy.instances[prefill_id].healthy)
                out = cluster.generate("after the restart", GREEDY)[0]
                assert out.finish_reason == "length" and len(out.token_ids) == 16
        finally:
            second.shutdown()


def _stream_body(max_tokens: int) -> dict:
    return {
        "model": MODEL,
        "prompt": "Tell me a long story",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }


async def _clients(url: str, num: int, max_tokens: int) -> list[str]:
    """`num` concurrent streaming completions on fresh connections; each one's outcome."""

    async def one() -> str:
        try:
            async with (
                httpx.AsyncClient(timeout=120) as client,
                client.stream(
                    "POST", f"{url}/v1/completions", json=_stream_body(max_tokens)
                ) as response,
            ):
                text = "".join([chunk async for chunk in response.aiter_text()])
            return "ok" if text.rstrip().endswith("data: [DONE]") else f"bad: {text[-200:]}"
        except httpx.HTTPError as exc:
            return f"failed: {type(exc).__name__}"

    return list(await asyncio.gather(*(one() for _ in range(num))))


def test_two_replicas_share_one_address_under_load_with_no_leak(ray_session, model_dir):
    with launch(_config(model_dir, prefill=1, decode=1)) as cluster:
        baseline = live_object_ids()
        with running(gateway_app(cluster)) as url:
            port = int(url.rsplit(":", 1)[1])
            replicas = start_replicas(cluster.config, cluster.pool, "127.0.0.1", port, 1)
            replica = replicas[0]
            try:
                assert wait_until(lambda: ray.get(replica.started.remote()), 60)
                outcomes = asyncio.run(_clients(url, 32, 8))
                assert outcomes == ["ok"] * 32
                started, in_flight = ray.get(replica.counts.remote())
                assert started > 0 and cluster.front.num_started > 0  # both served
                assert started + cluster.front.num_started == 32
                assert in_flight == 0
            finally:
                ray.kill(replica, no_restart=True)
                replicas.clear()  # a killed replica's handle is no object to account for
                replica = None
        assert_clean(cluster, baseline)


def test_a_killed_replica_fails_only_its_own_streams(ray_session, model_dir):
    """Kill one of two replicas while both stream: its clients see a broken stream, the
    other's finish; the instances abort the dead replica's requests once it stops pulling,
    and hold nothing afterwards."""
    config = _config(model_dir, prefill=1, decode=1, router={"stream_idle_timeout_s": 2.0})
    with launch(config) as cluster:
        baseline = live_object_ids()
        with running(gateway_app(cluster)) as url:
            port = int(url.rsplit(":", 1)[1])
            replicas = start_replicas(cluster.config, cluster.pool, "127.0.0.1", port, 1)
            assert wait_until(lambda: ray.get(replicas[0].started.remote()), 60)

            async def scenario() -> list[str]:
                victim = replicas.pop()  # the killed replica's handle is no object to account for
                clients = asyncio.ensure_future(_clients(url, 16, 300))
                decode = lambda: instance_stats(cluster, "decode").scheduler.num_running  # noqa: E731
                while decode() < 4 or ray.get(victim.counts.remote())[1] == 0:
                    await asyncio.sleep(0.05)
                ray.kill(victim, no_restart=True)
                return await clients

            outcomes = asyncio.run(scenario())
            ours = cluster.front.num_started
            assert outcomes.count("ok") == ours  # every stream of the survivor finished
            assert 0 < ours < 16 and all(o.startswith(("failed", "bad")) for o in outcomes
                                          if o != "ok")  # fmt: skip
        assert_clean(cluster, baseline, timeout_s=60)
