"""The layout side of the Ray KV connectors: the handle a consumer reads and its checks, the
loads the scheduler side hands the worker side, how blocks of the pool map to the arrays of
one published object (`BlockArrays`), and a latency histogram."""

from __future__ import annotations

import concurrent.futures
import math
import warnings
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import ray
import torch

from pdcluster.connectors.base import KVHandle, KVLoadError, KVTransferParams
from pdcluster.connectors.checksum import ChecksumError, check_rows, row_offsets
from pdcluster.connectors.stats import LatencyHistogram

if TYPE_CHECKING:
    from pdcluster.connectors.base import HeadShardedKV
    from pdcluster.engine.request import Request

_RAW_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# ---- the handle --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RayKVHandle(KVHandle):
    """What a consumer needs to read one published request (see `connectors.ray_kv`). The
    ref is a field of a dataclass, never an argument of its own, so Ray does not resolve it
    when the params travel inside an actor call."""

    ref: ray.ObjectRef | None  # of a list of arrays [run_len, *block_shape]; None once released
    run_lengths: tuple[int, ...]  # blocks per array, in source block order
    block_shape: tuple[int, ...]  # [num_layers, 2, block_size, num_kv_heads, head_dim]
    dtype: str  # the pool's torch dtype, e.g. "torch.float32"
    nbytes: int  # bytes of the object's arrays
    # A producer that drafts (speculative method draft_model): its draft model's block layout;
    # the object's arrays are the target's runs, then the draft's same runs.
    draft_layout: tuple[tuple[int, ...], str] | None = None
    # xxHash3-64 of each row of each array, in order (connectors/checksum.py); None: unchecked.
    digests: tuple[int, ...] | None = None
    epoch: str = ""  # the producer's incarnation: its ack names it

    def released(self) -> RayKVHandle:
        return replace(self, ref=None)

    def check(self) -> None:
        """KVLoadError on anything malformed."""
        if not isinstance(self.ref, ray.ObjectRef):
            raise KVLoadError(f"handle ref must be an ObjectRef, got {type(self.ref).__name__}")
        _check_ints(self.run_lengths, "run_lengths")
        _check_ints(self.block_shape, "block_shape")
        if len(self.block_shape) != 5:
            raise KVLoadError(f"handle block_shape {self.block_shape} is not 5-dimensional")
        if not isinstance(self.dtype, str) or not isinstance(self.nbytes, int):
            raise KVLoadError("handle needs a dtype string and an integer nbytes")
        if self.draft_layout is not None:
            if not isinstance(self.draft_layout, tuple) or len(self.draft_layout) != 2:
                raise KVLoadError("handle draft_layout must be (block_shape, dtype)")
            shape, dtype = self.draft_layout
            _check_ints(shape, "draft_layout block shape")
            if len(shape) != 5 or shape[2] != self.block_shape[2] or not isinstance(dtype, str):
                raise KVLoadError(
                    f"handle draft_layout {self.draft_layout} does not fit its blocks"
                )
        num_rows = self.num_blocks * (1 if self.draft_layout is None else 2)
        if self.digests is not None and (
            not isinstance(self.digests, tuple)
            or len(self.digests) != num_rows
            or not all(isinstance(d, int) for d in self.digests)
        ):
            raise KVLoadError(f"handle digests must be a tuple of {num_rows} ints")
        if not isinstance(self.epoch, str):
            raise KVLoadError("handle epoch must be a string")

    @property
    def num_blocks(self) -> int:
        return sum(self.run_lengths)


def checked_handle(
    params: KVTransferParams,
    request: Request,
    block_size: int,
    layout: tuple[tuple[int, ...], str] | None,
) -> RayKVHandle:
    """The params' handle, checked field by field and against this request and pool."""
    handle = params.handle
    if not isinstance(handle, RayKVHandle):
        raise KVLoadError(f"handle must be a RayKVHandle, got {type(handle).__name__}")
    handle.check()
    if not isinstance(params.remote_engine_id, str) or not params.remote_engine_id:
        raise KVLoadError("remote_engine_id must be a non-empty string")
    if not isinstance(params.remote_request_id, str) or not params.remote_request_id:
        raise KVLoadError("remote_request_id must be a non-empty string")
    num_tokens = params.num_tokens
    if not isinstance(num_tokens, int) or not 0 < num_tokens <= request.num_tokens:
        raise KVLoadError(f"num_tokens {num_tokens!r} not in [1, {request.num_tokens}]")
    if handle.block_shape[2] != block_size:
        raise KVLoadError(
            f"producer block size {handle.block_shape[2]} != consumer block size {block_size}"
        )
    if handle.num_blocks != -(-num_tokens // block_size):
        raise KVLoadError(f"{handle.num_blocks} published blocks do not hold {num_tokens} tokens")
    if layout is not None and (handle.block_shape, handle.dtype) != layout:
        raise KVLoadError(
            f"producer block layout {handle.block_shape} {handle.dtype} != ours {layout}"
        )
    return handle


def _check_ints(value: object, name: str) -> None:
    if (
        not isinstance(value, tuple)
        or not value
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise KVLoadError(f"handle {name} must be a non-empty tuple of positive ints")


# ---- messages between the scheduler side and the worker side -------------------------------
@dataclass
class RayKVLoad:
    """One request's load: segments are (array_index, first_src_row, first_dst_block, count)."""

    request_id: str
    remote_engine_id: str
    remote_request_id: str
    ref: ray.ObjectRef | None  # None once landed or failed: the object is no longer held
    segments: list[tuple[int, int, int, int]]
    nbytes: int
    num_runs: int  # the target's arrays in the object (the draft's follow them)
    num_tokens: int = 0
    # The object's draft KV (for tokens [0, this)) goes into our draft's blocks: the producer
    # drafts with a model of our draft's layout. 0: only the target's KV is copied.
    num_draft_tokens: int = 0
    digests: tuple[int, ...] | None = None  # the handle's checksums (None: unchecked)
    remote_epoch: str = ""  # the producer's incarnation, named in the ack
    started_s: float = 0.0
    ready_s: float = 0.0  # not reported finished before (a simulated link's arrival)
    future: concurrent.futures.Future | None = None


@dataclass
class RayKVConnectorMetadata:
    """Loads recorded by the scheduler side since the previous step."""

    loads: list[RayKVLoad] = field(default_factory=list)


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


class BlockArrays:
    """An instance's KV pool as the arrays objects carry: views over runs of consecutive
    blocks to publish (no gather copy on a CPU pool), and copies of fetched runs into blocks.

    With a draft model (speculative method draft_model) the draft's KV cache follows the
    target's blocks (engine.spec_decode.draft_model): its runs travel after the target's."""

    def __init__(
        self, kv_caches: torch.Tensor, block_size: int, draft_kv_cache: torch.Tensor | None = None
    ) -> None:
        if kv_caches.dim() != 6 or kv_caches.shape[3] != block_size:
            raise ValueError(
                f"KV pool must be [num_blocks, num_layers, 2, {block_size}, kv_heads, "
                f"head_dim], got {list(kv_caches.shape)}"
            )
        if not kv_caches.is_contiguous():
            raise ValueError("KV pool must be contiguous")
        self.dtype = str(kv_caches.dtype)
        self.tensor = numpy_compatible(kv_caches)  # the pool, or its integer view (bf16)
        self._pool_np = self.tensor.numpy() if self.tensor.device.type == "cpu" else None
        self.block_shape: tuple[int, ...] = tuple(self.tensor.shape[1:])
        self.block_nbytes = self.tensor[0].numel() * self.tensor.element_size()
        self._shards: HeadShardedKV | None = None
        self.draft = None if draft_kv_cache is None else BlockArrays(draft_kv_cache, block_size)

    def use_head_shards(self, shards: HeadShardedKV) -> None:
        """A tensor-parallel instance (this pool holds rank 0's heads): objects carry whole
        blocks, every rank's heads, so either side of a handoff may run at any TP size."""
        if self.draft is not None:
            raise ValueError("a tensor-parallel instance has no draft model")
        self._shards = shards
        self.block_shape = tuple(shards.block_shape)
        self.block_nbytes = math.prod(self.block_shape) * self.tensor.element_size()

    @property
    def layout(self) -> tuple[tuple[int, ...], str]:
        return self.block_shape, self.dtype

    @property
    def draft_layout(self) -> tuple[tuple[int, ...], str] | None:
        return None if self.draft is None else self.draft.layout

    def runs(
        self, block_ids: list[int], owned: bool = False
    ) -> tuple[list[np.ndarray], tuple[int, ...]]:
        """One array [run_len, *block_shape] per run of consecutive ids, then the draft's
        for the same runs (with a draft model), and the run lengths. `owned`: arrays that
        never alias the blocks (read after the blocks are reused)."""
        runs = consecutive_runs(block_ids)
        if self._shards is not None:  # every rank's heads, gathered on this rank
            read = self._shards.read_blocks
            arrays = [numpy_compatible(read(s, n)).cpu().numpy() for s, n in runs]
        elif self._pool_np is not None:
            arrays = [self._pool_np[s : s + n] for s, n in runs]  # views: no gather copy
            arrays = [a.copy() for a in arrays] if owned else arrays
        else:  # device pool: stage each run through host memory
            arrays = [self.tensor[s : s + n].cpu().numpy() for s, n in runs]
        if self.draft is not None:
            arrays += self.draft.runs(block_ids, owned)[0]
        return arrays, tuple(n for _, n in runs)

    def copy_in(
        self,
        arrays: list[np.ndarray],
        segments: list[tuple[int, int, int, int]],
        num_runs: int,
        with_draft: bool,
        digests: tuple[int, ...] | None = None,
    ) -> None:
        """Copy (array_index, src_row, dst_block, count) segments of `arrays[:num_runs]` into
        blocks and, `with_draft`, of the draft's runs after them into the draft's blocks.
        With `digests` (one per row of every array, in order), each copied block is checked
        against its own: ChecksumError on a mismatch."""
        offsets = row_offsets(arrays)
        if with_draft:
            if self.draft is None or len(arrays) != 2 * num_runs:
                raise ValueError("the object carries no draft KV for this pool")
            draft_digests = None if digests is None else digests[offsets[num_runs] :]
            self.draft.copy_in(arrays[num_runs:], segments, num_runs, False, draft_digests)
        arrays = arrays[:num_runs]
        num_rows = sum(len(a) for a in arrays)
        if digests is not None and len(digests) < num_rows:
            raise ChecksumError(f"{len(digests)} checksums for {num_rows} blocks")
        for array_idx, src, dst, count in segments:
            source = arrays[array_idx][src : src + count]  # [count, *block_shape]
            if source.shape != (count, *self.block_shape):
                raise ValueError(
                    f"source run has shape {source.shape}, expected {self.block_shape}"
                )
            first = offsets[array_idx] + src
            expected = None if digests is None else digests[first : first + count]
            if self._pool_np is not None and self._shards is None:
                self._copy_rows(source, dst, expected)
                continue
            if expected is not None:  # checked where it lies: the copy goes to a device or ranks
                check_rows(source, expected, "KV object")
            with warnings.catch_warnings():  # read-only store memory, only read from
                warnings.simplefilter("ignore", UserWarning)
                blocks = torch.from_numpy(source)
                if self._shards is not None:  # each rank keeps its heads
                    self._shards.write_blocks(dst, blocks)
                else:
                    self.tensor[dst : dst + count].copy_(blocks)

    def _copy_rows(self, source: np.ndarray, dst: int, digests: tuple[int, ...] | None) -> None:
        """Copy rows into blocks dst...; each block checked as it lands, still in cache."""
        target = self._pool_np[dst : dst + len(source)]
        if digests is None:
            np.copyto(target, source)
            return
        for i in range(len(source)):
            np.copyto(target[i], source[i])
            check_rows(target[i : i + 1], digests[i : i + 1], "KV object")


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

    def histogram(self) -> LatencyHistogram:
        return LatencyHistogram(
            self.BUCKETS_MS, tuple(self._bucket_counts), self._total, self._count
        )
