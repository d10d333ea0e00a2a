"""n > 1 sequences of one prompt: the prompt's KV computed once (engine and cluster), seeded
children reproducible and distinct, disaggregated equal to colocated, aborts clean."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.request import Request
from pdcluster.routing.fanout import fan_out
from tests.cluster_utils import (
    SMALL_ENGINE,
    assert_clean,
    instance_stats,
    live_object_ids,
    start,
)

N = 4
BLOCK = SMALL_ENGINE["block_size"]
PROMPT = list(range(40, 73))  # 33 tokens: 8 full blocks of 4, then 1 token
SHARED_TOKENS = (len(PROMPT) - 1) // BLOCK * BLOCK  # what a child can find cached: 32
SEEDED = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)


def run(llm: LLM, requests: list[Request]) -> dict[str, list[int]]:
    """Token ids of each request, all added before the first step."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for request in requests:
        llm.engine.add_request(request)
    pending = set(tokens)
    while pending:
        for out in llm.engine.step()[0]:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                pending.discard(out.request_id)
    while llm.engine.has_work():
        llm.engine.step()
    return tokens


def children(
    llm: LLM, rid: str, params: SamplingParams, n: int = N, prompt: list[int] = PROMPT
) -> list[Request]:
    return fan_out(llm.processor.process(rid, {"prompt_token_ids": prompt}, params), n)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, **SMALL_ENGINE)


# ---- engine ------------------------------------------------------------------------------
def test_children_compute_the_prompt_once(llm):
    hits_before = llm.engine.stats()["prefix_cache_hits"]
    unseen = [300, *PROMPT[1:]]  # cached by no other test
    run(llm, children(llm, "once", dataclasses.replace(SEEDED, seed=None), prompt=unseen))
    stats = llm.engine.stats()
    # Every child but the first found the prompt's full blocks cached in the same step.
    assert stats["prefix_cache_hits"] - hits_before == (N - 1) * SHARED_TOKENS
    assert stats["num_blocks_free"] == stats["num_blocks_total"]


def test_seeded_children_are_reproducible_distinct_and_child_0_is_the_request(llm):
    first = list(run(llm, children(llm, "a", SEEDED)).values())
    again = list(run(llm, children(llm, "b", SEEDED)).values())
    alone = run(llm, children(llm, "c", SEEDED, n=1))["c"]
    assert first == again
    assert len({tuple(t) for t in first}) == N
    assert first[0] == alone


def test_a_seeded_continuation_samples_what_the_whole_request_did(llm):
    """What D does after P's first token: same positions, same draws."""
    whole = run(llm, children(llm, "whole", SEEDED, n=1))["whole"]
    rest = dataclasses.replace(SEEDED, max_tokens=SEEDED.max_tokens - 1)
    prompt = {"prompt_token_ids": [*PROMPT, whole[0]]}
    assert run(llm, [llm.processor.process("rest", prompt, rest)])["rest"] == whole[1:]


# ---- cluster -----------------------------------------------------------------------------
async def stream_all(cluster, requests: list[Request]) -> tuple[list[list[int]], list[int]]:
    """Each request's tokens, and the prompt tokens its first instance found cached."""
    tokens: list[list[int]] = [[] for _ in requests]
    cached: list[int | None] = [None] * len(requests)
    async for index, out in cluster.stream_group(requests):
        assert out.finish_reason != "error", out.error
        tokens[index] += out.new_token_ids
        if cached[index] is None:
            cached[index] = out.num_cached_tokens
    return tokens, cached


@pytest.fixture(scope="module")
def pd(ray_session, model_dir):
    with start(model_dir, prefill=1, decode=1) as cluster:
        yield cluster


def test_disaggregated_children_equal_colocated_and_share_the_prompt_on_prefill(pd, llm):
    baseline = live_object_ids()
    expected = list(run(llm, children(llm, "local", SEEDED)).values())
    p_before, d_before = instance_stats(pd, "prefill"), instance_stats(pd, "decode")
    requests = fan_out(pd.make_request({"prompt_token_ids": PROMPT}, SEEDED), N)
    tokens, cached_on_prefill = asyncio.run(stream_all(pd, requests))
    assert tokens == expected
    assert_clean(pd, baseline)
    # P computed the prompt's full blocks once: every other child found them cached.
    assert sorted(cached_on_prefill) == [0] + [SHARED_TOKENS] * (N - 1)
    p_after, d_after = instance_stats(pd, "prefill"), instance_stats(pd, "decode")
    hits = p_after.scheduler.prefix_cache_hits - p_before.scheduler.prefix_cache_hits
    assert hits >= (N - 1) * SHARED_TOKENS
    # Each child's KV reaches D through the connector on its own: one load per child.
    assert d_after.kv_transfer.num_loads - d_before.kv_transfer.num_loads == N


def test_leaving_a_group_early_aborts_every_child_everywhere(pd):
    baseline = live_object_ids()
    params = SamplingParams(temperature=1.0, max_tokens=400, ignore_eos=True)
    requests = fan_out(pd.make_request({"prompt_token_ids": PROMPT}, params), N)

    async def leave_after_some_tokens() -> set[int]:
        seen: set[int] = set()
        stream = pd.stream_group(requests)
        async for index, out in stream:
            seen.add(index)
            if len(seen) == N and out.new_token_ids:
                break
        await stream.aclose()
        return seen

    assert asyncio.run(leave_after_some_tokens()) == set(range(N))
    assert_clean(pd, baseline)


def test_a_failed_child_ends_alone_and_leaves_nothing(pd):
    baseline = live_object_ids()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    requests = fan_out(pd.make_request({"prompt_token_ids": PROMPT}, params), 3)
    requests[2].request_id = requests[0].request_id  # refused: that id is in flight

    async def outcomes() -> dict[int, tuple[str, int]]:
        ends: dict[int, tuple[str, int]] = {}
        num_tokens = [0] * len(requests)
        async for index, out in pd.stream_group(requests):
            num_tokens[index] += len(out.new_token_ids)
            if out.finished:
                ends[index] = (out.finish_reason, num_tokens[index])
        return ends

    ends = asyncio.run(outcomes())
    assert ends == {0: ("length", 4), 1: ("length", 4), 2: ("error", 0)}
    assert_clean(pd, baseline)
