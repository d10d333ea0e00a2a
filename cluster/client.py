"""A gateway replica's client of a running pdcluster (`pdcluster.Cluster`): it prepares
requests, plans and streams them straight from the instances (actors/front/), and asks the
pool's controller to scale. `launch` (cluster/control/launch.py) starts the pool and returns
one; Ray is reached only through actors/.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

from pdcluster.actors.front import STATS_TIMEOUT_S, Front
from pdcluster.actors.messages import InstanceStats
from pdcluster.actors.pool_client import PoolClient
from pdcluster.actors.pool_messages import KVPoolStats, PlannerState
from pdcluster.actors.ray_runtime import shutdown_ray
from pdcluster.cluster.config import ClusterConfig
from pdcluster.cluster.lora_config import absolute_folder
from pdcluster.engine.llm import RequestOutput, merge_output, new_request_output
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.engine.models.loader import read_model_info
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.processor import InputProcessor, PromptType
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.routing.policy import RouterConfig
from pdcluster.routing.role import Role

if TYPE_CHECKING:
    from ray.actor import ActorHandle

DEFAULT_MODEL = "preset:tiny-llava"


class Cluster:
    """A gateway replica's handle on a running pdcluster: its client API plans each request
    and streams it straight from the instances. `owned`: `shutdown` ends the pool (else it
    only detaches this client)."""

    def __init__(
        self,
        config: ClusterConfig,
        model_dir: str,
        pool: str,
        client: PoolClient,
        owns_ray: bool = False,
        owned: bool = True,
        embedded_ray: bool = False,
    ) -> None:
        self.config = config
        self.model_dir = model_dir
        self.pool = pool  # the instance pool's name: other replicas attach by it
        self._client = client
        self.front = Front(
            client.members_after,
            router_config(config),
            lambda ttft, tpot: client.report_latency(self.front.replica_id, ttft, tpot),
            None if config.connector.kv_pool_size_gib == 0 else client.kv_pool_events,
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
        lora_request: LoRARequest | None = None,
    ) -> Request:
        request_id = request_id or f"{self._prefix}-{next(self._ids)}"
        params = params or SamplingParams()
        return self.processor.process(
            request_id, prompt, params, cache_salt=cache_salt, priority=priority,
            lora_request=lora_request,
        )  # fmt: skip

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
    def controller(self) -> ActorHandle:
        """The pool controller's actor (see actors/pool_controller.py)."""
        return self._client.actor

    @property
    def instances(self) -> dict[str, tuple[str, ActorHandle]]:
        """instance id -> (role, actor handle), as this replica sees the pool now."""
        return self.front.handles()

    async def generate_async(
        self,
        prompts: Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        params = _per_prompt(sampling_params, len(prompts))
        requests = [
            self.make_request(p, sp, lora_request=lora_request) for p, sp in zip(prompts, params)
        ]
        return list(await asyncio.gather(*(self._collect(r) for r in requests)))

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Like `LLM.generate`, through the cluster (all prompts in flight at once), under
        `lora_request` (e.g. `cluster.adapters["name"]`) or the base model."""
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return asyncio.run(self.generate_async(list(prompts), sampling_params, lora_request))

    # ---- LoRA adapters -------------------------------------------------------------------
    @property
    def adapters(self) -> dict[str, LoRARequest]:
        """The LoRA adapters the pool serves, by name (a request's `model`)."""
        return self.front.adapters

    @property
    def enable_lora(self) -> bool:
        return self.config.lora.enable_lora

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """Serve the PEFT adapter in folder `path` as `name` on every instance; ValueError
        (nothing loaded anywhere) when it cannot be served or the name is taken."""
        if not self.enable_lora:
            raise ValueError("this cluster serves no LoRA adapters (start it with enable_lora)")
        if name == self.model_name:
            raise ValueError(f"{name!r} is the base model's name")
        lora = LoRARequest(name, absolute_folder(path))
        self.front.adapters = await self._client.load_lora_adapter(lora)
        return lora

    async def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (requests running on it finish); LookupError when it
        is not served."""
        self.front.adapters = await self._client.unload_lora_adapter(name)

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
        roles = [r for r in (Role.DECODE, Role.MIXED, Role.PREFILL) if self.config.role(r).count]
        return self.config.engine_settings(roles[0]).max_model_len

    @property
    def serving_roles(self) -> frozenset[Role]:
        """The topology's roles: /health is ready once each has a healthy instance."""
        return frozenset(role for role in Role if self.config.role(role).count > 0)

    @property
    def priority_scheduling(self) -> bool:
        """Whether requests may carry a priority (see `ClusterConfig.priority_scheduling`)."""
        return self.config.priority_scheduling()

    @property
    def kv_tokens_per_instance(self) -> int | None:
        """The KV tokens of the smallest pool that holds a request's sequences to the end, as
        the instances report them (a pool sized by memory is known only once it is up); the
        configured size before any report, None where that is set by memory."""
        sequences_end_on = (Role.DECODE, Role.MIXED)
        roles = [r for r in sequences_end_on if self.config.role(r).count] or [Role.PREFILL]
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

    async def scale(self, role: Role | str, count: int) -> dict[str, Role]:
        """Add instances of `role` (a Role or its name) or drain some away until it has
        `count` (see actors/pool_controller.py); returns the members. ValueError for a role or
        a count that cannot be."""
        return await self._client.scale(Role.parse(role), count)

    async def planner_state(self) -> PlannerState:
        return await self._client.planner_state()

    async def kv_pool_stats(self, timeout_s: float = STATS_TIMEOUT_S) -> KVPoolStats | None:
        """The cluster KV pool's stats (bytes, entries, evictions, ...); None when the pool
        is off or does not answer within `timeout_s`."""
        return await self._client.kv_pool_stats(timeout_s)

    def shutdown(self) -> None:
        """Detach this client; end the pool when it is ours. An embedded Ray ends with every
        process in it, instances included, so nothing is asked of a cluster that may be
        going down already (SIGTERM to the process group reaches its raylet too)."""
        self.front.close()
        if self._owned and not self._embedded_ray:
            self._client.end(quiet=True)  # a dead controller holds nothing
        if self._owns_ray:
            shutdown_ray()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if len(params) != n:
        raise ValueError("need one SamplingParams per prompt, or a single one")
    return list(params)


def router_config(config: ClusterConfig) -> RouterConfig:
    engine = config.engine_settings(Role.DECODE if config.decode.count else Role.MIXED)
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
