"""Tensor parallelism inside one instance (no Ray): TP2 serves what TP1 serves, in float32,
with the rank-1 worker a local process."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from pdcluster.engine.llm import LLM
from pdcluster.engine.parallel import RankLost
from pdcluster.engine.sampling_params import SamplingParams
from tests.arch_checkpoints import make_checkpoint

NUM_TOP = 5  # top logprobs compared per position
TOL = 1e-4
PROMPTS = [
    [5, 9, 100, 33, 7, 250, 11, 60],
    [400 + i for i in range(37)],  # several blocks, several chunks with a small budget
    [3, 1000, 42],
]
GREEDY = SamplingParams(
    temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=NUM_TOP, prompt_logprobs=NUM_TOP
)


def generate(model: str, tp: int, **engine_args) -> list:
    llm = LLM(model, dtype="float32", tensor_parallel_size=tp, num_blocks=64, **engine_args)
    try:
        # [blocks, layers, 2, block_size, kv_heads, head_dim]: this rank's heads only
        num_kv_heads = llm.engine.model_info.num_kv_heads
        assert llm.engine.runner.kv_cache.shape[4] == num_kv_heads // tp
        batched = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
        one = llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY)
        blocks = llm.engine.scheduler.kv_cache_manager.block_pool
        assert blocks.get_num_free_blocks() == blocks.num_usable_blocks
    finally:
        llm.engine.shutdown()
    return batched + one


def assert_same(tp1: list, tp2: list) -> None:
    for a, b in zip(tp1, tp2, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert cb.token_ids == ca.token_ids
        assert cb.logprobs == pytest.approx(ca.logprobs, abs=TOL)
        for ta, tb in zip(ca.top_logprobs, cb.top_logprobs, strict=True):
            assert tb.token_ids == ta.token_ids
            assert tb.logprobs == pytest.approx(ta.logprobs, abs=TOL)
        assert b.prompt_logprobs.logprobs == pytest.approx(a.prompt_logprobs.logprobs, abs=TOL)


@pytest.fixture(scope="module")
def moe_dir(preset_dir, tmp_path_factory):
    return str(
        make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe"), preset_dir("tiny-llama"))
    )


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_tp2_equals_tp1_llama(preset_dir, chunked):
    budget = {"max_num_batched_tokens": 16} if chunked else {}
    model = preset_dir("tiny-llama")
    assert_same(generate(model, 1, **budget), generate(model, 2, **budget))


@pytest.mark.slow
def test_tp2_equals_tp1_moe(moe_dir):
    assert_same(generate(moe_dir, 1), generate(moe_dir, 2))


ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1)


def test_tp2_kv_blocks_carry_every_head_in_tp1s_order(preset_dir):
    """What a P->D handoff between TP sizes moves (test_tensor_parallel_cluster.py runs
    P2->D1 and P1->D2 on a cluster, slow): blocks read on TP2 hold every rank's heads as TP1
    holds them, and full-head blocks written on TP2 read back as given."""
    model = preset_dir("tiny-llama")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    tp1 = LLM(model, dtype="float32", num_blocks=64)
    tp1.generate(prompts, ONE_TOKEN)
    want = tp1.engine.runner.kv_cache.clone()  # [blocks, layers, 2, block_size, heads, dim]
    tp2 = LLM(model, dtype="float32", tensor_parallel_size=2, num_blocks=64)
    try:
        tp2.generate(prompts, ONE_TOKEN)
        group = tp2.engine.tp
        assert group.block_shape == want.shape[1:]
        assert want.abs().sum() > 0
        torch.testing.assert_close(group.read_blocks(0, len(want)), want, atol=TOL, rtol=0)
        flipped = want.flip(0)  # every block somewhere else: each rank writes its heads
        group.write_blocks(0, flipped)
        torch.testing.assert_close(group.read_blocks(0, len(want)), flipped, atol=0, rtol=0)
    finally:
        tp2.engine.shutdown()


def test_a_dead_worker_is_a_lost_rank_not_a_hang(preset_dir):
    """The engine half of test_tensor_parallel_cluster.py's dead worker (slow): the next
    step after a rank's process dies raises RankLost, which ends the instance."""
    llm = LLM(preset_dir("tiny-llama"), dtype="float32", tensor_parallel_size=2, num_blocks=64)
    try:
        (pid,) = llm.engine.tp.stats()["tp_worker_pids"]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RankLost, match="tensor-parallel rank lost"):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, ONE_TOKEN)
    finally:
        llm.engine.shutdown()


def test_tp_size_that_cannot_split_is_a_clear_error(preset_dir):
    # tiny-llama has 2 KV heads: 3 ranks cannot each hold one.
    with pytest.raises(ValueError, match="tensor_parallel_size 3 exceeds .*num_key_value_heads 2"):
        LLM(preset_dir("tiny-llama"), tensor_parallel_size=3)


def test_tp_size_per_role_and_on_serve():
    from pdcluster.cluster.cli import build_parser
    from pdcluster.cluster.config import ClusterConfig
    from pdcluster.cluster.serve_flags import load_serve_config

    config = ClusterConfig.model_validate(
        {"model": "m", "prefill": {"count": 1, "engine": {"tensor_parallel_size": 2}}}
    )
    assert config.engine_config("prefill", "m").tensor_parallel_size == 2
    assert config.engine_config("decode", "m").tensor_parallel_size == 1
    args = build_parser().parse_args(["serve", "--model", "m", "--tensor-parallel-size", "2"])
    served = load_serve_config(args)
    assert {served.engine_config(r, "m").tensor_parallel_size for r in ("prefill", "decode")} == {2}
