"""Tensor-parallel instances in the cluster: P and D at TP 1 or 2 (ranks 1.. as Ray worker
actors on the instance's node) serve what one colocated TP1 engine serves, token for token,
the KV moving as whole blocks whatever either side's TP."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest

from pdcluster.engine import LLM
from tests.cluster_utils import (
    GREEDY,
    SMALL_ENGINE,
    Load,
    assert_clean,
    live_object_ids,
    mixed_prompts,
    start,
    wait_until,
)


@pytest.fixture(scope="module")
def tp_model(preset_dir):
    return preset_dir("tiny-llama")


@pytest.fixture(scope="module")
def tp1_reference(tp_model):
    llm = LLM(tp_model, **SMALL_ENGINE)
    prompts = mixed_prompts(with_images=False)
    outputs = llm.generate(prompts, GREEDY)
    return prompts, [o.token_ids for o in outputs], llm.engine.runner.kv_cache.nbytes


def role(tp: int) -> dict:
    return {"count": 1, "num_cpus": 1, "engine": {"tensor_parallel_size": tp}}


@pytest.mark.parametrize(
    "p_tp, d_tp",
    [
        (2, 2),
        pytest.param(2, 1, marks=pytest.mark.slow),
        pytest.param(1, 2, marks=pytest.mark.slow),
    ],
    ids=["P2-D2", "P2-D1", "P1-D2"],
)  # P2-D1 and P1-D2's blocks between TP sizes: test_tensor_parallel.py, in the default run
def test_1p1d_at_tp_matches_colocated_tp1(ray_session, tp_model, tp1_reference, p_tp, d_tp):
    prompts, expected_ids, tp1_kv_bytes = tp1_reference
    with start(tp_model, prefill=role(p_tp), decode=role(d_tp)) as cluster:
        baseline = live_object_ids()
        outputs = cluster.generate(prompts, GREEDY)
        assert [o.token_ids for o in outputs] == expected_ids
        assert_clean(cluster, baseline)  # every block free on every instance
        stats = cluster.stats()
    assert sum(s.kv_transfer.num_loads for s in stats if s.role == "decode") == len(prompts)
    # Rank 0's KV cache holds its share of tiny-llama's 2 KV heads only.
    kv_bytes = {s.role: s.kv_cache_bytes for s in stats}
    assert kv_bytes == {"prefill": tp1_kv_bytes // p_tp, "decode": tp1_kv_bytes // d_tp}


LONG = dataclasses.replace(GREEDY, max_tokens=400)  # streams still running when a rank dies


@pytest.mark.slow
def test_dead_worker_ends_its_instance_and_streams_move(ray_session, tp_model):
    """SIGKILL of one TP worker: its instance exits (a crash to Ray, which restarts it with
    new workers), its streams move to the other instance and end as an undisturbed run.
    (The engine's half, RankLost on the next step, runs in the default suite.)"""
    prompts = mixed_prompts(with_images=False)
    expected = [o.token_ids for o in LLM(tp_model, **SMALL_ENGINE).generate(prompts, LONG)]
    with start(tp_model, mixed={**role(2), "count": 2}) as cluster:
        baseline = live_object_ids()

        async def run() -> list:
            load = Load(cluster, LONG)
            results = load.add(prompts)
            assert await load.all_have(results, 4)
            victim = max(cluster.stats(), key=lambda s: s.scheduler.num_running)
            os.kill(victim.tensor_parallel.worker_pids[0], signal.SIGKILL)
            return victim, await load.done()

        victim, outputs = asyncio.run(run())
        assert [o.token_ids for o in outputs] == expected

        def back() -> bool:
            stats = {s.instance_id: s for s in cluster.stats()}[victim.instance_id]
            return stats.healthy and stats.pid not in (None, victim.pid)

        assert wait_until(back, 120)
        # The new workers' handles and `run` calls live as long as their instance.
        worker_ids = [w for s in cluster.stats() for w in s.tensor_parallel.worker_actor_ids]
        workers = {o for o in live_object_ids() if any(w in o for w in worker_ids)}
        assert_clean(cluster, baseline | workers)
