"""The layout side of the Ray KV connector: the handle a consumer reads, how blocks of the
pool map to the arrays of one published object, and a latency histogram."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import ray
import torch

_RAW_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---- the handle --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RayKVHandle:
    """What a consumer needs to read one published request (see the module docstring)."""

    ref: Any  # ray.ObjectRef of a list of arrays [run_len, *block_shape]
    run_lengths: tuple[int, ...]
    block_shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "refs": [self.ref],
            "run_lengths": list(self.run_lengths),
            "block_shape": list(self.block_shape),
            "dtype": self.dtype,
            "nbytes": self.nbytes,
        }

    @classmethod
    def from_dict(cls, handle: Any) -> RayKVHandle:
        """Raises ValueError on anything malformed."""
        if not isinstance(handle, dict):
            raise ValueError(f"handle must be a dict, got {type(handle).__name__}")
        refs = handle.get("refs")
        if not isinstance(refs, list) or len(refs) != 1 or not isinstance(refs[0], ray.ObjectRef):
            raise ValueError("handle['refs'] must be a list of one ObjectRef")
        run_lengths = _int_tuple(handle.get("run_lengths"), "run_lengths")
        block_shape = _int_tuple(handle.get("block_shape"), "block_shape")
        if not run_lengths or len(block_shape) != 5:
            raise ValueError("handle needs run_lengths and a 5-dim block_shape")
        if not isinstance(handle.get("dtype"), str) or not isinstance(handle.get("nbytes"), int):
            raise ValueError("handle needs a dtype string and an integer nbytes")
        return cls(refs[0], run_lengths, block_shape, handle["dtype"], handle["nbytes"])

    @property
    def num_blocks(self) -> int:
        return sum(self.run_lengths)


def _int_tuple(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, int) and v > 0 for v in value):
        raise ValueError(f"handle[{name!r}] must be a list of positive ints")
    return tuple(value)


def numpy_compatible(pool: torch.Tensor) -> torch.Tensor:
    """The pool itself, or a same-size integer view when NumPy lacks its dtype (bf16)."""
    try:
        torch.empty(0, dtype=pool.dtype).numpy()
        return pool
    except TypeError:
        return pool.view(_RAW_INT[pool.element_size()])


def consecutive_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """[(first_block_id, length)] of maximal runs of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def plan_segments(
    run_lengths: tuple[int, ...], first_src_block: int, dst_block_ids: list[int]
) -> list[tuple[int, int, int, int]]:
    """Copies (array_index, src_row, dst_block, count) moving source blocks first_src_block...
    onto dst_block_ids, merged where both sides are consecutive."""
    locations = [(a, row) for a, n in enumerate(run_lengths) for row in range(n)]
    segments: list[tuple[int, int, int, int]] = []
    for i, dst in enumerate(dst_block_ids):
        array_idx, row = locations[first_src_block + i]
        if segments:
            a, r, d, n = segments[-1]
            if a == array_idx and r + n == row and d + n == dst:
                segments[-1] = (a, r, d, n + 1)
                continue
        segments.append((array_idx, row, dst, 1))
    return segments


class Latency:
    """Last, mean and a cumulative histogram of a stream of durations, in constant space."""

    BUCKETS_MS = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)

    def __init__(self) -> None:
        self.last: float | None = None
        self._total, self._count = 0.0, 0
        self._bucket_counts = [0] * len(self.BUCKETS_MS)

    def add(self, ms: float) -> None:
        self.last, self._total, self._count = ms, self._total + ms, self._count + 1
        for i, upper in enumerate(self.BUCKETS_MS):
            if ms <= upper:
                self._bucket_counts[i] += 1

    @property
    def mean(self) -> float | None:
        return self._total / self._count if self._count else None

    def histogram(self) -> dict[str, Any]:
        """Cumulative counts per upper bound (ms), plus sum and count: Prometheus' shape."""
        return {
            "buckets_ms": list(self.BUCKETS_MS),
            "counts": list(self._bucket_counts),
            "sum_ms": self._total,
            "count": self._count,
        }
