"""Pixels by reference: a gateway replica puts each image's pixels into the object store
once; only the instance that runs the encoder on them fetches them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import ray
import torch

from pdcluster.engine.request import MultiModalFeature


@dataclass(frozen=True)
class ObjectStorePixels:
    """A `PixelSource` over a NumPy array in Ray's object store."""

    ref: ray.ObjectRef

    def load(self) -> torch.Tensor:
        return torch.tensor(ray.get(self.ref))  # one copy out of the read-only store

    async def load_async(self) -> torch.Tensor:
        return torch.tensor(await self.ref)


def by_reference(features: list[MultiModalFeature]) -> list[MultiModalFeature]:
    """The features with their pixels moved into the object store (one put each)."""
    return [
        dataclasses.replace(
            f, pixel_values=None, pixel_source=ObjectStorePixels(ray.put(f.pixel_values.numpy()))
        )
        if f.pixel_values is not None
        else f
        for f in features
    ]


async def prefetch(features: list[MultiModalFeature]) -> None:
    """Fetch the pixels of `features` now, off the step thread (the encoding instance)."""
    for f in features:
        if f.pixel_values is None and isinstance(f.pixel_source, ObjectStorePixels):
            f.pixel_values = await f.pixel_source.load_async()
