"""CPU kernels the engine builds for itself at first use, each with a torch fallback.

The C++ next to this file is compiled by torch's extension JIT (a C++ compiler and the `ninja` package,
`torch.utils.cpp_extension.load`; ~1 minute on 2 cores) once per machine kind and source
content, and cached under ~/.cache/torch_extensions ($TORCH_EXTENSIONS_DIR), so later processes
load the built library in well under a second. The build is keyed by the sources' content and
the torch installation, and compiled from a copy of the sources inside the build folder: every
copy of the same sources (an installed package, a checkout, a Ray job's unpacked working dir)
run by one environment shares one build, since ninja sees the same paths, while a changed
source or another environment gets a build of its own.
Where it cannot be built (no compiler, a torch without its headers), callers run their torch
path instead; that is logged once. Nothing here is needed for correctness. The operators:

- `paged_decode_attention(q, kv_cache, layer, block_tables, seq_lens, scale, window)`: one
  query per sequence over its paged float32 KV (engine/attention.py's decode path), reading
  each key and value in place instead of gathering the context into a copy first.
- `rope_and_cache_kv(q, k, v, cos, sin, kv_cache, layer, slot_block_ids, slot_offsets)`:
  rotate-half RoPE on q and k and the cache write of k and v in one pass (bitwise the
  unfused float32 ops); returns the rotated q.
- `int4_linear(x, packed, scales, bias)`, `int8_linear(x, q, w_scale, bias)`: x times 4-bit
  weights on GGUF Q4_1's grid, or int8 weights with a scale per output, the activations
  quantized to int8 per group of 32, in integer dot products (AVX512-VNNI's `vpdpbusd`, or
  on CPUs with AVX2 but not it, `vpmaddubsw` + `vpmaddwd` as llama.cpp's AVX2 path; the same
  integer sums; `dot_linear_supported()` says whether this CPU's build has either).
- `decode_layer(...)`: a whole Llama-family decoder layer on 4-bit weights for a decode step
  of a few sequences (engine/models/decode_kernel.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = (
    "ops.cpp",
    "paged_attention.cpp",
    "rope_cache.cpp",
    "dot_linear.cpp",
    "decode_layer.cpp",
)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]  # built where it runs


@functools.cache
def cpu_kernels() -> torch._ops._OpNamespace | None:
    """`torch.ops.pdcluster` with the kernels above, or None where they cannot be built."""
    try:
        _build_and_load()
    except Exception as e:  # a missing compiler or ninja, a failed build: the torch paths
        logger.warning("the engine's CPU kernels are unavailable, torch's paths run: %s", e)
        return None
    return torch.ops.pdcluster


def _build_and_load() -> None:
    """Build (where not built yet) and load the kernels, one process at a time per machine.

    torch's own build lock is a file that a builder killed mid-build leaves behind, after which
    every later load waits forever; an OS lock (flock) dies with its holder, so under it any
    torch lock file found is such a leftover and is removed."""
    from torch.utils.cpp_extension import load

    name = f"pdcluster_kernels_{torch.backends.cpu.get_cpu_capability().lower()}"
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache/torch_extensions"))
    variant = re.sub(
        r"\W", "_", f"py{sys.version_info[0]}{sys.version_info[1]}_{torch.__version__}"
    )
    files = {f.name: f.read_bytes() for f in sorted(Path(__file__).parent.glob("*.[ch]*"))}
    # Of the .cpp files and the headers, and of torch's install folder: the compile command
    # names torch's headers by path, so two environments (two venvs, a CI clone beside a
    # checkout) sharing one build folder would each take the other's build for stale.
    content = hashlib.sha1(str(Path(torch.__file__).resolve().parent).encode())
    for file_name, data in files.items():
        content.update(file_name.encode() + b"\0" + data)
    root = root / variant  # one build per Python and torch
    build_dir = root / f"{name}_{content.hexdigest()[:12]}"
    source_dir = build_dir / "src"
    source_dir.mkdir(parents=True, exist_ok=True)
    with open(root / f"{build_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when this process exits, however
        (build_dir / "lock").unlink(missing_ok=True)
        for file_name, data in files.items():  # same content: rewriting one is safe
            copy = source_dir / file_name
            if not copy.exists() or copy.read_bytes() != data:
                copy.write_bytes(data)  # missing, or a build killed mid-copy
        with _packaged_ninja_first():
            load(
                name=name,
                sources=[str(source_dir / source) for source in SOURCES],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                is_python_module=False,  # registers torch.ops.pdcluster.*
            )


@contextlib.contextmanager
def _packaged_ninja_first() -> Iterator[None]:
    """Run torch's build with the `ninja` package's binary first on PATH, whatever PATH this
    process has. Two ninja versions hash their build log differently and each would take the
    other's build for stale and rebuild everything: a system ninja found by one process (a test
    run, a Ray worker) and the package's by another (a `ray job`, a venv's shell) must not
    take turns."""
    import ninja

    path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{path}"
    try:
        yield
    finally:
        os.environ["PATH"] = path
