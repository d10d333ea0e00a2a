"""CPU kernels the engine builds for itself at first use, each with a torch fallback.

Each is C++ next to this file, compiled by torch's extension JIT (a C++ compiler and ninja,
`torch.utils.cpp_extension.load`) once per machine kind and cached under
~/.cache/torch_extensions, so later processes load the built library in well under a second.
Where it cannot be built (no compiler, a torch without its headers), the caller's torch path
runs instead; that is logged once. Nothing here is needed for correctness.

- `torch.ops.pdcluster.paged_decode_attention(q, kv_cache, layer, block_tables, seq_lens,
  scale, window)`: one query per sequence over its paged float32 KV (engine/attention.py's
  decode path), reading each key and value in place instead of gathering the context into a
  copy first.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]  # built on the machine that runs it


@functools.cache
def paged_decode_attention() -> Callable[..., torch.Tensor] | None:
    """The compiled decode-attention kernel, or None where it cannot be built."""
    try:
        from torch.utils.cpp_extension import load

        capability = torch.backends.cpu.get_cpu_capability().lower()
        load(
            name=f"pdcluster_paged_attention_{capability}",
            sources=[str(SOURCE_DIR / "paged_attention.cpp")],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,  # registers torch.ops.pdcluster.*
        )
    except Exception as e:  # a missing compiler or ninja, a failed build: the torch path
        logger.warning("paged decode attention kernel unavailable, torch's path runs: %s", e)
        return None
    return torch.ops.pdcluster.paged_decode_attention
