"""A pool's membership (and the LoRA adapters it serves), held by an actor of its own so that
it outlives the pool controller.

One named actor per pool (`<pool>-members`), detached and on the head like the controller:
a restarted controller reads the membership back from it. It holds no other state and
answers only the controller, which writes the whole membership after every change; should
this actor itself restart (empty), the controller's next change writes it again.
"""

from __future__ import annotations

from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.routing.role import Role


def members_actor_name(pool: str) -> str:
    return f"{pool}-members"


class PoolMembers:
    """Wrap with `ray.remote(PoolMembers)`: instance id (its actor name) -> role."""

    def __init__(self) -> None:
        self._members: dict[str, Role] = {}
        self._adapters: dict[str, LoRARequest] | None = None  # None: never written

    def get(self) -> dict[str, Role]:
        return dict(self._members)

    def put(self, members: dict[str, Role]) -> None:
        self._members = dict(members)

    def get_adapters(self) -> dict[str, LoRARequest] | None:
        return None if self._adapters is None else dict(self._adapters)

    def put_adapters(self, adapters: dict[str, LoRARequest]) -> None:
        self._adapters = dict(adapters)
