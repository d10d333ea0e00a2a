"""Registry: the instance pool's membership, a named actor on the control plane only.

Gateway replicas read it when they start and poll it for instances that join or leave; no
request ever calls it. The first process to `claim` an empty pool launches its instances
and `publish`es them; others wait for that and attach. Membership is kept in Ray's GCS
key-value store too, so a restarted registry knows its pool.
"""

from __future__ import annotations

import asyncio
import json

import ray
from ray.experimental import internal_kv


class Registry:
    """Wrap with `ray.remote(Registry)`, named `<pool>-registry`."""

    def __init__(self, pool: str) -> None:
        namespace = ray.get_runtime_context().namespace
        self._key = f"pdcluster/{namespace}/{pool}/members".encode()
        raw = internal_kv._internal_kv_get(self._key)
        self._members: dict[str, str] = json.loads(raw) if raw else {}
        self._claimed = bool(self._members)
        self._published: asyncio.Event | None = None

    async def claim(self) -> bool:
        """True for the one caller that is to launch the pool."""
        claimed, self._claimed = self._claimed, True
        return not claimed

    async def publish(self, members: dict[str, str]) -> None:
        self._members = dict(members)
        self._save()
        self._event().set()

    async def wait_ready(self) -> dict[str, str]:
        """The members, once the pool is launched."""
        if not self._members:
            await self._event().wait()
        return dict(self._members)

    async def members(self) -> dict[str, str]:
        """instance id (its actor name) -> role."""
        return dict(self._members)

    async def join(self, instance_id: str, role: str) -> None:
        self._members[instance_id] = role
        self._save()

    async def leave(self, instance_id: str) -> None:
        self._members.pop(instance_id, None)
        self._save()

    async def forget(self) -> None:
        """The pool is being shut down: drop its persisted membership."""
        self._members = {}
        internal_kv._internal_kv_del(self._key)

    def _save(self) -> None:
        internal_kv._internal_kv_put(self._key, json.dumps(self._members).encode())

    def _event(self) -> asyncio.Event:
        if self._published is None:
            self._published = asyncio.Event()
        return self._published
