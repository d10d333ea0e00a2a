"""Tensor parallelism inside one instance: the ranks' process group and the sharding of a
loaded decoder across them.

Rank r of N holds: a contiguous range of KV heads (and the query heads that read them) in
q/k/v (column-parallel) and o_proj (row-parallel), a range of the intermediate features of
every gate/up (column) and down (row) projection, dense or per expert (the router stays
whole, so every rank routes alike), and a range of the vocabulary in the embedding and the
LM head. Each attention and MLP block's output is summed over the ranks (one all-reduce
each); the embedding is all-reduced too; logits are gathered on rank 0, which samples.
Ranges are as even as possible: with 3 KV heads on 2 ranks, rank 0 holds 2 and rank 1 one.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pdcluster.engine.models.llama import DecoderAttention, LlamaForCausalLM
from pdcluster.engine.models.mlp import GatedMLP

CONNECT_TIMEOUT = timedelta(seconds=300)  # every rank has joined the group within this
# A worker waits for the next step for as long as its instance is idle.
COLLECTIVE_TIMEOUT = timedelta(days=365)


def split_range(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """[start, end) of `rank`'s share of `size` items, the first `size % world_size` ranks
    holding one more."""
    base, extra = divmod(size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def check_tp_size(model: nn.Module, world_size: int) -> None:
    """ValueError naming the numbers when `model` cannot be split over `world_size` ranks."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    if world_size == 1:
        return
    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(
            f"tensor_parallel_size {world_size}: only decoder-only text models can be "
            f"sharded, not {type(model).__name__}"
        )
    cfg = model.config
    sizes = {"num_key_value_heads": cfg.num_kv_heads, "intermediate_size": cfg.intermediate_size}
    if cfg.moe is not None:
        sizes["moe_intermediate_size"] = cfg.moe.intermediate_size
    for name, size in sizes.items():
        if size < world_size:
            raise ValueError(
                f"tensor_parallel_size {world_size} exceeds this model's {name} {size}: "
                "every rank needs at least one"
            )


class RankLost(RuntimeError):
    """A collective failed: another rank of this instance is gone."""


class Comm:
    """One rank's view of its instance's process group (gloo on CPU, NCCL on CUDA). Built
    straight on a TCP store, so that several instances may live in one process."""

    def __init__(
        self, host: str, port: int, rank: int, world_size: int, device: torch.device
    ) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.store = dist.TCPStore(host, port, world_size, is_master=False, timeout=CONNECT_TIMEOUT)
        backend = dist.ProcessGroupNCCL if device.type == "cuda" else dist.ProcessGroupGloo
        self.group = backend(self.store, rank, world_size, COLLECTIVE_TIMEOUT)

    def _wait(self, work: dist.Work) -> None:
        try:
            work.wait()
        except RuntimeError as exc:
            raise RankLost(f"tensor-parallel rank lost ({self.world_size} ranks): {exc}") from exc

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place."""
        self._wait(self.group.allreduce([tensor]))
        return tensor

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (pickled: a length, then the bytes)."""
        payload = pickle.dumps(obj) if self.rank == 0 else b""
        length = torch.tensor([len(payload)], dtype=torch.long, device=self.device)
        self._wait(self.group.broadcast([length], dist.BroadcastOptions()))
        data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        self._wait(self.group.broadcast([data], dist.BroadcastOptions()))
        return obj if self.rank == 0 else pickle.loads(data.cpu().numpy().tobytes())

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (all of one shape), in rank order, on rank 0; None elsewhere."""
        tensor = tensor.contiguous()
        outputs = [[torch.empty_like(tensor) for _ in range(self.world_size)]]
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self._wait(self.group.gather(outputs if self.rank == 0 else [], [tensor], opts))
        return outputs[0] if self.rank == 0 else None


def make_store(world_size: int) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (`.port`), to be held while the
    group lives."""
    return dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, timeout=CONNECT_TIMEOUT, wait_for_workers=False
    )


@dataclass(frozen=True)
class LogitsRows:
    """Rank 0 to the others: compute your vocabulary shard's logits of these rows."""

    hidden: torch.Tensor  # [N, hidden] on CPU


# ---- sharded modules -----------------------------------------------------------------
def _sliced_linear(linear: nn.Module, rows: slice, cols: slice, keep_bias: bool) -> nn.Linear:
    """A new nn.Linear holding `linear.weight[rows, cols]` (and its bias over `rows` when
    `keep_bias`). Works on any module with a dense `.weight` [out, in] and `.bias`."""
    weight = linear.weight.detach()[rows, cols].contiguous()  # [out', in']
    bias = linear.bias
    out = nn.Linear(*weight.shape[::-1], bias=bias is not None and keep_bias, device="meta")
    out.weight = nn.Parameter(weight, requires_grad=False)
    if out.bias is not None:
        out.bias = nn.Parameter(bias.detach()[rows].contiguous(), requires_grad=False)
    return out


def _column(linear: nn.Module, start: int, end: int) -> nn.Linear:
    return _sliced_linear(linear, slice(start, end), slice(None), keep_bias=True)


def _row(linear: nn.Module, start: int, end: int, rank: int) -> nn.Linear:
    """Input features [start, end); the bias is added once, on rank 0."""
    return _sliced_linear(linear, slice(None), slice(start, end), keep_bias=rank == 0)


def _vocab_rows(weight: torch.Tensor, start: int, end: int, comm: Comm) -> torch.Tensor:
    """Rows [start, end) of a [vocab, hidden] weight, zero-padded to the shard size that
    every rank shares (so that logits gather in equal parts)."""
    shard = weight.new_zeros(-(-weight.shape[0] // comm.world_size), weight.shape[1])
    shard[: end - start] = weight[start:end]
    return shard  # [shard_size, hidden]


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the embedding, zero-padded to `shard_size`; a token outside them
    embeds as zeros here and the all-reduce brings its row from its owner."""

    def __init__(self, weight: torch.Tensor, start: int, end: int, comm: Comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(_vocab_rows(weight, start, end, comm), requires_grad=False)
        self.start, self.end, self.comm = start, end, comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        owned = (input_ids >= self.start) & (input_ids < self.end)  # [T]
        local = torch.where(owned, input_ids - self.start, 0)
        embeds = F.embedding(local, self.weight) * owned[:, None].to(self.weight.dtype)
        return self.comm.all_reduce(embeds)  # [T, hidden]


class VocabParallelHead(nn.Module):
    """The LM head's rows of this rank's vocabulary shard. Called on rank 0, it has every
    rank compute its shard (`LogitsRows`) and returns the gathered [N, vocab] logits."""

    def __init__(self, weight: nn.Parameter, vocab_size: int, comm: Comm) -> None:
        super().__init__()
        self.linear = nn.Linear(*weight.shape[::-1], bias=False, device="meta")
        self.linear.weight = weight  # shared with the embedding when tied
        self.vocab_size, self.comm = vocab_size, comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.comm.broadcast_object(LogitsRows(hidden.cpu()))
        return self.collect(hidden)

    def collect(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """This rank's shard of the logits of `hidden` [N, hidden], gathered: [N, vocab] on
        rank 0, None elsewhere."""
        shards = self.comm.gather(self.linear(hidden))  # world x [N, shard]
        return None if shards is None else torch.cat(shards, dim=-1)[:, : self.vocab_size]


def _all_reduce_output(module: nn.Module, comm: Comm) -> None:
    module.register_forward_hook(lambda _m, _args, out: comm.all_reduce(out))


def _shard_attention(attn: DecoderAttention, comm: Comm) -> None:
    group = attn.num_heads // attn.num_kv_heads  # query heads per KV head
    kv_start, kv_end = split_range(attn.num_kv_heads, comm.world_size, comm.rank)
    hd = attn.head_dim
    q0, q1 = kv_start * group * hd, kv_end * group * hd
    attn.q_proj = _column(attn.q_proj, q0, q1)
    attn.k_proj = _column(attn.k_proj, kv_start * hd, kv_end * hd)
    attn.v_proj = _column(attn.v_proj, kv_start * hd, kv_end * hd)
    attn.o_proj = _row(attn.o_proj, q0, q1, comm.rank)
    attn.num_kv_heads = kv_end - kv_start
    attn.num_heads = attn.num_kv_heads * group
    _all_reduce_output(attn, comm)


def _shard_gated_mlp(mlp: GatedMLP, rank: int, world_size: int) -> None:
    start, end = split_range(mlp.gate_proj.weight.shape[0], world_size, rank)
    mlp.gate_proj = _column(mlp.gate_proj, start, end)
    mlp.up_proj = _column(mlp.up_proj, start, end)
    mlp.down_proj = _row(mlp.down_proj, start, end, rank)


def local_num_kv_heads(num_kv_heads: int, comm: Comm) -> int:
    start, end = split_range(num_kv_heads, comm.world_size, comm.rank)
    return end - start


# ---- KV blocks across ranks ----------------------------------------------------------
# A KV cache is [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]; rank r holds
# the KV heads split_range(num_kv_heads, world_size, r) of every block.
def gather_kv_heads(blocks: torch.Tensor, num_kv_heads: int, comm: Comm) -> torch.Tensor | None:
    """This rank's heads of some blocks, joined with every other rank's on rank 0: [count,
    layers, 2, block_size, num_kv_heads, head_dim] there, None elsewhere."""
    first, last = split_range(num_kv_heads, comm.world_size, 0)
    most = last - first  # rank 0 holds the most heads
    padded = F.pad(blocks, (0, 0, 0, most - blocks.shape[4]))  # equal shapes to gather
    parts = comm.gather(padded)
    if parts is None:
        return None
    ranges = [split_range(num_kv_heads, comm.world_size, r) for r in range(comm.world_size)]
    sizes = [b - a for a, b in ranges]
    return torch.cat([p[..., :n, :] for p, n in zip(parts, sizes, strict=True)], dim=4)


def own_kv_heads(blocks: torch.Tensor, num_kv_heads: int, comm: Comm) -> torch.Tensor:
    """This rank's heads of full-head `blocks` [..., num_kv_heads, head_dim]."""
    start, end = split_range(num_kv_heads, comm.world_size, comm.rank)
    return blocks[..., start:end, :]


def shard_model(model: LlamaForCausalLM, comm: Comm) -> None:
    """Keep only this rank's shard of every layer of `model`, in place (before packing)."""
    check_tp_size(model, comm.world_size)
    for layer in model.model.layers:
        _shard_attention(layer.self_attn, comm)
        for mlp in layer.mlp.modules():  # the dense MLP, or every expert of a mixture
            if isinstance(mlp, GatedMLP):
                _shard_gated_mlp(mlp, comm.rank, comm.world_size)
        _all_reduce_output(layer.mlp, comm)
    vocab_size = model.model.embed_tokens.weight.shape[0]
    shard_size = -(-vocab_size // comm.world_size)
    start, end = comm.rank * shard_size, min((comm.rank + 1) * shard_size, vocab_size)
    embed = VocabParallelEmbedding(model.model.embed_tokens.weight.detach(), start, end, comm)
    head_weight = embed.weight
    if not model.config.tie_word_embeddings:
        rows = _vocab_rows(model.lm_head.weight.detach(), start, end, comm)
        head_weight = nn.Parameter(rows, requires_grad=False)
    model.model.embed_tokens = embed
    model.lm_head = VocabParallelHead(head_weight, vocab_size, comm)
