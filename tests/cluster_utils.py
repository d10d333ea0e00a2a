"""Helpers for tests that run real clusters on the session's local Ray."""

from __future__ import annotations

import asyncio
import gc
import re
import time
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import Any

import numpy as np
import ray
from PIL import Image

from pdcluster.actors.front import pull_object_ids
from pdcluster.actors.kv_pool import kv_pool_actor_name
from pdcluster.actors.messages import InstanceStats
from pdcluster.cluster.client import Cluster
from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.control.launch import launch
from pdcluster.engine import SamplingParams
from pdcluster.engine.llm import RequestOutput, merge_output, new_request_output
from pdcluster.engine.request import Request

_OBJECT_ID = re.compile(r"\b[0-9a-f]{56}\b")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

SMALL_ENGINE = {
    "block_size": 4,
    "num_blocks": 256,
    "max_num_batched_tokens": 256,
    "max_num_seqs": 32,
    "max_model_len": 512,
}


def cluster_config(model_dir: str, **roles: Any) -> ClusterConfig:
    """A config for `model_dir`; `roles` maps role -> count or dict (e.g. prefill=1,
    connector={...}). Each instance reserves 1 CPU of the session's logical CPUs."""
    data: dict[str, Any] = {"model": model_dir, "engine": dict(SMALL_ENGINE)}
    for key, value in roles.items():
        data[key] = {"count": value, "num_cpus": 1} if isinstance(value, int) else value
    return ClusterConfig.model_validate(data)


def start(model_dir: str, **roles: Any) -> Cluster:
    return launch(cluster_config(model_dir, **roles))


def random_image(seed: int, size: tuple[int, int] = (40, 40)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8))


def mixed_prompts(with_images: bool) -> list:
    prompts: list = [
        "Hello there, how are you today?",
        "The quick brown fox jumps over the lazy dog. " * 6,
        [5, 9, 300, 41, 7],
        "A",
    ]
    if with_images:
        prompts += [
            {"prompt": "Describe <image> please.", "multi_modal_data": {"image": random_image(1)}},
            {
                "prompt": "<image> versus <image>?",
                "multi_modal_data": {"image": [random_image(2), random_image(3, (64, 30))]},
            },
        ]
    return prompts


def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def instance_stats(cluster: Cluster, role: str) -> InstanceStats:
    """Stats of the first instance of `role`."""
    return next(s for s in cluster.stats() if s.role == role)


def stats_by_id(cluster: Cluster) -> dict[str, InstanceStats]:
    """Every instance's stats, by instance id."""
    return {s.instance_id: s for s in cluster.stats()}


def total(cluster: Cluster, role: str, path: str) -> int:
    """The sum over the instances of `role` of one figure (`path` of `InstanceStats`, as
    `kv_transfer.num_loads`)."""
    return sum(attrgetter(path)(s) for s in cluster.stats() if s.role == role)


def instance_with(cluster: Cluster, role: str, path: str) -> str | None:
    """The id of an instance of `role` whose figure `path` is non-zero, if any."""
    return next(
        (s.instance_id for s in cluster.stats() if s.role == role and attrgetter(path)(s)), None
    )


def kill(cluster: Cluster, instance_id: str) -> int:
    """Kill an instance's actor (Ray restarts it under its name); the pid it had."""
    pid = stats_by_id(cluster)[instance_id].pid
    ray.kill(cluster.instances[instance_id][1], no_restart=False)
    return pid


def handle(cluster: Cluster, role: str, index: int = 0):
    return [h for r, h in cluster.instances.values() if r == role][index]


async def collect(cluster: Cluster, request: Request) -> RequestOutput:
    result = new_request_output(request)
    async for out in cluster.stream(request):
        merge_output(result, out)
    return result


async def collect_acting(
    cluster: Cluster, request: Request, num_tokens: int, act: Callable[[], Any]
) -> tuple[RequestOutput, Any]:
    """Stream `request` to its end, calling `act` once when the client holds `num_tokens`
    tokens (e.g. to kill the instance streaming them); the output and what `act` returned
    (None: the request ended first)."""
    result, acted = new_request_output(request), None
    async for out in cluster.stream(request):
        merge_output(result, out)
        if acted is None and len(result.token_ids) >= num_tokens:
            acted = act()
    return result, acted


RESTART_TIMEOUT_S = 120.0  # a restarted instance loads its model again


def wait_restarted(cluster: Cluster, instance_id: str, old_pid: int) -> None:
    """Until the Front's pull loop sees the restarted instance as healthy again."""

    def back() -> bool:
        s = next(s for s in cluster.stats() if s.instance_id == instance_id)
        return s.healthy and s.pid not in (None, old_pid)

    assert wait_until(back, RESTART_TIMEOUT_S), cluster.stats()


class Load:
    """Streams in flight on a cluster, their outputs so far readable at any time."""

    def __init__(self, cluster, params: SamplingParams) -> None:
        self.cluster, self.params = cluster, params
        self.results: list[RequestOutput] = []
        self.tasks: list[asyncio.Task] = []

    def add(self, batch: list) -> list[RequestOutput]:
        added = []
        for prompt in batch:
            request = self.cluster.make_request(prompt, self.params)
            result = new_request_output(request)
            self.results.append(result)
            self.tasks.append(asyncio.create_task(self._stream(request, result)))
            added.append(result)
        return added

    async def _stream(self, request, result: RequestOutput) -> None:
        async for out in self.cluster.stream(request):
            merge_output(result, out)

    async def all_have(self, results: list[RequestOutput], num_tokens: int) -> bool:
        return await until(lambda: all(len(r.token_ids) >= num_tokens for r in results), 60)

    async def done(self) -> list[RequestOutput]:
        await asyncio.gather(*self.tasks)
        return self.results


def our_objects_in_store(object_ids: Iterable[str] | None = None) -> set[str]:
    """Hex ids of objects that some worker of the cluster still references (the store frees an
    object once none does), restricted to `object_ids` when given."""
    live = set(_OBJECT_ID.findall(_memory_summary()))
    return live if object_ids is None else live & set(object_ids)


def _memory_summary() -> str:
    from ray._private.internal_api import memory_summary

    return memory_summary(ray.get_runtime_context().gcs_address, line_wrap=False)


_IN_FLIGHT = re.compile(r"\|\s*(?:SUBMITTED_TO_WORKER|PENDING_\w+)\s*\|.*\b([0-9a-f]{56})\b")


def live_object_ids(in_flight: bool = True) -> set[str]:
    """Objects some process references; without the results of calls not yet answered (a
    long-poll waiting, a pull) unless `in_flight`, read from the same summary. Collects this
    process's cyclic garbage first: a cancelled client task's traceback can hold a stream's
    refs until then."""
    gc.collect()
    summary = _memory_summary()
    live = set(_OBJECT_ID.findall(summary))
    return live if in_flight else live - set(_IN_FLIGHT.findall(summary))


def assert_clean(cluster: Cluster, baseline: set[str], timeout_s: float = 20.0) -> None:
    """Every instance idle (all blocks free, nothing queued or held), the gateway side tracks
    no request, and no object created since `baseline` is still alive in the object store."""
    cluster.wait_idle(timeout_s)
    assert wait_until(lambda: cluster.front.num_in_flight() == 0, timeout_s)

    # A call in flight (a pull, a long-poll to the pool controller or the KV pool), a member's
    # actor handle, or an entry of the KV pool is no leak: an actor call's object id holds the
    # actor's.
    pool = kv_pool_actor(cluster)
    callee_ids = list(cluster_actors(cluster))  # controller, instances, KV pool

    def leaked() -> set[str]:
        since = time.monotonic()
        live = live_object_ids(in_flight=False) - baseline - pull_object_ids(since)
        if pool is not None:
            live -= set(ray.get(pool.object_ids.remote()))
        return {o for o in live if not any(a in o for a in callee_ids)}

    assert wait_until(lambda: not leaked(), timeout_s), _describe(leaked())


def kv_pool_actor(cluster: Cluster) -> ray.actor.ActorHandle | None:
    """The cluster KV pool's owner actor (None when the pool is off)."""
    try:
        return ray.get_actor(kv_pool_actor_name(cluster.pool))
    except ValueError:
        return None


def named_actors(prefix: str = "") -> dict[str, str]:
    """Actor id (hex) -> name of every live named actor whose name starts with `prefix`, in
    every namespace."""
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith(prefix):
            try:
                actor = ray.get_actor(entry["name"], namespace=entry["namespace"])
            except ValueError:  # gone since listed
                continue
            found[actor._actor_id.hex()] = entry["name"]
    return found


def cluster_actors(cluster: Cluster) -> dict[str, str]:
    """The cluster's named actors (its pool's names): controller, instances, KV pool."""
    return named_actors(f"{cluster.pool}-")


def _describe(object_ids: set[str]) -> str:
    """The memory summary's lines for `object_ids`, and the named actors (whose ids are in
    the ids of calls to them); no state API: the test session runs without the dashboard."""
    lines = [line for line in _memory_summary().splitlines() if any(i in line for i in object_ids)]
    actors = [f"actor {i} is {name}" for i, name in named_actors().items()]
    return "\n".join([f"leaked: {sorted(object_ids)}", *lines, *actors])


async def until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """`wait_until` for coroutines: lets the event loop run between polls."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()
