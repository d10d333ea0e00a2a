"""Load through the gateway: many concurrent streaming clients, some of which hang up
mid-stream; and KV pool exhaustion on D and on P. Nothing may fail, leak or deadlock."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdcluster.actors.messages import InstanceStats
from pdcluster.engine import LLM, SamplingParams
from tests.cluster_utils import (
    SMALL_ENGINE,
    assert_clean,
    live_object_ids,
    start,
)

MODEL = "tiny-llava"
NUM_CLIENTS = 64
LOAD_S = 15.0  # default run: traffic time after warm-up
SOAK_S = 180.0
WARMUP_S = 3.0
DISCONNECT_EVERY = 6  # about one request in this many hangs up mid-stream
RSS_SLACK_BYTES = 100 * 1024 * 1024
HANG_GUARD_S = 180.0  # a deadlock fails the test instead of hanging it; not a speed bound
STUCK_POLLS = 10  # one a second

PROMPTS = [
    "Hello there, how are you today?",
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Tell me a story about a lighthouse",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "A",
]


@pytest.fixture(scope="module")
def cluster(ray_session, model_dir):
    gateway = {"served_model_name": MODEL}
    with start(model_dir, prefill=1, decode=1, gateway=gateway) as c:
        yield c


# ---- clients ---------------------------------------------------------------------------------
@dataclass
class Tally:
    completed: int = 0
    disconnected: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)


def _body(rng: random.Random) -> tuple[str, dict[str, Any]]:
    max_tokens = rng.randint(4, 12)
    sampling: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": rng.random() < 0.75,
    }
    if rng.random() < 0.5:
        sampling.update(temperature=0.8, seed=rng.randrange(1000))
    else:
        sampling.update(temperature=0)
    if rng.random() < 0.3:
        messages = [{"role": "user", "content": rng.choice(PROMPTS)}]
        return "/v1/chat/completions", {**sampling, "messages": messages}
    return "/v1/completions", {**sampling, "prompt": rng.choice(PROMPTS)}


async def _one_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    path, body = _body(rng)
    hang_up_after = rng.randint(1, 3) if rng.randrange(DISCONNECT_EVERY) == 0 else None
    reasons, usage, done, num_events = [], None, False, 0
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            tally.errors.append(f"{response.status_code}: {(await response.aread())[:300]!r}")
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            num_events += 1
            if hang_up_after is not None and num_events >= hang_up_after:
                tally.disconnected += 1
                return  # leaving the block closes the connection mid-stream
            usage = chunk.get("usage") or usage
            reasons += [c["finish_reason"] for c in chunk["choices"] if c.get("finish_reason")]
    expected = body["max_tokens"]
    tokens = usage["completion_tokens"] if usage else -1
    full = tokens == expected if body["ignore_eos"] else 0 < tokens <= expected
    if not (done and reasons in (["length"], ["stop"]) and full):
        tally.errors.append(f"{path} {body}: done={done} reasons={reasons} usage={usage}")
        return
    tally.completed += 1
    tally.tokens += tokens


async def _client(base_url: str, seed: int, until: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=HANG_GUARD_S) as client:
        while time.monotonic() < until:
            try:
                await _one_request(client, rng, tally)
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                tally.errors.append(f"{type(exc).__name__}: {exc}")


async def _load(base_url: str, num_clients: int, seconds: float, seed: int) -> Tally:
    tally = Tally()
    until = time.monotonic() + seconds
    clients = [_client(base_url, seed * 1000 + i, until, tally) for i in range(num_clients)]
    await asyncio.wait_for(asyncio.gather(*clients), seconds + HANG_GUARD_S)
    return tally


def run_load(base_url: str, seconds: float, seed: int) -> Tally:
    return asyncio.run(_load(base_url, NUM_CLIENTS, seconds, seed))


# ---- memory ----------------------------------------------------------------------------------
def private_rss(cluster) -> dict[str, int]:
    """Anonymous resident memory (bytes) of each instance actor's process: RSS less the file
    and shared pages, which the object store's mapping inflates as it is used."""
    return {s.instance_id: _rss_anon(s.pid) for s in cluster.stats()}


def _rss_anon(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no RssAnon for process {pid}")


def assert_memory_flat(before: dict[str, int], after: dict[str, int]) -> None:
    grown = {
        k: (after[k] - before[k]) // 2**20 for k in before if after[k] - before[k] > RSS_SLACK_BYTES
    }
    assert not grown, f"instance memory grew (MiB): {grown}; before={before} after={after}"


def _load_test(cluster, base_url: str, seconds: float) -> Tally:
    baseline = live_object_ids()
    warm = run_load(base_url, WARMUP_S, seed=1)
    assert not warm.errors, warm.errors[:5]
    assert_clean(cluster, baseline)
    before = private_rss(cluster)
    tally = run_load(base_url, seconds, seed=2)
    assert not tally.errors, f"{len(tally.errors)} failed: {tally.errors[:5]}"
    assert tally.completed >= NUM_CLIENTS and tally.disconnected > 0, tally
    assert_clean(cluster, baseline)
    assert all(s.healthy for s in cluster.stats())
    assert_memory_flat(before, private_rss(cluster))
    print(f"load {seconds:.0f} s: {tally.completed} completed, {tally.disconnected} hung up")
    return tally


def test_concurrent_streaming_clients_with_hangups(cluster, base_url):
    _load_test(cluster, base_url, LOAD_S)


@pytest.mark.slow
def test_soak(cluster, base_url):
    _load_test(cluster, base_url, SOAK_S)


# ---- KV pool exhaustion ----------------------------------------------------------------------
POOL_BLOCKS = 24  # block_size 4: 96 tokens in the small pool
EXHAUSTION_ENGINE = {**SMALL_ENGINE, "max_model_len": POOL_BLOCKS * SMALL_ENGINE["block_size"]}
GREEDY_IGNORE_EOS = {"temperature": 0.0, "ignore_eos": True}


def _prompt(seed: int, num_tokens: int) -> list[int]:
    """Distinct token prompts, so that no prefix cache hit shrinks the KV they need."""
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(num_tokens)]


def _exhaustion_workload(half_pool_tokens: int) -> tuple[list, list[SamplingParams]]:
    """Requests whose KV each needs more than half a small pool, and small ones that grow."""
    big = [_prompt(i, half_pool_tokens + 4) for i in range(6)]
    small = [_prompt(100 + i, 10) for i in range(6)]
    params = [SamplingParams(max_tokens=12, **GREEDY_IGNORE_EOS)] * len(big)
    params += [SamplingParams(max_tokens=40, **GREEDY_IGNORE_EOS)] * len(small)
    return big + small, params


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = LLM(model_dir, **SMALL_ENGINE)
    return lambda prompts, params: [o.token_ids for o in llm.generate(prompts, params)]


def _run_bounded(cluster, prompts: list, params: list[SamplingParams]) -> list[list[int]]:
    """All prompts at once; fails, with the instances' state, once an instance sits stuck
    (requests waiting, no free block, nothing running or loading) for several polls."""

    async def run() -> tuple[list | None, list]:
        work = asyncio.ensure_future(cluster.generate_async(prompts, params))
        deadline, stuck_polls = time.monotonic() + HANG_GUARD_S, 0
        while time.monotonic() < deadline and stuck_polls < STUCK_POLLS:
            done, _ = await asyncio.wait({work}, timeout=1.0)
            if done:
                return work.result(), []
            stats = await cluster.stats_async()
            stuck_polls = stuck_polls + 1 if any(map(_stuck, stats)) else 0
        work.cancel()
        return None, stats

    outputs, stats = asyncio.run(run())
    assert outputs is not None, f"no progress (deadlock?): {_brief(stats)}"
    assert all(o.finish_reason == "length" for o in outputs), [o.outputs for o in outputs]
    return [o.token_ids for o in outputs]


def _stuck(s: InstanceStats) -> bool:
    q = s.scheduler
    return (
        q.num_waiting + q.num_deferred > 0
        and q.num_blocks_free == 0
        and not q.num_running
        and not q.num_pending_recvs
    )


def _brief(stats: list[InstanceStats]) -> list[tuple[Any, ...]]:
    return [(s.instance_id, s.scheduler, s.kv_transfer) for s in stats]


# ~15 s each: the small prefill pool runs in -m slow
@pytest.mark.parametrize("small_role", ["decode", pytest.param("prefill", marks=pytest.mark.slow)])
def test_kv_pool_exhaustion_queues_and_preempts(ray_session, model_dir, reference, small_role):
    small = {"count": 1, "num_cpus": 1, "engine": {"num_blocks": POOL_BLOCKS}}
    roles = {"prefill": 1, "decode": 1, small_role: small}
    half_pool_tokens = POOL_BLOCKS * SMALL_ENGINE["block_size"] // 2
    prompts, params = _exhaustion_workload(half_pool_tokens)
    with start(model_dir, engine=EXHAUSTION_ENGINE, **roles) as cluster:
        baseline = live_object_ids()
        for _ in range(2):  # the second round meets whatever the first left behind
            assert _run_bounded(cluster, prompts, params) == reference(prompts, params)
        assert_clean(cluster, baseline)


@pytest.mark.parametrize("num_requests", [pytest.param(2, marks=pytest.mark.slow), 4])  # ~13 s each
def test_remote_loads_of_half_the_decode_pool_do_not_deadlock(
    ray_session, model_dir, reference, num_requests
):
    """Loads that each fill exactly half of D's pool: two can land together, and each then
    needs one more block for the token P sampled."""
    small = {"count": 1, "num_cpus": 1, "engine": {"num_blocks": POOL_BLOCKS}}
    half_pool_tokens = POOL_BLOCKS * SMALL_ENGINE["block_size"] // 2
    prompts = [_prompt(200 + i, half_pool_tokens) for i in range(num_requests)]
    params = [SamplingParams(max_tokens=8, **GREEDY_IGNORE_EOS)] * num_requests
    with start(model_dir, engine=EXHAUSTION_ENGINE, prefill=1, decode=small) as cluster:
        baseline = live_object_ids()
        assert _run_bounded(cluster, prompts, params) == reference(prompts, params)
        assert_clean(cluster, baseline)


def test_decode_prefix_hit_releases_prefill(ray_session, model_dir):
    with start(model_dir, prefill=1, decode=1) as cluster:
        baseline = live_object_ids()
        params = SamplingParams(max_tokens=4, **GREEDY_IGNORE_EOS)
        for round_ in range(3):  # identical prompts at once: later ones hit D's cache
            prompt = _prompt(300 + round_, 4 * SMALL_ENGINE["block_size"])
            cluster.generate([prompt] * 8, params)
        assert_clean(cluster, baseline, timeout_s=10)
