"""Tensor-parallel instances in the cluster: P and D at TP 1 or 2 (ranks 1.. as Ray worker
actors on the instance's node) serve what one colocated TP1 engine serves, token for token,
the KV moving as whole blocks whatever either side's TP."""

from __future__ import annotations

import pytest

from engine import LLM
from tests.cluster_utils import (
    GREEDY,
    SMALL_ENGINE,
    assert_clean,
    live_object_ids,
    mixed_prompts,
    start,
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
)
def test_1p1d_at_tp_matches_colocated_tp1(ray_session, tp_model, tp1_reference, p_tp, d_tp):
    prompts, expected_ids, tp1_kv_bytes = tp1_reference
    with start(tp_model, prefill=role(p_tp), decode=role(d_tp)) as cluster:
        baseline = live_object_ids()
        outputs = cluster.generate(prompts, GREEDY)
        assert [o.token_ids for o in outputs] == expected_ids
        assert_clean(cluster, baseline)  # every block free on every instance
        stats = cluster.stats()
    assert sum(s.get("num_loads", 0) for s in stats if s["role"] == "decode") == len(prompts)
    # Rank 0's KV cache holds its share of tiny-llama's 2 KV heads only.
    kv_bytes = {s["role"]: s["kv_cache_bytes"] for s in stats}
    assert kv_bytes == {"prefill": tp1_kv_bytes // p_tp, "decode": tp1_kv_bytes // d_tp}
