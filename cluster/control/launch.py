"""Start a pdcluster on Ray (its pool controller launches the instance actors), or attach
another gateway replica to a running pool by name.

`launch(config)` uses an existing cluster when `ray.address` is set (or Ray is already
initialised), and otherwise starts an embedded local Ray with no dashboard. The `Cluster` it
returns is one gateway replica's client: it plans, submits and reads tokens itself
(actors/front.py); nothing central is on a request's path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import ray

from pdcluster.actors.front import STATS_TIMEOUT_S, Front
from pdcluster.actors.kv_pool import kv_pool_actor_name
from pdcluster.actors.messages import InstanceStats, KVEvents
from pdcluster.actors.pool_controller import HEAD_RESOURCE, PoolController
from pdcluster.cluster.config import ClusterConfig, RaySettings
from pdcluster.cluster.control.pool import READY_TIMEOUT_S, PlacementTimeout, PoolPlan
from pdcluster.engine.llm import RequestOutput, merge_output, new_request_output
from pdcluster.engine.models.loader import read_model_info
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.presets import resolve_model_dir
from pdcluster.engine.processor import InputProcessor, PromptType
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.routing.policy import RouterConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "preset:tiny-llava"
TASK_EVENTS_FLUSH_MS = 100


class Cluster:
    """A gateway replica's handle on a running pdcluster: its client API plans each request
    and streams it straight from the instances. `owned`: `shutdown` ends the pool (else it
    only detaches this client)."""

    def __init__(
        self,
        config: ClusterConfig,
        model_dir: str,
        pool: str,
        controller: ray.actor.ActorHandle,
        owns_ray: bool = False,
        owned: bool = True,
        embedded_ray: bool = False,
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        self.pool = pool  # the instance pool's name: other replicas attach by it
        self.controller = controller
        members, report = controller.members, controller.report_latency
        self.front = Front(
            lambda: _answer_or_none(members.remote()),
            _router_config(config),
            lambda ttft, tpot: report.remote(self.front.replica_id, ttft, tpot),
            None if config.connector.kv_pool_size_gib == 0 else self._kv_pool_events,
        )
        self._owns_ray = owns_ray
        self._embedded_ray = embedded_ray  # this process started Ray: it all ends with it
        self._owned = owned
        self.tokenizer = Tokenizer(model_dir)
        self.model_info = read_model_info(model_dir)
        self.processor = InputProcessor(model_dir, self.tokenizer, self.model_info)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    # ---- client API --------------------------------------------------------------------
    def make_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Request:
        request_id = request_id or f"{self._prefix}-{next(self._ids)}"
        params = params or SamplingParams()
        return self.processor.process(
            request_id, prompt, params, cache_salt=cache_salt, priority=priority
        )

    def stream(self, request: Request) -> AsyncIterator[EngineCoreOutput]:
        """Outputs of one request as they arrive; leaving early aborts it everywhere."""
        return self.front.stream(request)

    def stream_group(self, requests: list[Request]) -> AsyncIterator[tuple[int, EngineCoreOutput]]:
        """(index, output) of requests sampling one prompt, planned together so the prompt is
        computed once (see `Front.stream_group`); leaving early aborts them all."""
        return self.front.stream_group(requests)

    @property
    def num_moves(self) -> int:
        """Attempts this replica planned again after their instance was lost (migrations)."""
        return self.front.num_moves

    @property
    def instances(self) -> dict[str, tuple[str, ray.actor.ActorHandle]]:
        """instance id -> (role, actor handle), as this replica sees the pool now."""
        return self.front.handles()

    async def generate_async(
        self,
        prompts: Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        params = _per_prompt(sampling_params, len(prompts))
        requests = [self.make_request(p, sp) for p, sp in zip(prompts, params)]
        return list(await asyncio.gather(*(self._collect(r) for r in requests)))

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Like `LLM.generate`, through the cluster (all prompts in flight at once)."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return asyncio.run(self.generate_async(list(prompts), sampling_params))

    async def _collect(self, request: Request) -> RequestOutput:
        result = new_request_output(request)
        async for out in self.stream(request):
            merge_output(result, out)
        return result

    def stats(self) -> list[InstanceStats]:
        return self.front.cluster_stats().result()

    async def stats_async(self, timeout_s: float = STATS_TIMEOUT_S) -> list[InstanceStats]:
        """Every instance's stats, waiting at most `timeout_s` for each (see
        `Front.cluster_stats`)."""
        return await asyncio.wrap_future(self.front.cluster_stats(timeout_s))

    @property
    def model_name(self) -> str:
        """The model id clients use: the configured name, else the preset or folder name."""
        return self.config.served_model_name(self.config.model or DEFAULT_MODEL)

    @property
    def max_model_len(self) -> int:
        roles = [r for r in ("decode", "mixed", "prefill") if self.config.role(r).count]
        return self.config.engine_settings(roles[0]).max_model_len

    @property
    def priority_scheduling(self) -> bool:
        """Whether requests may carry a priority (see `ClusterConfig.priority_scheduling`)."""
        return self.config.priority_scheduling()

    @property
    def kv_tokens_per_instance(self) -> int | None:
        """The KV tokens of the smallest pool that holds a request's sequences to the end, as
        the instances report them (a pool sized by memory is known only once it is up); the
        configured size before any report, None where that is set by memory."""
        roles = [r for r in ("decode", "mixed") if self.config.role(r).count] or ["prefill"]
        reported = self.front.policy.min_kv_tokens(roles)
        if reported is not None:
            return reported
        settings = [self.config.engine_settings(r) for r in roles]
        if any(s.num_blocks is None for s in settings):
            return None
        return min(s.num_blocks * s.block_size for s in settings)

    def wait_idle(self, timeout_s: float = 30.0) -> list[InstanceStats]:
        """Wait until every instance holds nothing (all blocks free, no request, no pending
        transfer); returns the last stats. Raises TimeoutError naming what is still held."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            busy = [s for s in stats if s.healthy and not s.is_idle()]
            if not busy:
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"instances still hold state: {busy}")
            time.sleep(0.05)

    async def scale(self, role: str, count: int) -> dict[str, str]:
        """Add instances of `role` or drain some away until it has `count` (see
        actors/pool_controller.py); returns the members. ValueError for a count that cannot be."""
        try:
            return await self.controller.scale.remote(role, count)
        except ray.exceptions.RayTaskError as exc:
            if isinstance(exc.cause, (ValueError, PlacementTimeout)):
                raise exc.cause from None
            raise

    async def planner_state(self) -> dict[str, Any]:
        return await self.controller.planner_state.remote()

    def _kv_pool_events(self, epoch: str | None, cursor: int) -> KVEvents | None:
        """The cluster KV pool's events after (epoch, cursor); None when it does not answer."""
        try:
            pool = ray.get_actor(kv_pool_actor_name(self.pool))
        except ValueError:  # not (yet) up
            return None
        return _answer_or_none(pool.events.remote(epoch, cursor))

    async def kv_pool_stats(self, timeout_s: float = STATS_TIMEOUT_S) -> dict[str, Any] | None:
        """The cluster KV pool's stats (bytes, entries, evictions, ...); None when the pool
        is off or does not answer within `timeout_s`."""
        try:
            pool = ray.get_actor(kv_pool_actor_name(self.pool))
            return await asyncio.wait_for(pool.stats.remote(), timeout_s)
        except (ValueError, ray.exceptions.RayError, asyncio.TimeoutError):
            return None

    def shutdown(self) -> None:
        """Detach this client; end the pool when it is ours. An embedded Ray ends with every
        process in it, instances included, so nothing is asked of a cluster that may be
        going down already (SIGTERM to the process group reaches its raylet too)."""
        self.front.close()
        if self._owned and not self._embedded_ray:
            with contextlib.suppress(ray.exceptions.RayError):  # a dead one holds nothing
                ray.get(self.controller.shutdown.remote(), timeout=120)
            ray.kill(self.controller, no_restart=True)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _answer_or_none(ref: ray.ObjectRef, timeout_s: float = 10.0) -> Any:
    """The call's result, or None when it failed or took too long. The error is read off the
    call's future, never raised: a raised error's traceback would hold the call's ref in a
    reference cycle, keeping its object alive until the next garbage collection."""
    future = ref.future()
    del ref
    try:
        failed = future.exception(timeout=timeout_s) is not None
    except concurrent.futures.TimeoutError:
        future.cancel()
        return None
    return None if failed else future.result()


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if len(params) != n:
        raise ValueError("need one SamplingParams per prompt, or a single one")
    return list(params)


def init_ray(settings: RaySettings) -> bool:
    """Connect to (or start) Ray; True when this call started it.

    Connecting to an address uses token authentication whenever a token is available
    (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) and RAY_AUTH_MODE is unset:
    Ray itself does so only for a cluster it finds with address "auto". A cluster that
    cannot be reached, or refuses the token, raises one ConnectionError saying what to set.
    """
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs: dict[str, Any] = {"namespace": settings.namespace, "log_to_driver": True}
    address = settings.address or _address_from_env()
    if not address:
        ray.init(
            **kwargs,
            address="local",  # a new embedded cluster, not one `ray start` left running
            include_dashboard=False,  # never expose the dashboard from an embedded cluster
            num_cpus=settings.num_cpus,
            object_store_memory=settings.object_store_memory,
            # On the way out the driver flushes task events to the GCS, waiting up to 5 s
            # for one already gone (SIGTERM to the process group reaches it first): an
            # embedded cluster's events die with it anyway. Workers start at niceness 0, not
            # Ray's 15: they are the service (see actors/priority.py).
            _system_config={
                "task_events_shutdown_flush_timeout_ms": TASK_EVENTS_FLUSH_MS,
                "worker_niceness": 0,
            },
        )
        logger.info("Ray is up (embedded, %s CPUs)", ray.cluster_resources().get("CPU"))
        return True
    token_auth = _enable_token_auth_if_token_available()
    try:
        ray.init(**kwargs, address=address)
    except (ConnectionError, ray.exceptions.RayError) as exc:
        hint = (
            "the token was refused, or the cluster is down"
            if token_auth and isinstance(exc, ConnectionError)
            else "if it uses token authentication, set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH, "
            "or put the token in ~/.ray/auth_token)"
        )
        reason = str(exc).split(". ")[0].rstrip(".")
        raise ConnectionError(f"cannot connect to Ray at {address}: {reason}; {hint}") from None
    logger.info("connected to Ray at %s (token auth: %s)", address, token_auth)
    return True


def _enable_token_auth_if_token_available() -> bool:
    """Ray's rule for an auto-found cluster (token auth on when RAY_AUTH_MODE is unset and a
    token exists), applied to an explicit address; True when token auth is on."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return False
    return maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _address_from_env() -> str | None:
    """RAY_ADDRESS when it names a cluster (`ray job submit` and KubeRay set it); an http(s)
    address there is the dashboard's, for the job CLI, not for ray.init."""
    address = os.environ.get("RAY_ADDRESS", "").strip()
    return address if address and not address.startswith(("http://", "https://")) else None


def launch(
    config: ClusterConfig | str | Path, pool: str | None = None, detached: bool = False
) -> Cluster:
    """Start every instance of the topology and the pool's controller; returns when all are
    ready. With `pool` naming a pool that is already up (or being launched by another
    process), attach to it instead: every caller gets its own gateway-side client of the
    one pool. A new unnamed pool is this caller's (its `shutdown` ends the pool); a named
    one is shared and ends with `shutdown_pool`. `detached` pools outlive the process that
    launched them (a Serve app's replicas come and go)."""
    if not isinstance(config, ClusterConfig):
        config = ClusterConfig.from_yaml(config)
    embedded_ray = not (ray.is_initialized() or config.ray.address or _address_from_env())
    owns_ray = init_ray(config.ray)
    model = config.model or DEFAULT_MODEL
    model_dir = resolve_model_dir(model)  # the driver tokenizes, so it needs the files too
    name = pool or f"pdc-{uuid.uuid4().hex[:6]}"
    controller = (
        ray.remote(PoolController)
        .options(
            name=f"{name}-controller", get_if_exists=True, num_cpus=0, max_restarts=-1,
            max_concurrency=1000, lifetime="detached" if detached else None,
            resources={HEAD_RESOURCE: 0.001},  # never on a worker an autoscaler may remove
        )
        .remote(PoolPlan(name, config, model))
    )  # fmt: skip
    try:
        members = _start_pool(controller)
    except BaseException:
        if pool is None:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(controller.shutdown.remote(), timeout=60)
            ray.kill(controller, no_restart=True)
        raise
    logger.info("pdcluster %s: %d instances (%s)", name, len(members), config.topology_name())
    return Cluster(
        config, model_dir, name, controller, owns_ray, owned=pool is None,
        embedded_ray=embedded_ray and owns_ray,
    )  # fmt: skip


def _start_pool(controller: ray.actor.ActorHandle) -> dict[str, str]:
    """The pool's members once it is up (the controller bounds that: it gives up once no new
    instance answered for READY_TIMEOUT_S, however long a large pool takes in all); a
    controller that is restarting is waited for."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            return ray.get(controller.start.remote())
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def shutdown_pool(pool: str, namespace: str | None = None) -> bool:
    """End a named pool: its instances and its controller. False
    when no such pool is up."""
    try:
        controller = ray.get_actor(f"{pool}-controller", namespace=namespace)
    except ValueError:
        return False
    ray.get(controller.shutdown.remote(), timeout=120)
    ray.kill(controller, no_restart=True)
    return True


def _router_config(config: ClusterConfig) -> RouterConfig:
    engine = config.engine_settings("decode" if config.decode.count else "mixed")
    r = config.router
    return RouterConfig(
        block_size=engine.block_size,
        max_model_len=engine.max_model_len,
        prefix_aware=r.prefix_aware,
        prefix_slack_tokens=r.prefix_slack_tokens,
        disagg_min_prompt_tokens=r.disagg_min_prompt_tokens,
        decode_prefix_fraction=r.decode_prefix_fraction,
        migration_limit=r.migration_limit,
    )
