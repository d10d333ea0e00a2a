"""Chaos under a streaming load: instances killed (Ray restarts them) while streams run on a
simulated cluster (`sim:`: real scheduler, block pools, connectors, actors and Front; only
the forward pass is modeled). Every stream moves off its dead instance and completes with
its full token count and the tokens an undisturbed run gives, nothing is left held on any
instance, and the restarted instances take traffic again. A request that loses its
instance more than `migration_limit` times ends with a clean error.

The real model's token identity across a move is in tests/test_cluster_faults.py."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import pytest

from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.llm import RequestOutput
from tests.cluster_utils import (
    Load,
    assert_clean,
    kill,
    live_object_ids,
    start,
    stats_by_id,
    wait_until,
)

SIM = "sim:h100-llama-3.1-8b"
ENGINE = {
    "block_size": 4, "num_blocks": 512, "max_num_batched_tokens": 512, "max_model_len": 512,
    "sim_time_scale": 4.0,  # ~25 ms a decode step: streams last long enough to be hit
}  # fmt: skip
STREAM = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
RESTART_TIMEOUT_S = 60.0
ROLES = ("prefill", "decode")


def roles(num_prefill: int, num_decode: int, cpus: float, **sections) -> dict:
    return {
        "engine": ENGINE,
        "prefill": {"count": num_prefill, "num_cpus": cpus},
        "decode": {"count": num_decode, "num_cpus": cpus},
        **sections,
    }


def prompts(n: int, seed: int) -> list[list[int]]:
    """Random token ids: no two share a first block, so routing spreads them by load alone
    (a shared prefix would send them all to the P that caches it)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 1500) for _ in range(rng.randint(8, 60))] for _ in range(n)]


def busiest(cluster, roles: tuple[str, ...], exclude: set[str]) -> str:
    """The live instance of `roles` (not in `exclude`) running or queueing the most
    requests (a P's requests whose KV awaits D's read do not count)."""
    stats = [s for s in stats_by_id(cluster).values() if s.role in roles and s.healthy]
    stats = [s for s in stats if s.instance_id not in exclude]
    return max(stats, key=lambda s: s.scheduler.num_running + s.scheduler.num_waiting).instance_id


def wait_back(cluster, killed: dict[str, int], timeout_s: float = RESTART_TIMEOUT_S) -> None:
    """Until every killed instance is up again (a new process) and healthy to the Front."""

    def back() -> bool:
        stats = stats_by_id(cluster)
        return all(stats[i].healthy and stats[i].pid not in (None, pid)
                   for i, pid in killed.items())  # fmt: skip

    assert wait_until(back, timeout_s), cluster.stats()


def run_chaos(
    cluster,
    num_streams: int,
    num_kills: int,
    expected: Callable,
    restart_timeout_s: float = RESTART_TIMEOUT_S,
) -> None:
    """Two waves of streams; a D (decoding the first wave) and a P (prefilling the second)
    killed as the second starts, more once it streams (D decoding it, P holding its KV or
    prefilling); then every stream checked, the cluster checked clean, and a third wave
    served with the restarted instances taking part."""
    baseline = live_object_ids()
    moves = cluster.front.num_moves
    rng = random.Random(num_streams)
    killed: dict[str, int] = {}

    def kill_one(role: str) -> None:
        alive = [i for i, (r, _) in cluster.instances.items() if r == role and i not in killed]
        victim = busiest(cluster, (role,), set(killed)) if role == "decode" else rng.choice(alive)
        killed[victim] = kill(cluster, victim)

    async def scenario() -> list[RequestOutput]:
        load = Load(cluster, STREAM)
        first = load.add(prompts(num_streams // 2, seed=1))
        assert await load.all_have(first, 8)
        second = load.add(prompts(num_streams - num_streams // 2, seed=2))
        kill_one("decode")
        kill_one("prefill")
        assert await load.all_have(second, 1)
        for i in range(num_kills - 2):
            kill_one("decode" if i % 2 == 0 else "prefill")
        return await load.done()

    results = asyncio.run(scenario())
    for result in results:
        assert result.finish_reason == "length", result.outputs[0].error
        assert len(result.token_ids) == STREAM.max_tokens
    assert [r.token_ids for r in results] == expected([r.prompt_token_ids for r in results])
    assert cluster.front.num_moves > moves  # streams really moved
    wait_back(cluster, killed, restart_timeout_s)
    assert_clean(cluster, baseline, timeout_s=60)

    again = cluster.generate(prompts(num_streams, seed=3), STREAM)
    assert all(len(o.token_ids) == STREAM.max_tokens for o in again)
    stats = stats_by_id(cluster)
    took = {i: stats[i].kv_transfer.num_loads if stats[i].role == "decode"
            else stats[i].kv_transfer.num_sends for i in killed}  # fmt: skip
    assert all(took.values()), took  # each restarted instance served some of the third wave
    assert_clean(cluster, baseline, timeout_s=60)


@pytest.fixture(scope="module")
def sim_reference():
    llm = LLM(SIM, **ENGINE)
    return lambda token_ids, params=STREAM: [
        o.token_ids for o in llm.generate([{"prompt_token_ids": t} for t in token_ids], params)
    ]


def test_streams_survive_instances_killed_under_load(ray_session, sim_reference):
    """2P2D, 16 streams, a D and a P killed mid-stream. Under kv_load_failure_policy 'fail'
    a D whose P died before it read the KV reports the request unavailable, and the stream
    moves too."""
    config = roles(2, 2, 0.5, connector={"kv_load_failure_policy": "fail"})
    with start(SIM, **config) as cluster:
        run_chaos(cluster, num_streams=16, num_kills=2, expected=sim_reference)


@pytest.mark.slow
def test_streams_survive_instances_killed_under_load_at_32_instances(ray_session, sim_reference):
    """8P24D, 64 streams, eight instances killed while they run. Eight restarts beside 32
    live instances take minutes on two cores."""
    with start(SIM, **roles(8, 24, 0.2)) as cluster:
        run_chaos(cluster, 64, 8, sim_reference, restart_timeout_s=600)


@pytest.mark.slow  # ~22 s; migration under kills stays in the default run
def test_a_stream_moves_at_most_migration_limit_times(ray_session):
    """migration_limit 1: the first death (D's) moves the stream, the second (of whichever
    instance then serves it: P colocated, or D restarted) ends it with a clean error; the
    client keeps every token it got."""
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with start(SIM, **roles(1, 1, 0.5, router={"migration_limit": 1})) as cluster:
        baseline = live_object_ids()
        killed: dict[str, int] = {}

        async def scenario() -> RequestOutput:
            load = Load(cluster, long)
            (result,) = load.add(prompts(1, seed=4))
            for round_ in (1, 2):
                assert await load.all_have([result], 10 * round_)
                victim = busiest(cluster, ("decode",) if round_ == 1 else ROLES, set())
                killed[victim] = kill(cluster, victim)
            return (await load.done())[0]

        result = asyncio.run(scenario())
        error = result.outputs[0].error or ""
        assert result.finish_reason == "error" and "moved 1 times" in error, error
        assert 20 <= len(result.token_ids) < long.max_tokens
        assert cluster.front.num_moves == 1
        wait_back(cluster, killed)
        assert_clean(cluster, baseline, timeout_s=60)


@pytest.mark.slow  # ~25 s; migration under kills stays in the default run
def test_streams_move_off_an_instance_whose_drain_timed_out(ray_session, sim_reference):
    """Scaling decode 2 -> 1 drains the newest D; its streams outlast `drain_timeout_s`, so
    the pool removes it with streams still on it, and they move to the other D and finish."""
    long = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    config = roles(1, 2, 0.5)
    config["decode"]["drain_timeout_s"] = 0.5
    with start(SIM, **config) as cluster:
        baseline = live_object_ids()
        leaving = max((i for i, (r, _) in cluster.instances.items() if r == "decode"),
                      key=lambda i: int(i.rsplit("-", 1)[1]))  # fmt: skip

        async def scenario() -> list[RequestOutput]:
            load = Load(cluster, long)
            streams = load.add(prompts(8, seed=5))
            assert await load.all_have(streams, 8)
            assert stats_by_id(cluster)[leaving].scheduler.num_running > 0
            members = await cluster.scale("decode", 1)
            assert leaving not in members
            return await load.done()

        results = asyncio.run(scenario())
        assert [r.finish_reason for r in results] == ["length"] * len(results)
        assert [r.token_ids for r in results] == sim_reference(
            [r.prompt_token_ids for r in results], long
        )
        assert cluster.front.num_moves > 0
        assert wait_until(lambda: leaving not in cluster.instances)
        assert_clean(cluster, baseline, timeout_s=60)
