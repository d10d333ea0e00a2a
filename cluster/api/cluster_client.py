"""What the gateway needs of a cluster: `cluster.client.Cluster` provides it; tests may pass
a fake."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from pdcluster.actors.messages import InstanceStats
from pdcluster.actors.pool_messages import KVPoolStats, PlannerState
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.request import Request as EngineRequest
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.tokenizer import Tokenizer
from pdcluster.routing.role import Role


class ClusterClient(Protocol):
    """What the gateway needs of a cluster (cluster.client.Cluster provides it)."""

    tokenizer: Tokenizer

    def make_request(
        self,
        prompt: Any,
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> EngineRequest: ...

    adapters: dict[str, LoRARequest]  # the LoRA adapters served, by name
    enable_lora: bool

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest: ...

    async def unload_lora_adapter(self, name: str) -> None: ...

    kv_tokens_per_instance: int | None
    serving_roles: frozenset[Role]  # the topology's roles, each needing a ready instance
    priority_scheduling: bool  # requests may carry a non-zero priority
    num_moves: int  # streams moved off a lost instance so far (router.migration_limit)

    def stream_group(
        self, requests: list[EngineRequest]
    ) -> AsyncIterator[tuple[int, EngineCoreOutput]]: ...

    async def stats_async(self, timeout_s: float = ...) -> list[InstanceStats]: ...

    async def scale(self, role: str, count: int) -> dict[str, str]: ...

    async def planner_state(self) -> PlannerState: ...

    async def kv_pool_stats(self, timeout_s: float = ...) -> KVPoolStats | None: ...
