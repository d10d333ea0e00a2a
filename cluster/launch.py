"""Start a pdcluster on Ray: instance actors per role (in placement groups) and a router.

`launch(config)` uses an existing cluster when `ray.address` is set (or Ray is already
initialised), and otherwise starts an embedded local Ray with no dashboard.
"""

from __future__ import annotations

import asyncio
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
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.instance import InstanceActor, InstanceSpec
from actors.router import RouterActor
from cluster.config import ROLES, ClusterConfig
from cluster.router import RouterConfig
from engine.llm import RequestOutput, merge_output, new_request_output
from engine.models.loader import read_model_info
from engine.outputs import EngineCoreOutput
from engine.presets import resolve_model_dir
from engine.processor import InputProcessor, PromptType
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "preset:tiny-llava"
READY_TIMEOUT_S = 300.0


class Cluster:
    """Handles to a running pdcluster, and a client API over its router."""

    def __init__(
        self,
        config: ClusterConfig,
        model_dir: str,
        router: ray.actor.ActorHandle,
        instances: dict[str, tuple[str, ray.actor.ActorHandle]],
        placement_groups: list[PlacementGroup],
        owns_ray: bool,
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        self.router = router
        self.instances = instances
        self._placement_groups = placement_groups
        self._owns_ray = owns_ray
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
    ) -> Request:
        request_id = request_id or f"{self._prefix}-{next(self._ids)}"
        return self.processor.process(request_id, prompt, params or SamplingParams())

    async def stream(self, request: Request) -> AsyncIterator[EngineCoreOutput]:
        """Outputs of one request as they arrive; leaving early aborts it everywhere."""
        rid = request.request_id
        finished = False
        try:
            batch = await self.router.generate.remote(request)
            while True:
                for out in batch:
                    finished = finished or out.finished
                    yield out
                if finished:
                    return
                batch = await self.router.next_outputs.remote(rid)
        except ray.exceptions.RayError as exc:  # e.g. the router died mid-request
            finished = True
            yield EngineCoreOutput(rid, [], finish_reason="error", error=f"router failed: {exc}")
        finally:
            if not finished:
                self.router.abort.remote(rid)

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

    def stats(self) -> list[dict[str, Any]]:
        return ray.get(self.router.cluster_stats.remote())

    async def stats_async(self) -> list[dict[str, Any]]:
        return await self.router.cluster_stats.remote()

    @property
    def model_name(self) -> str:
        """The model id clients use: the configured name, else the preset or folder name."""
        name = self.config.gateway.served_model_name or self.config.model or DEFAULT_MODEL
        return name.removeprefix("preset:").rstrip("/").rsplit("/", 1)[-1]

    @property
    def max_model_len(self) -> int:
        roles = [r for r in ("decode", "mixed", "prefill") if self.config.role(r).count]
        return self.config.engine_settings(roles[0]).max_model_len

    def wait_idle(self, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Wait until every instance holds nothing (all blocks free, no request, no pending
        transfer); returns the last stats. Raises TimeoutError naming what is still held."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            busy = [s for s in stats if s.get("healthy", True) and not _idle(s)]
            if not busy:
                return stats
            if time.monotonic() > deadline:
                raise TimeoutError(f"instances still hold state: {busy}")
            time.sleep(0.05)

    def shutdown(self) -> None:
        handles = [h for _, h in self.instances.values()]
        with contextlib.suppress(ray.exceptions.RayError):  # dead actors hold nothing
            ray.get([h.shutdown.remote() for h in handles], timeout=30)
        for handle in [*handles, self.router]:
            ray.kill(handle, no_restart=True)
        for pg in self._placement_groups:
            remove_placement_group(pg)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _idle(stats: dict[str, Any]) -> bool:
    held = (
        "num_running",
        "num_waiting",
        "num_deferred",
        "num_pending_sends",
        "num_pending_recvs",
        "num_streams",
        "num_encoder_cache_refs",
    )
    return stats.get("num_blocks_free") == stats.get("num_blocks_total") and not any(
        stats.get(k) for k in held
    )


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if len(params) != n:
        raise ValueError("need one SamplingParams per prompt, or a single one")
    return list(params)


def init_ray(config: ClusterConfig) -> bool:
    """Connect to (or start) Ray; True when this call started it.

    Connecting to an address uses token authentication whenever a token is available
    (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token) and RAY_AUTH_MODE is unset:
    Ray itself does so only for a cluster it finds with address "auto". A cluster that
    cannot be reached, or refuses the token, raises one ConnectionError saying what to set.
    """
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    kwargs: dict[str, Any] = {"namespace": config.ray.namespace, "log_to_driver": True}
    address = config.ray.address or _address_from_env()
    if not address:
        ray.init(
            **kwargs,
            address="local",  # a new embedded cluster, not one `ray start` left running
            include_dashboard=False,  # never expose the dashboard from an embedded cluster
            num_cpus=config.ray.num_cpus,
            object_store_memory=config.ray.object_store_memory,
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


def launch(config: ClusterConfig | str | Path) -> Cluster:
    """Start every instance of the topology and the router; returns when all are ready."""
    if not isinstance(config, ClusterConfig):
        config = ClusterConfig.from_yaml(config)
    owns_ray = init_ray(config)
    model = config.model or DEFAULT_MODEL
    model_dir = resolve_model_dir(model)  # the driver tokenizes, so it needs the files too
    name = f"pdc-{uuid.uuid4().hex[:6]}"
    instances: dict[str, tuple[str, ray.actor.ActorHandle]] = {}
    groups = []
    try:
        for role in ROLES:
            spec = config.role(role)
            if spec.count == 0:
                continue
            pg = _placement_group(spec)
            groups.append(pg)
            for index in range(spec.count):
                iid = f"{name}-{role}-{index}"
                instances[iid] = (role, _start_instance(config, role, iid, model, pg, index))
        ray.get([h.health.remote() for _, h in instances.values()], timeout=READY_TIMEOUT_S)
        router = (
            ray.remote(RouterActor)
            .options(name=f"{name}-router", num_cpus=0, max_concurrency=100_000, max_restarts=-1)
            .remote({iid: role for iid, (role, _) in instances.items()}, _router_config(config))
        )
        ray.get(router.num_in_flight.remote(), timeout=READY_TIMEOUT_S)
    except BaseException:
        for _, handle in instances.values():
            ray.kill(handle, no_restart=True)
        for pg in groups:
            remove_placement_group(pg)
        raise
    logger.info("pdcluster %s is up: %s", name, config.topology_name())
    return Cluster(config, model_dir, router, instances, groups, owns_ray)


def _placement_group(spec) -> PlacementGroup:
    bundle: dict[str, float] = {"CPU": spec.num_cpus, **spec.resources}
    if spec.num_gpus:
        bundle["GPU"] = spec.num_gpus
    bundle = {k: v for k, v in bundle.items() if v} or {"CPU": 0.01}
    pg = placement_group([bundle] * spec.count, strategy="PACK")
    ray.get(pg.ready(), timeout=READY_TIMEOUT_S)
    return pg


def _start_instance(
    config: ClusterConfig, role: str, iid: str, model: str, pg: PlacementGroup, index: int
) -> ray.actor.ActorHandle:
    spec = config.role(role)
    instance = InstanceSpec(
        instance_id=iid,
        role=role,
        engine=config.engine_config(role, model),
        kv_lease_s=config.connector.kv_lease_s,
        kv_load_timeout_s=config.connector.kv_load_timeout_s,
        ec_timeout_s=config.connector.ec_timeout_s,
        stream_idle_timeout_s=config.router.stream_idle_timeout_s,
    )
    return (
        ray.remote(InstanceActor)
        .options(
            name=iid,
            num_cpus=spec.num_cpus,
            num_gpus=spec.num_gpus,
            resources=dict(spec.resources),
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=index
            ),
            max_concurrency=100_000,
            max_restarts=3,
        )
        .remote(instance)
    )


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
        stream_idle_timeout_s=r.stream_idle_timeout_s,
    )
