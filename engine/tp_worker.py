"""The ranks of a tensor-parallel instance: rank 0 (`TensorParallelGroup`, inside the
engine, which schedules and samples) and the workers of ranks 1.. (`run_worker`), which run
their shard of every forward pass as rank 0 broadcasts it.

How a worker process is started is the owner's choice (`WorkerLauncher`): local processes
here (`start_processes`), Ray actors pinned to the instance's node in the cluster.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from pdcluster.engine.attention import AttentionMetadata, allocate_kv_cache
from pdcluster.engine.config import CacheConfig
from pdcluster.engine.models.loader import ModelInfo, load_model
from pdcluster.engine.models.tiered_linear import prepare_linears
from pdcluster.engine.parallel import (
    Comm,
    LogitsRows,
    RankLost,
    gather_kv_heads,
    local_num_kv_heads,
    make_store,
    own_kv_heads,
    shard_model,
)
from pdcluster.engine.precision import Precision

STOP_TIMEOUT_S = 30.0  # a worker told to stop has exited within this


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker of one rank needs to build its shard."""

    model: str  # checkpoint folder
    device: str  # resolved: "cpu", "cuda:0", ...
    dtype: str  # activations and KV cache: "float32", "bfloat16", "float16"
    linear_dtype: str  # the linear layers' weights (one: quantization runs at TP 1 only)
    port: int  # rank 0's rendezvous store on 127.0.0.1
    rank: int
    world_size: int
    num_threads: int  # torch intra-op threads of this rank (rank 0's count)


@dataclass(frozen=True)
class StepInputs:
    """Rank 0 to the others, once per step: the tokens to run and where their KV goes."""

    input_ids: list[int]
    num_computed_tokens: list[int]
    num_scheduled_tokens: list[int]
    block_tables: list[list[int]]


@dataclass(frozen=True)
class ReadKV:
    """Rank 0 to the others: gather your heads of blocks [start, start + count)."""

    start: int
    count: int


@dataclass(frozen=True)
class WriteKV:
    """Rank 0 to the others: store your heads of these full-head blocks from `start` on."""

    start: int
    blocks: torch.Tensor  # [count, layers, 2, block_size, num_kv_heads, head_dim]


@dataclass(frozen=True)
class Stop:
    """Rank 0 to the others: the instance shuts down."""


class WorkerHandles(Protocol):
    def stats(self) -> dict[str, list]:
        """`tp_worker_pids` (rank 1 first), and whatever else names the workers."""

    def stop(self) -> None:
        """Wait for the told-to-stop workers to exit (kill them after STOP_TIMEOUT_S)."""


WorkerLauncher = Callable[[list[WorkerSpec]], WorkerHandles]


def local_info(info: ModelInfo, comm: Comm) -> ModelInfo:
    """`info` as one rank sees it: only its KV heads."""
    return replace(info, num_kv_heads=local_num_kv_heads(info.num_kv_heads, comm))


def run_worker(spec: WorkerSpec) -> None:
    """Load, shard, then serve rank 0's steps until it stops (or its connection breaks)."""
    torch.set_num_threads(spec.num_threads)
    device, dtype = torch.device(spec.device), getattr(torch, spec.dtype)
    model, info = load_model(spec.model, device, dtype)
    comm = Comm("127.0.0.1", spec.port, spec.rank, spec.world_size, device)
    shard_model(model, comm)
    if device.type == "cpu":  # as rank 0's runner does
        prepare_linears(model, "none", (getattr(torch, spec.linear_dtype),))
    cache = comm.broadcast_object()  # rank 0 sized the cache
    assert isinstance(cache, CacheConfig)
    kv_cache = allocate_kv_cache(
        cache.num_blocks, cache.block_size, local_info(info, comm), dtype, device
    )
    _serve(model, kv_cache, comm, cache.block_size, info.num_kv_heads)


@torch.inference_mode()
def _serve(
    model: torch.nn.Module, kv_cache: torch.Tensor, comm: Comm, block_size: int, num_kv_heads: int
) -> None:
    while True:
        msg = comm.broadcast_object()
        if isinstance(msg, StepInputs):
            meta = AttentionMetadata.build(
                msg.num_computed_tokens,
                msg.num_scheduled_tokens,
                msg.block_tables,
                block_size,
                comm.device,
            )
            ids = torch.tensor(msg.input_ids, dtype=torch.long, device=comm.device)  # [T]
            model.forward(model.embed_tokens(ids), meta.positions, kv_cache, meta)
        elif isinstance(msg, LogitsRows):
            model.lm_head.collect(msg.hidden.to(comm.device))
        elif isinstance(msg, ReadKV):
            gather_kv_heads(kv_cache[msg.start : msg.start + msg.count], num_kv_heads, comm)
        elif isinstance(msg, WriteKV):
            write_own_heads(kv_cache, msg.start, msg.blocks, num_kv_heads, comm)
        else:
            assert isinstance(msg, Stop), f"unexpected message {type(msg).__name__}"
            return


def write_own_heads(
    kv_cache: torch.Tensor, start: int, blocks: torch.Tensor, num_kv_heads: int, comm: Comm
) -> None:
    own = own_kv_heads(blocks, num_kv_heads, comm).view(kv_cache.dtype)  # bf16 may come as int16
    kv_cache[start : start + blocks.shape[0]].copy_(own)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class TensorParallelGroup:
    """Rank 0's end of an instance's group: starts the workers, joins them, and tells them
    each step's inputs."""

    def __init__(
        self,
        model: str,
        device: torch.device,
        precision: Precision,
        world_size: int,
        launcher: WorkerLauncher,
    ) -> None:
        self.store = make_store(world_size)  # held while the group lives
        num_threads = torch.get_num_threads()  # each rank as many as rank 0
        specs = [
            WorkerSpec(
                model,
                str(device),
                _name(precision.dtype),
                _name(precision.linear_dtypes[0]),
                self.store.port,
                rank,
                world_size,
                num_threads,
            )  # fmt: skip
            for rank in range(1, world_size)
        ]
        self.workers = launcher(specs)
        self.comm = Comm("127.0.0.1", self.store.port, 0, world_size, device)

    def start_cache(self, cache: CacheConfig) -> None:
        self.comm.broadcast_object(cache)

    # ---- KV blocks with every rank's heads: what a KV connector moves -----------------
    def attach_kv_cache(self, kv_cache: torch.Tensor, num_kv_heads: int) -> None:
        """Rank 0's own cache, and the model's KV heads on all ranks together."""
        self.kv_cache, self.num_kv_heads = kv_cache, num_kv_heads

    @property
    def block_shape(self) -> tuple[int, ...]:
        """[layers, 2, block_size, num_kv_heads, head_dim] of one full-head block."""
        layers, two, block_size, _, head_dim = self.kv_cache.shape[1:]
        return (layers, two, block_size, self.num_kv_heads, head_dim)

    def read_blocks(self, start: int, count: int) -> torch.Tensor:
        """Blocks [start, start + count) with every rank's heads: [count, *block_shape]."""
        self.comm.broadcast_object(ReadKV(start, count))
        blocks = self.kv_cache[start : start + count]
        return gather_kv_heads(blocks, self.num_kv_heads, self.comm)

    def write_blocks(self, start: int, blocks: torch.Tensor) -> None:
        """Store full-head `blocks` [count, *block_shape] from block `start` on, each rank
        its heads."""
        blocks = blocks.contiguous()
        self.comm.broadcast_object(WriteKV(start, blocks))
        write_own_heads(self.kv_cache, start, blocks, self.num_kv_heads, self.comm)

    def start_step(self, inputs: StepInputs) -> None:
        self.comm.broadcast_object(inputs)

    def stats(self) -> dict[str, int | list]:
        return {"tensor_parallel_size": self.comm.world_size, **self.workers.stats()}

    def shutdown(self) -> None:
        """Stop every worker: told to, or (a rank lost, so no collective can reach them)
        killed once the wait is over."""
        with contextlib.suppress(RankLost):
            self.comm.broadcast_object(Stop())
        self.workers.stop()


@dataclass
class LocalProcesses:
    processes: list[multiprocessing.process.BaseProcess]

    def stats(self) -> dict[str, list]:
        return {"tp_worker_pids": [p.pid for p in self.processes]}

    def stop(self) -> None:
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                process.kill()


def start_processes(specs: list[WorkerSpec]) -> LocalProcesses:
    """One spawned local process per worker (the engine's default launcher, no Ray)."""
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=run_worker, args=(s,), daemon=True) for s in specs]
    for process in processes:
        process.start()
    return LocalProcesses(processes)
