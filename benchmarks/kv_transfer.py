"""P->D KV handoff throughput through RayKVConnector, against memcpy on the same machine.

A producer actor (its own KV pool, role "producer") publishes a finished request with
`request_finished`; a consumer actor (another pool, role "consumer") runs the scheduler and
worker hooks (`get_num_new_matched_tokens` ... `start_load_kv`, then `get_finished` polled as a
step loop would) until the KV has landed in its blocks, then acks the producer through the
default ack path (a named actor's `ack_kv`). Block ids on both sides are shuffled runs, so the
publish is several arrays and the load several scattered copies.

    handoff ms  = publish (inside P) + load (inside D, start_load_kv -> copied)
    e2e ms      = driver wall time of both actor calls (adds two RPCs and the params' transit)
    memcpy GB/s = np.copyto of the same bytes into a pre-touched buffer, inside D
    ratio       = handoff GB/s / memcpy GB/s (two copies is the floor: 0.5)
    checksum    = the handoff's cost of checking its bytes (connectors/checksum.py): handoffs
                  with and without checksums alternate, and this is the ratio of their medians

Usage:
    python -m pdcluster.benchmarks.kv_transfer                     # single node, 1..512 MB
    python -m pdcluster.benchmarks.kv_transfer --multinode         # also across two raylets
    python -m pdcluster.benchmarks.kv_transfer --prealloc off      # plasma memory touched lazily

The single-node run starts Ray through the product's launcher (`cluster.control.launch.init_ray`), so
it measures the plasma settings the product runs with unless --prealloc overrides them.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
PRODUCER_NAME = "bench-kv-producer"
PREALLOC_ENV = "RAY_preallocate_plasma_memory"  # Ray's system config, read when a raylet starts


@dataclass(frozen=True)
class Layout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * np.dtype(self.dtype).itemsize


def shuffled_runs(num_blocks: int, run: int, pool_blocks: int, seed: int) -> list[int]:
    """num_blocks distinct block ids of a pool, as runs of `run` consecutive ids in random
    order: what a block pool hands out after some churn."""
    starts = np.random.default_rng(seed).permutation(pool_blocks // run)[: -(-num_blocks // run)]
    ids = [int(s) * run + i for s in starts for i in range(run)]
    return ids[:num_blocks]


def make_actors(ray, layout: Layout, pool_blocks: int, run: int, multinode: bool):
    import torch

    from pdcluster.connectors.base import KVTransferParams
    from pdcluster.connectors.ray_kv import RayKVConnector
    from pdcluster.engine.request import Request, RequestStatus
    from pdcluster.engine.sampling_params import SamplingParams

    def pool_of(fill_by_block: bool) -> torch.Tensor:
        pool = torch.empty((pool_blocks, *layout.block_shape), dtype=getattr(torch, layout.dtype))
        if fill_by_block:  # block b holds the value b: the consumer can check where bytes landed
            pool.copy_(torch.arange(pool_blocks, dtype=pool.dtype).view(-1, 1, 1, 1, 1, 1))
        else:
            pool.fill_(-1)  # touched: no page faults during the measurement
        return pool

    p_opts = {"resources": {"p": 1}} if multinode else {}
    d_opts = {"resources": {"d": 1}} if multinode else {}

    @ray.remote(num_cpus=0, max_concurrency=2, name=PRODUCER_NAME, **p_opts)
    class Producer:
        def __init__(self) -> None:
            pool = pool_of(fill_by_block=True)
            self.conns = {  # one name, two incarnations: with and without checksums
                checked: RayKVConnector(
                    PRODUCER_NAME, "producer", layout.block_size, lease_s=600, checksum=checked
                )
                for checked in (True, False)
            }
            for conn in self.conns.values():
                conn.register_kv_caches(pool)
            self.sent: set[str] = set()

        def publish(self, rid: str, num_blocks: int, seed: int, checksum: bool):
            request = Request(rid, [1] * (num_blocks * layout.block_size), SamplingParams())
            request.kv_transfer_params = KVTransferParams.remote_decode()
            request.num_computed_tokens = request.num_prompt_tokens
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            block_ids = shuffled_runs(num_blocks, run, pool_blocks, seed)
            start = time.perf_counter()
            delay_free, params = self.conns[checksum].request_finished(request, block_ids)
            publish_ms = (time.perf_counter() - start) * 1e3
            assert delay_free
            return {"params": params, "src_block_ids": block_ids, "publish_ms": publish_ms}

        def ack_kv(self, rid: str, epoch: str) -> None:  # RPC thread, while wait_sent polls
            for conn in self.conns.values():
                if conn.epoch == epoch:
                    conn.ack(rid, epoch)

        def wait_sent(self, rid: str, timeout_s: float = 30.0) -> bool:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                for conn in self.conns.values():
                    self.sent |= conn.get_finished(set())[0]
                if rid in self.sent:
                    self.sent.discard(rid)
                    return True
                time.sleep(0.001)
            return False

    @ray.remote(num_cpus=0, **d_opts)
    class Consumer:
        def __init__(self) -> None:
            self.conn = RayKVConnector("bench-kv-consumer", "consumer", layout.block_size)
            self.pool = pool_of(fill_by_block=False)
            self.conn.register_kv_caches(self.pool)

        def load(self, published: dict, seed: int) -> dict:
            params = published["params"]
            num_tokens = params.num_tokens
            request = Request(f"d-{seed}", [1] * (num_tokens + 1), SamplingParams(), None, None)
            request.kv_transfer_params = params
            del published, params  # the connector holds the only reference from here on
            num_blocks = -(-num_tokens // layout.block_size)
            block_ids = shuffled_runs(num_blocks, run, pool_blocks, seed + 1)
            start = time.perf_counter()
            num_external, load_async = self.conn.get_num_new_matched_tokens(request, 0)
            assert load_async and num_external == num_tokens
            self.conn.update_state_after_alloc(request, block_ids, num_external)
            self.conn.start_load_kv(self.conn.build_connector_meta(None))
            while True:  # the step loop: poll, yield briefly
                _, recving = self.conn.get_finished(set())
                if request.request_id in recving:
                    break
                if self.conn.get_failed_loads():
                    raise RuntimeError("load failed")
                time.sleep(0.0002)
            load_ms = (time.perf_counter() - start) * 1e3
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            self.conn.request_finished(request, block_ids)  # as D's scheduler does at the end
            return {"load_ms": load_ms, "dst_block_ids": block_ids}

        def check(self, src_block_ids: list[int], dst_block_ids: list[int]) -> bool:
            got = self.pool[dst_block_ids, 0, 0, 0, 0, 0]
            return bool((got == torch.tensor(src_block_ids, dtype=got.dtype)).all())

        def memcpy_gbps(self, nbytes: int, trials: int) -> float:
            src = np.ones(nbytes, np.uint8)
            dst = np.zeros(nbytes, np.uint8)  # both touched
            times = []
            for _ in range(trials + 1):
                start = time.perf_counter()
                np.copyto(dst, src)
                times.append(time.perf_counter() - start)
            return nbytes / statistics.median(times[1:]) / 1e9

    producer = Producer.remote()
    consumer = Consumer.remote()
    ray.get(consumer.memcpy_gbps.remote(1 << 20, 1))  # both actors are up
    return producer, consumer


def handoff(ray, producer, consumer, num_blocks: int, seed: int, checksum: bool = True) -> dict:
    rid = f"req-{seed}"
    start = time.perf_counter()
    published = producer.publish.remote(rid, num_blocks, seed, checksum)
    loaded = ray.get(consumer.load.remote(published, seed))  # resolved by Ray on the way
    e2e_ms = (time.perf_counter() - start) * 1e3
    pub = ray.get(published)
    src_block_ids = pub["src_block_ids"]
    publish_ms = pub["publish_ms"]
    del pub, published  # the driver's references to the object
    assert ray.get(producer.wait_sent.remote(rid)), "producer never saw the ack"
    assert ray.get(consumer.check.remote(src_block_ids, loaded["dst_block_ids"]))
    return {"publish_ms": publish_ms, "load_ms": loaded["load_ms"], "e2e_ms": e2e_ms}


_seeds = iter(range(1000, 10**9, 2))  # request ids and block shuffles, unique per handoff


def measure(ray, producer, consumer, layout: Layout, sizes_mb: list[float], args) -> list[dict]:
    rows = []
    for size_mb in sizes_mb:
        num_blocks = max(1, round(size_mb * 2**20 / layout.block_bytes))
        nbytes = num_blocks * layout.block_bytes
        trials, unchecked = [], []
        for _ in range(args.trials):  # alternate, so that both see the same machine
            for checksum, into in ((True, trials), (False, unchecked)):
                into.append(handoff(ray, producer, consumer, num_blocks, next(_seeds), checksum))
                time.sleep(args.pause_s)  # lets the store free the previous object
        memcpy = ray.get(consumer.memcpy_gbps.remote(nbytes, args.trials))
        med = {k: statistics.median(t[k] for t in trials) for k in trials[0]}
        handoff_ms = statistics.median(t["publish_ms"] + t["load_ms"] for t in trials)
        unchecked_ms = statistics.median(t["publish_ms"] + t["load_ms"] for t in unchecked)
        gbps = nbytes / (handoff_ms / 1e3) / 1e9
        rows.append(
            dict(
                MiB=nbytes / 2**20, blocks=num_blocks, **med, handoff_ms=handoff_ms,
                handoff_gbps=gbps, memcpy_gbps=memcpy, ratio=gbps / memcpy,
                checksum=handoff_ms / unchecked_ms - 1,
            )
        )  # fmt: skip
    return rows


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    head = (
        f"{'MiB':>8} {'blocks':>6} {'publish':>8} {'load':>8} {'handoff':>8} {'e2e':>8} "
        f"{'handoff':>8} {'memcpy':>7} {'ratio':>6} {'checksum':>8}"
    )
    print(head)
    print(
        f"{'':>8} {'':>6} {'ms':>8} {'ms':>8} {'ms':>8} {'ms':>8} {'GB/s':>8} {'GB/s':>7} "
        f"{'':>6} {'cost':>8}"
    )
    for r in rows:
        print(
            f"{r['MiB']:>8.1f} {r['blocks']:>6} {r['publish_ms']:>8.2f} {r['load_ms']:>8.2f} "
            f"{r['handoff_ms']:>8.2f} {r['e2e_ms']:>8.2f} {r['handoff_gbps']:>8.2f} "
            f"{r['memcpy_gbps']:>7.2f} {r['ratio']:>6.2f} {r['checksum']:>+8.1%}"
        )


def run_suite(ray, layout: Layout, args, multinode: bool) -> None:
    pool_blocks = -(-int(max(args.sizes_mb) * 2**20) // layout.block_bytes) + 2 * args.run
    pool_blocks = -(-pool_blocks // args.run) * args.run
    producer, consumer = make_actors(ray, layout, pool_blocks, args.run, multinode)
    where = "two raylets (P on node 'p', D on node 'd')" if multinode else "one raylet"
    warm_blocks = pool_blocks - 2 * args.run
    cold = []
    for _ in range(args.warmup):  # touches both pools and the store(s)
        cold.append(handoff(ray, producer, consumer, warm_blocks, next(_seeds)))
        time.sleep(args.pause_s)
    if cold:
        mib = warm_blocks * layout.block_bytes / 2**20
        print(
            f"\nfirst (cold) handoff of {mib:.0f} MiB: publish {cold[0]['publish_ms']:.1f} ms + "
            f"load {cold[0]['load_ms']:.1f} ms"
        )
    rows = measure(ray, producer, consumer, layout, args.sizes_mb, args)
    print_table(f"KV handoff through RayKVConnector, {where}; median of {args.trials}", rows)
    tokens = args.typical_tokens
    typical = measure(ray, producer, consumer, layout, [tokens * layout.block_bytes
                                                        / layout.block_size / 2**20], args)  # fmt: skip
    t = typical[0]
    print(
        f"time-to-handoff, {tokens}-token prompt ({t['MiB']:.1f} MiB): publish "
        f"{t['publish_ms']:.2f} ms + load {t['load_ms']:.2f} ms = {t['handoff_ms']:.2f} ms "
        f"(e2e with RPCs {t['e2e_ms']:.2f} ms)"
    )
    for actor in (producer, consumer):
        ray.kill(actor)


def start_ray(args, multinode: bool):
    import ray

    from pdcluster.cluster.config import RaySettings
    from pdcluster.cluster.control.launch import init_ray

    store_bytes = int(max(args.sizes_mb) * 2**20 * 2.5) + (256 << 20)
    if not multinode:
        init_ray(RaySettings(num_cpus=2, object_store_memory=store_bytes))
        return ray, None
    from ray.cluster_utils import Cluster

    head = {"num_cpus": 0, "object_store_memory": 256 << 20, "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    cluster.add_node(num_cpus=1, resources={"p": 1}, object_store_memory=store_bytes)
    cluster.add_node(num_cpus=1, resources={"d": 1}, object_store_memory=store_bytes)
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    return ray, cluster


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64, 256, 512])
    parser.add_argument("--trials", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--num-layers", type=int, default=12)
    parser.add_argument("--num-kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--run", type=int, default=32, help="consecutive block ids per run")
    parser.add_argument("--typical-tokens", type=int, default=2048)
    parser.add_argument("--pause-s", type=float, default=0.2, help="idle time between handoffs")
    parser.add_argument("--multinode", action="store_true", help="also across two raylets")
    parser.add_argument(
        "--prealloc",
        choices=["product", "on", "off"],
        default="product",
        help="touch all plasma memory when a raylet starts (product: as init_ray, Ray's "
        "default, off; on only bought a faster first handoff for a slower start)",
    )
    args = parser.parse_args(argv)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p
    )  # the actors import connectors/ and engine/
    if args.prealloc != "product":
        os.environ[PREALLOC_ENV] = "1" if args.prealloc == "on" else "0"
    sys.path.insert(0, str(REPO_ROOT))

    layout = Layout(args.num_layers, args.num_kv_heads, args.head_dim, args.block_size, args.dtype)
    print("command:", " ".join([Path(sys.executable).name, "-m", "pdcluster.benchmarks.kv_transfer", *(
        argv if argv is not None else sys.argv[1:])]))  # fmt: skip
    import ray as ray_module

    print(
        f"layout: {args.num_layers} layers x 2 x block {args.block_size} x {args.num_kv_heads} kv "
        f"heads x head_dim {args.head_dim}, {args.dtype}: {layout.block_bytes} B/block; "
        f"block ids in shuffled runs of {args.run}"
    )
    print(
        f"ray {ray_module.__version__}, {os.cpu_count()} CPUs, {platform.machine()}, "
        f"--prealloc {args.prealloc}"
    )
    for multinode in [False, True] if args.multinode else [False]:
        start_s = time.perf_counter()
        ray, cluster = start_ray(args, multinode)
        prealloc = os.environ.get(PREALLOC_ENV, "unset (Ray's default: off)")
        print(f"(ray started in {time.perf_counter() - start_s:.1f} s; {PREALLOC_ENV}={prealloc})")
        try:
            run_suite(ray, layout, args, multinode)
        finally:
            ray.shutdown()
            if cluster is not None:
                cluster.shutdown()


if __name__ == "__main__":
    main()
