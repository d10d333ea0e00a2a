"""How many KV blocks an instance gets: a fixed `num_blocks`, or what a memory budget holds.

- `kv_cache_memory_bytes`: the KV cache's own size.
- `kv_cache_memory_fraction`: the share of the device's memory that this instance may fill
  with its weights and KV cache (like vLLM's `gpu_memory_utilization`); the KV cache gets
  that share minus the loaded weights. The device's memory is, on a GPU, its total memory;
  on CPU, the memory limit of this process's container (cgroup v2 `memory.max` or v1
  `memory.limit_in_bytes`: a Kubernetes pod's memory limit), else the machine's physical
  memory. Activations are not counted: leave them headroom.

Either way the KV cache must fit in the memory free right now, and hold at least one block.
One block holds `block_size` tokens of K and V in every layer:
layers x 2 x block_size x kv_heads x head_dim x dtype bytes.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pdcluster.engine.config import CacheConfig

if TYPE_CHECKING:
    from pdcluster.engine.models.loader import ModelInfo

GiB = 1024**3
CGROUP_ROOT = Path("/sys/fs/cgroup")
# (limit, usage) files of the container's memory cgroup: v2, then v1
CGROUP_MEMORY_FILES = (
    ("memory.max", "memory.current"),
    ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
)


@dataclass(frozen=True)
class DeviceMemory:
    total_bytes: int  # what a fraction is taken of
    free_bytes: int  # what can still be allocated now


def kv_block_bytes(info: ModelInfo, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: K and V of `block_size` tokens in every layer."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return info.num_layers * 2 * block_size * info.num_kv_heads * info.head_dim * itemsize


def module_bytes(model: torch.nn.Module) -> int:
    """Bytes of a loaded model's parameters and buffers."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def device_memory(device: torch.device) -> DeviceMemory:
    """Total and free memory of `device` (see the module docstring for CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(total_bytes=total, free_bytes=free)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free = _meminfo_available_bytes()
    limit = _cgroup_memory()
    if limit is not None:
        limit_bytes, usage_bytes = limit
        total = min(total, limit_bytes)
        free = min(free, max(0, limit_bytes - usage_bytes))
    return DeviceMemory(total_bytes=total, free_bytes=free)


def _meminfo_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def _cgroup_memory() -> tuple[int, int] | None:
    """(limit, usage) bytes of this container's memory cgroup; None without a limit."""
    for limit_file, usage_file in CGROUP_MEMORY_FILES:
        try:
            limit = (CGROUP_ROOT / limit_file).read_text().strip()
            usage = int((CGROUP_ROOT / usage_file).read_text())
        except (OSError, ValueError):
            continue
        return None if limit == "max" else (int(limit), usage)
    return None


def num_blocks_for_memory(
    cache: CacheConfig, block_bytes: int, weight_bytes: int, memory: DeviceMemory
) -> int:
    """The blocks a memory-sized cache config holds (see the module docstring). ValueError
    naming the numbers when not one block fits, or the cache exceeds the free memory."""
    if cache.kv_cache_memory_bytes is not None:
        kv_bytes, source = cache.kv_cache_memory_bytes, "kv_cache_memory_bytes"
    elif cache.kv_cache_memory_fraction is not None:
        fraction = cache.kv_cache_memory_fraction
        budget = int(fraction * memory.total_bytes)
        kv_bytes = budget - weight_bytes
        source = (
            f"kv_cache_memory_fraction {fraction} of {memory.total_bytes / GiB:.2f} GiB "
            f"({budget / GiB:.2f} GiB) minus {weight_bytes / GiB:.2f} GiB of weights"
        )
    else:
        raise ValueError("num_blocks is set: there is nothing to size from memory")
    if kv_bytes < block_bytes:
        raise ValueError(
            f"{source} leaves {max(kv_bytes, 0) / GiB:.3f} GiB for the KV cache, less than one "
            f"block ({block_bytes} bytes); raise it, or set num_blocks"
        )
    if kv_bytes > memory.free_bytes:
        raise ValueError(
            f"{source}: a KV cache of {kv_bytes / GiB:.2f} GiB does not fit in the "
            f"{memory.free_bytes / GiB:.2f} GiB free; lower it, or set num_blocks"
        )
    return kv_bytes // block_bytes


def size_cache(
    cache: CacheConfig,
    infos: Sequence[ModelInfo],
    dtype: torch.dtype,
    device: torch.device,
    models: Sequence[torch.nn.Module],
) -> CacheConfig:
    """`cache` with `num_blocks` fixed: as given, or what its memory budget holds once the
    models' weights are loaded on `device`. Every model of `infos` keeps a KV cache of its
    own over the same blocks (a draft model's beside the target's)."""
    if cache.num_blocks is not None:
        return cache
    block_bytes = sum(kv_block_bytes(info, cache.block_size, dtype) for info in infos)
    weight_bytes = sum(module_bytes(model) for model in models)
    num_blocks = num_blocks_for_memory(cache, block_bytes, weight_bytes, device_memory(device))
    return replace(
        cache, num_blocks=num_blocks, kv_cache_memory_fraction=None, kv_cache_memory_bytes=None
    )
