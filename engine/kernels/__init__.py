"""CPU kernels the engine builds for itself at first use, each with a torch fallback.

The C++ next to this file is compiled by torch's extension JIT (a C++ compiler and ninja,
`torch.utils.cpp_extension.load`) once per machine kind and cached under
~/.cache/torch_extensions, so later processes load the built library in well under a second.
Where it cannot be built (no compiler, a torch without its headers), callers run their torch
path instead; that is logged once. Nothing here is needed for correctness. The operators:

- `paged_decode_attention(q, kv_cache, layer, block_tables, seq_lens, scale, window)`: one
  query per sequence over its paged float32 KV (engine/attention.py's decode path), reading
  each key and value in place instead of gathering the context into a copy first.
- `rope_and_cache_kv(q, k, v, cos, sin, kv_cache, layer, slot_block_ids, slot_offsets)`:
  rotate-half RoPE on q and k and the cache write of k and v in one pass (bitwise the
  unfused float32 ops); returns the rotated q.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = ("ops.cpp", "paged_attention.cpp", "rope_cache.cpp")
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]  # built where it runs


@functools.cache
def cpu_kernels() -> torch._ops._OpNamespace | None:
    """`torch.ops.pdcluster` with the kernels above, or None where they cannot be built."""
    try:
        from torch.utils.cpp_extension import load

        capability = torch.backends.cpu.get_cpu_capability().lower()
        load(
            name=f"pdcluster_kernels_{capability}",
            sources=[str(Path(__file__).parent / name) for name in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,  # registers torch.ops.pdcluster.*
        )
    except Exception as e:  # a missing compiler or ninja, a failed build: the torch paths
        logger.warning("the engine's CPU kernels are unavailable, torch's paths run: %s", e)
        return None
    return torch.ops.pdcluster
