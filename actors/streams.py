"""Ending a Ray streaming call early without stranding its items in the object store."""

from __future__ import annotations

import asyncio
import contextlib

import ray


def abandon(refs: ray.ObjectRefGenerator) -> None:
    """Cancel a streaming call whose consumer stopped, and drain it in the background: items
    it already produced are released only once consumed or the generator is gone."""
    ray.cancel(refs)
    asyncio.get_running_loop().create_task(_drain(refs))


async def _drain(refs: ray.ObjectRefGenerator) -> None:
    with contextlib.suppress(Exception):
        async for ref in refs:
            with contextlib.suppress(Exception):
                await ref
