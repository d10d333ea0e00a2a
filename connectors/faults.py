"""Fault injection, for the fault-injection suite only (tests/test_fault_injection.py): the
faults armed in this process, which the transfer paths consult where each fault strikes.

Off unless the process runs with PDCLUSTER_FAULT_INJECTION=1, which no command, config or
manifest of the product sets: `arm` refuses otherwise, so a shipped cluster cannot be made to
corrupt or delay anything. An unarmed fault costs one dict lookup. No Ray here."""

from __future__ import annotations

import enum
import os
import threading
from dataclasses import dataclass

import numpy as np

ENV = "PDCLUSTER_FAULT_INJECTION"


class Fault(enum.StrEnum):
    CORRUPT_KV = "corrupt_kv"  # P: a byte of the next KV object's last block flipped, once hashed
    CORRUPT_POOL_ENTRY = "corrupt_pool_entry"  # the same for a KV pool publish
    CORRUPT_ENCODER_OUTPUT = "corrupt_encoder_output"  # E: the same for an encoder output
    DELAY_LOAD = "delay_load"  # D (P2D) or any (pool): a fetched KV object lands `seconds` late
    DELAY_ACK = "delay_ack"  # D: an ack leaves `seconds` after the load landed


@dataclass(frozen=True)
class FaultSpec:
    fault: Fault
    times: int = 1  # how many times it strikes before it disarms itself
    seconds: float = 0.0  # for the delays

    def __post_init__(self) -> None:
        object.__setattr__(self, "fault", Fault(self.fault))
        if self.times < 1 or self.seconds < 0:
            raise ValueError("a fault strikes at least once, after a delay of 0 s or more")


_armed: dict[Fault, tuple[FaultSpec, int]] = {}  # fault -> (its spec, strikes left)
_lock = threading.Lock()


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def arm(spec: FaultSpec) -> None:
    """Arm a fault in this process; PermissionError unless fault injection is enabled here."""
    if not enabled():
        raise PermissionError(f"fault injection is off in this process (set {ENV}=1 to test)")
    with _lock:
        _armed[spec.fault] = (spec, spec.times)


def disarm_all() -> None:
    with _lock:
        _armed.clear()


def strike(fault: Fault) -> FaultSpec | None:
    """The spec of `fault` if it is armed, counting one strike; None (almost always)."""
    if not _armed:
        return None
    with _lock:
        entry = _armed.get(fault)
        if entry is None:
            return None
        spec, left = entry
        if left <= 1:
            del _armed[fault]
        else:
            _armed[fault] = (spec, left - 1)
        return spec


def flipped(array: np.ndarray) -> np.ndarray:
    """A copy of `array` with one bit of its middle byte flipped."""
    corrupt = np.array(array, copy=True)
    raw = corrupt.reshape(-1).view(np.uint8)
    raw[raw.size // 2] ^= 0x10
    return corrupt
