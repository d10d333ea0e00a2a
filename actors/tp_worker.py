"""The tensor-parallel workers of a cluster instance: ranks 1.. as Ray actors on the node of
their InstanceActor (rank 0), each reserving what the instance reserves.

The workers are owned by the instance's actor, so Ray ends them when it dies. A worker that
dies ends its instance's process in turn (as a crash: Ray restarts the instance, which starts
new workers, and the gateway migrates its streams), so that an instance never steps on with a
missing shard.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

import ray
from ray.actor import ActorHandle
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pdcluster.actors.priority import run_at_normal_priority
from pdcluster.engine.tp_worker import STOP_TIMEOUT_S, WorkerSpec, run_worker

logger = logging.getLogger(__name__)


class TPWorkerActor:
    """Wrap with `ray.remote`; `run` serves one rank until its instance stops."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, spec: WorkerSpec) -> None:
        run_at_normal_priority()
        run_worker(spec)


def exit_instance(reason: str) -> None:
    """End this instance's process as a crash would (Ray restarts it; its streams migrate)."""
    logger.error("%s; the instance exits", reason)
    os._exit(1)


@dataclass
class RayWorkers:
    actors: list[ActorHandle]
    runs: list[ray.ObjectRef]  # each worker's `run`: it returns only when told to stop
    pids: list[int]
    stopping: threading.Event = field(default_factory=threading.Event)

    def watch(self) -> None:
        """On a thread: end this process as soon as a worker ends unasked."""
        ray.wait(self.runs, num_returns=1, timeout=None)
        if not self.stopping.is_set():
            exit_instance("a tensor-parallel worker of this instance died")

    def stats(self) -> dict[str, list]:
        actor_ids = [a._actor_id.hex() for a in self.actors]  # in the ids of their objects
        return {"tp_worker_pids": self.pids, "tp_worker_actor_ids": actor_ids}

    def stop(self) -> None:
        self.stopping.set()
        ray.wait(self.runs, num_returns=len(self.runs), timeout=STOP_TIMEOUT_S)
        for actor in self.actors:
            ray.kill(actor)


def start_ray_workers(specs: list[WorkerSpec]) -> RayWorkers:
    """Ranks 1.. as actors pinned to this actor's node (the engine's launcher in the
    cluster); call from inside the InstanceActor."""
    context = ray.get_runtime_context()
    assigned = context.get_assigned_resources()
    pinned = NodeAffinitySchedulingStrategy(context.get_node_id(), soft=False)
    actors = [
        ray.remote(TPWorkerActor)
        .options(
            num_cpus=assigned.get("CPU", 0),
            num_gpus=assigned.get("GPU", 0),
            scheduling_strategy=pinned,
            max_restarts=0,
        )
        .remote()
        for _ in specs
    ]
    pids = ray.get([a.pid.remote() for a in actors])
    runs = [a.run.remote(s) for a, s in zip(actors, specs, strict=True)]
    workers = RayWorkers(actors, runs, pids)
    threading.Thread(target=workers.watch, name="tp-watch", daemon=True).start()
    return workers
