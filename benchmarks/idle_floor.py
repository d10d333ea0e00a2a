"""Ray's own idle floor: what an actor process that does nothing costs, per process.

Starts a local Ray, `--actors` actors of an empty class (each its own worker process, as an
instance or a gateway replica is), waits `--settle-s`, then reads the CPU time of those
processes, and of Ray's daemons, from /proc over `--idle-s`. An idle pdcluster cluster
(benchmarks/front_cost.py, its "idle % of a core" table) costs this floor per process, plus
what its own loops spend:

    python -m pdcluster.benchmarks.idle_floor --actors 34 --idle-s 30
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import ray

from pdcluster.benchmarks.front_cost import RAY_DAEMONS, _cpu_s, _tree


@ray.remote(num_cpus=0)
class Idle:
    def pid(self) -> int:
        return os.getpid()


def _daemon_pids() -> list[int]:
    """Ray's daemons on this host (raylet, GCS, ...): processes whose command line names one."""
    pids = []
    for pid in _tree(1):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode().lower()
        except OSError:
            continue
        if "ray" in cmdline and any(d in cmdline for d in RAY_DAEMONS[:5]):
            pids.append(pid)
    return pids


def measure(num_actors: int, settle_s: float, idle_s: float) -> dict[str, float]:
    """% of one core: per idle actor process, and all of Ray's daemons together."""
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        actors = [Idle.remote() for _ in range(num_actors)]
        pids = ray.get([a.pid.remote() for a in actors])
        time.sleep(settle_s)
        daemons = _daemon_pids()
        before = {p: _cpu_s(p) for p in pids + daemons}
        start = time.monotonic()
        time.sleep(idle_s)
        elapsed = time.monotonic() - start
        after = {p: _cpu_s(p) for p in pids + daemons}

        def pct(group: list[int]) -> float:
            used = sum((after[p] or 0.0) - (before[p] or 0.0) for p in group)
            return used / elapsed * 100

        return {"per_actor_pct": pct(pids) / num_actors, "daemons_pct": pct(daemons)}
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--actors", type=int, default=8, help="idle actor processes")
    parser.add_argument("--settle-s", type=float, default=10.0)
    parser.add_argument("--idle-s", type=float, default=20.0)
    args = parser.parse_args(argv)
    floor = measure(args.actors, args.settle_s, args.idle_s)
    print(f"| idle actors | % of a core per actor process | Ray's daemons, % of a core |\n"
          f"|---|---|---|\n| {args.actors} | {floor['per_actor_pct']:.2f} | "
          f"{floor['daemons_pct']:.1f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
