"""Typed answers of a pool's control-plane actors: the pool controller's membership and
planner state, and the cluster KV pool's stats. The actors return them and gateway replicas, the CLI and the
benchmarks read them as they are; `to_dict` is their JSON form, used only where they leave
the process (an HTTP response, a benchmark's result file).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.routing.role import Role


@dataclass(frozen=True)
class MemberList:
    """The pool's membership as one controller incarnation numbers it
    (`PoolController.members_after`): a reader passes (`epoch`, `version`) back to wait for
    the next change."""

    epoch: str  # one per controller incarnation: a version from another one is meaningless
    version: int  # one more at every join and every leave
    members: dict[str, Role]  # instance id (its actor name) -> role
    # The LoRA adapters every instance serves (loaded at start or at run time), by name
    adapters: dict[str, LoRARequest] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class ScalingCount:
    """How many times the planner resized `role` in one direction."""

    role: Role
    direction: str  # "up" or "down"
    count: int


@dataclass(frozen=True)
class PlannerState:
    """The pool controller's view of its planner (`PoolController.planner_state()`)."""

    desired: dict[Role, int]  # every role: the planner's count where it decides, else the live one
    decisions: tuple[ScalingCount, ...] = ()
    round_s: float | None = None  # its last round (reading stats, deciding); None: none yet

    def to_dict(self) -> dict[str, Any]:
        """{"desired": {role: count}, "decisions": [[role, direction, count]], "round_s"}."""
        return {
            "desired": {r.value: n for r, n in self.desired.items()},
            "decisions": [[d.role.value, d.direction, d.count] for d in self.decisions],
            "round_s": self.round_s,
        }


@dataclass(frozen=True)
class KVPoolStats:
    """The cluster KV pool's occupancy and counters (`KVPoolActor.stats()`)."""

    num_publishes: int  # entries kept
    num_rejected: int  # entries not kept: every block held already, or no room
    num_evictions: int
    num_lookups: int
    num_hit_blocks: int  # blocks found by lookups
    num_bytes: int  # held now
    capacity_bytes: int
    num_entries: int  # objects (runs of blocks) held
    num_blocks: int
    num_pinned_entries: int  # entries a reader looked up and has not released
    num_failed_publishes: int  # the publisher's object was gone before the pool copied it
    num_refused_releases: int  # releases naming another incarnation (epoch) of the pool
    bytes_published: int  # bytes of the entries kept

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)
