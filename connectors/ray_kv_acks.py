"""How a consumer of the Ray KV connector (connectors/ray_kv.py) acks its producer: by the
producer's engine id, its request id and the epoch its handle named (a producer refuses an ack
for another of its incarnations)."""

from __future__ import annotations

from collections.abc import Callable

import ray

AckSender = Callable[[str, str, str], None]  # (producer engine id, its request id, its epoch)


class ActorAckSender:
    """Default ack path: the producer is a named actor called `remote_engine_id`."""

    def __init__(self) -> None:
        self._actors: dict[str, ray.actor.ActorHandle] = {}

    def __call__(self, remote_engine_id: str, remote_request_id: str, epoch: str) -> None:
        self.find(remote_engine_id).ack_kv.remote(remote_request_id, epoch)  # fire and forget

    def knows(self, remote_engine_id: str) -> bool:
        return remote_engine_id in self._actors

    def find(self, remote_engine_id: str) -> ray.actor.ActorHandle:
        """The producer's actor, looked up once (a call to Ray's GCS: blocks while the GCS
        is down, so the instance makes it off its step thread, when a request arrives)."""
        actor = self._actors.get(remote_engine_id)
        if actor is None:
            actor = self._actors[remote_engine_id] = ray.get_actor(remote_engine_id)
        return actor
