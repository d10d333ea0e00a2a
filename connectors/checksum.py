"""Checksums of the bytes a transfer carries (DESIGN.md, "Data plane": every handoff is
checked). The producer hashes each block it sends, one row of a published array, with
xxHash3-64; the consumer checks each row it copies in against its digest before a token is
computed from it. A mismatch raises `ChecksumError`: the load fails closed and the request is
recomputed, never served from those bytes.

The consumer hashes each block right after copying it, from the cache the copy just filled,
not from memory: that costs a fraction of the copy. No Ray here."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from pdcluster.connectors.base import KVLoadError


class ChecksumError(KVLoadError):
    """Bytes read do not match the digest their producer sent."""


def digest(buffer: np.ndarray) -> int:
    """xxHash3-64 of a C-contiguous array's bytes."""
    return xxhash.xxh3_64_intdigest(buffer)


def row_digests(arrays: Sequence[np.ndarray]) -> tuple[int, ...]:
    """The digest of every row (one block) of every array, in order."""
    return tuple(digest(row) for array in arrays for row in array)


def row_offsets(arrays: Sequence[np.ndarray]) -> list[int]:
    """The index, among every array's rows in order, of each array's first row."""
    offsets, total = [], 0
    for array in arrays:
        offsets.append(total)
        total += len(array)
    return offsets


def check_rows(rows: np.ndarray, digests: Sequence[int], what: str) -> None:
    """ChecksumError unless row i of `rows` hashes to digests[i], for every row."""
    for i, row in enumerate(rows):
        if digest(row) != digests[i]:
            raise ChecksumError(f"{what}: block {i} does not match the producer's checksum")
