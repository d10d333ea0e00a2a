"""The pool's LoRA adapters on its instances: the pool controller loads each adapter on
every instance that runs requests (and on each that joins), and unloads it from all."""

from __future__ import annotations

import asyncio
import logging

import ray
from ray.actor import ActorHandle

from pdcluster.engine.lora.adapter import LoRARequest

logger = logging.getLogger(__name__)


async def load_adapters(instances: list[tuple[str, ActorHandle]], loras: list[LoRARequest]) -> None:
    """Load each of `loras` on each of `instances` ((id, actor) pairs); ValueError saying
    why one cannot. An instance that does not answer is passed over: it loads an adapter
    when a request brings it (each names its adapter's folder)."""
    calls = [(iid, h.load_lora.remote(lora)) for iid, h in instances for lora in loras]
    answers = await asyncio.gather(*(c for _, c in calls), return_exceptions=True)
    for (iid, _), answer in zip(calls, answers):
        if isinstance(answer, ray.exceptions.RayError):
            logger.warning("instance %s did not load a LoRA adapter: %s", iid, answer)
        elif isinstance(answer, BaseException):
            raise answer
        elif answer is not None:
            raise ValueError(answer)


async def unload_adapter(instances: list[tuple[str, ActorHandle]], name: str) -> None:
    """Unload adapter `name` from each of `instances` (one gone holds nothing)."""
    calls = [h.unload_lora.remote(name) for _, h in instances]
    await asyncio.gather(*calls, return_exceptions=True)
