"""Paged KV cache and exact batched attention over it.

The cache of one instance is ONE tensor
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` (2 = K, V), so one block of
one request is contiguous across all layers and moves as a single slice.

A step's tokens are the concatenation, sequence by sequence, of each sequence's new tokens.
`AttentionMetadata.build` turns the step's bookkeeping into tensors once; every layer then runs
`paged_attention`: all decodes (one new token each) as one batch over their contexts, and each
prefill chunk alone with its own causal mask, so no query row is padded to another sequence's
length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pdcluster.engine.kernels import cpu_kernels

if TYPE_CHECKING:
    from pdcluster.engine.models.loader import ModelInfo


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    info: ModelInfo,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Zero-filled so that unwritten (masked) slots never hold NaN, which would leak through
    a zero attention weight (0 * NaN = NaN)."""
    shape = (num_blocks, info.num_layers, 2, block_size, info.num_kv_heads, info.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass
class DecodeBatch:
    """The step's sequences with exactly one new token, attended to as one batch.

    D = number of such sequences, max_blocks = most blocks one of them reads.
    """

    token_indices: torch.Tensor | None  # [D] long: row in T of each; None = all T rows in order
    block_tables: torch.Tensor  # [D, max_blocks] long, padded with block 0 (masked out)
    key_mask: torch.Tensor  # [D, 1, 1, max_blocks * block_size] bool, True = attend
    seq_lens: torch.Tensor  # [D] long: keys each one reads (its query sits at seq_len - 1)

    @classmethod
    def build(
        cls,
        token_indices: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        num_tokens: int,
        device: torch.device | str,
    ) -> DecodeBatch:
        max_blocks = max(-(-n // block_size) for n in seq_lens)
        padded = [t[:max_blocks] + [0] * (max_blocks - len(t)) for t in block_tables]
        lens = torch.tensor(seq_lens, dtype=torch.long, device=device)  # [D]
        k_pos = torch.arange(max_blocks * block_size, device=device)  # [ctx]
        every_row = len(token_indices) == num_tokens  # rows are ascending: all of T in order
        return cls(
            token_indices=None
            if every_row
            else torch.tensor(token_indices, dtype=torch.long, device=device),
            block_tables=torch.tensor(padded, dtype=torch.long, device=device),
            key_mask=(k_pos[None, :] < lens[:, None])[:, None, None],  # [D, 1, 1, ctx]
            seq_lens=lens,
        )

    def window_mask(self, sliding_window: int) -> torch.Tensor:
        """`key_mask` narrowed to the last `sliding_window` keys of each sequence."""
        k_pos = torch.arange(self.key_mask.shape[-1], device=self.key_mask.device)  # [ctx]
        recent = k_pos[None, :] >= (self.seq_lens - sliding_window)[:, None]  # [D, ctx]
        return self.key_mask & recent[:, None, None]  # [D, 1, 1, ctx]


@dataclass
class PrefillSegment:
    """One sequence with several new tokens: its rows of T attend causally to its context."""

    token_start: int  # first row in T of its new tokens
    token_end: int  # one past its last row in T
    num_computed: int  # tokens already in the cache before this step
    seq_len: int  # tokens in the sequence after this step = keys it reads
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] long
    attn_mask: torch.Tensor | None  # [q_len, seq_len] bool, True = attend; None: no cached
    # context, so q_len == seq_len and plain causal attention applies

    @classmethod
    def build(
        cls,
        token_start: int,
        num_computed: int,
        num_new: int,
        block_table: list[int],
        block_size: int,
        device: torch.device | str,
    ) -> PrefillSegment:
        seq_len = num_computed + num_new
        mask = None
        if num_computed:
            q_pos = num_computed + torch.arange(num_new, device=device)  # [q_len]
            mask = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
        block_ids = block_table[: -(-seq_len // block_size)]
        return cls(
            token_start=token_start,
            token_end=token_start + num_new,
            num_computed=num_computed,
            seq_len=seq_len,
            block_ids=torch.tensor(block_ids, dtype=torch.long, device=device),
            attn_mask=mask,
        )

    def causal_mask(self, sliding_window: int | None = None) -> torch.Tensor:
        """[q_len, seq_len] bool: each new token sees keys 0..its position, or only the last
        `sliding_window` of them (itself included), as transformers' sliding-window mask."""
        device = self.block_ids.device
        q_pos = self.num_computed + torch.arange(self.token_end - self.token_start, device=device)
        k_pos = torch.arange(self.seq_len, device=device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len]
        if sliding_window is not None:
            mask &= k_pos[None, :] > q_pos[:, None] - sliding_window
        return mask


@dataclass
class AttentionMetadata:
    """Everything a layer needs for one step, built once per step.

    B = number of sequences, T = total new tokens, max_blocks = most blocks any sequence reads
    this step. Sequences with one new token form one `DecodeBatch`, and so do the tokens of a
    short chunk over a cached context (`SHORT_CHUNK`: a verified draft, a short follow-up),
    one row each that reads the keys up to its own (every K/V of the step is written before
    any query attends); each other sequence is a `PrefillSegment` of its own, so no query is
    padded to another sequence's length.
    """

    num_seqs: int
    num_tokens: int
    block_size: int
    positions: torch.Tensor  # [T] long: position of each new token in its sequence
    logits_indices: torch.Tensor  # [B] long: index into T of each sequence's last new token
    query_start_loc: torch.Tensor  # [B + 1] long: start of each sequence's new tokens in T
    seq_lens: torch.Tensor  # [B] long: tokens in each sequence after this step
    query_lens: torch.Tensor  # [B] long: new tokens of each sequence
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with block 0 (masked out)
    slot_block_ids: torch.Tensor  # [T] long: block that receives each new token's K/V
    slot_offsets: torch.Tensor  # [T] long: offset of that token inside its block
    max_query_len: int
    decodes: DecodeBatch | None  # the sequences with one new token, if any
    prefills: list[PrefillSegment]  # the sequences with several new tokens, in T order

    @classmethod
    def build(
        cls,
        num_computed_tokens: list[int],
        num_scheduled_tokens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
    ) -> AttentionMetadata:
        num_seqs = len(num_scheduled_tokens)
        if not num_seqs or len(num_computed_tokens) != num_seqs or len(block_tables) != num_seqs:
            raise ValueError("need one computed count, scheduled count and block table per seq")
        if min(num_scheduled_tokens) < 1:
            raise ValueError("every scheduled sequence needs at least one new token")
        seq_lens_list = [
            c + s for c, s in zip(num_computed_tokens, num_scheduled_tokens, strict=True)
        ]
        max_blocks = max(-(-n // block_size) for n in seq_lens_list)
        for seq_len, table in zip(seq_lens_list, block_tables, strict=True):
            if len(table) * block_size < seq_len:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {seq_len} tokens")
        padded_tables = [t[:max_blocks] + [0] * (max_blocks - len(t)) for t in block_tables]

        computed = torch.tensor(num_computed_tokens, dtype=torch.long, device=device)  # [B]
        query_lens = torch.tensor(num_scheduled_tokens, dtype=torch.long, device=device)  # [B]
        tables = torch.tensor(padded_tables, dtype=torch.long, device=device)  # [B, max_blocks]
        num_tokens = sum(num_scheduled_tokens)

        query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.long, device=device)
        query_start_loc[1:] = torch.cumsum(query_lens, dim=0)
        seq_ids = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)  # [T]
        token_idx = torch.arange(num_tokens, device=device)  # [T]
        positions = computed[seq_ids] + token_idx - query_start_loc[seq_ids]  # [T]
        decodes, prefills = _split_decodes_and_prefills(
            num_computed_tokens, num_scheduled_tokens, block_tables, block_size, device
        )
        return cls(
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            block_size=block_size,
            positions=positions,
            logits_indices=query_start_loc[1:] - 1,
            query_start_loc=query_start_loc,
            seq_lens=computed + query_lens,
            query_lens=query_lens,
            block_tables=tables,
            slot_block_ids=tables[seq_ids, positions // block_size],
            slot_offsets=positions % block_size,
            max_query_len=max(num_scheduled_tokens),
            decodes=decodes,
            prefills=prefills,
        )


SHORT_CHUNK = 16  # new tokens of a chunk over a cached context attended as one-token rows


def _split_decodes_and_prefills(
    num_computed_tokens: list[int],
    num_scheduled_tokens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str,
) -> tuple[DecodeBatch | None, list[PrefillSegment]]:
    """One `DecodeBatch` of the one-new-token sequences and the tokens of short chunks over a
    cached context, one `PrefillSegment` per other sequence."""
    decode_rows, decode_lens, decode_tables = [], [], []
    prefills: list[PrefillSegment] = []
    token_start = 0
    for computed, new, table in zip(
        num_computed_tokens, num_scheduled_tokens, block_tables, strict=True
    ):
        if new == 1 or (computed and new <= SHORT_CHUNK):
            decode_rows += range(token_start, token_start + new)
            decode_lens += range(computed + 1, computed + new + 1)
            decode_tables += [table] * new
        else:
            prefills.append(
                PrefillSegment.build(token_start, computed, new, table, block_size, device)
            )
        token_start += new
    decodes = None
    if decode_rows:
        decodes = DecodeBatch.build(
            decode_rows, decode_lens, decode_tables, block_size, token_start, device
        )
    return decodes, prefills


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x [T, heads, hd]; cos, sin [T, 1, hd]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _kernels_for(q: torch.Tensor, kv_cache: torch.Tensor):
    """The compiled CPU kernels where they compute what the torch ops here would (float32 on
    CPU, a contiguous cache), else None."""
    if q.device.type == "cpu" and q.dtype == kv_cache.dtype == torch.float32:
        return cpu_kernels() if kv_cache.is_contiguous() else None
    return None


def store_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_idx: int,
    meta: AttentionMetadata,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """Write the new tokens' K/V to their slots, after RoPE (`rope`: cos, sin [T, 1, hd]) on
    q and k where given; returns q, rotated. One pass in the CPU kernel where it applies."""
    kernels = _kernels_for(q, kv_cache) if rope is not None else None
    if kernels is not None:
        return kernels.rope_and_cache_kv(
            q, k, v, *rope, kv_cache, layer_idx, meta.slot_block_ids, meta.slot_offsets
        )
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    write_kv(k, v, kv_cache, layer_idx, meta)
    return q


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_idx: int,
    meta: AttentionMetadata,
) -> None:
    """Store the new tokens' K/V ([T, kv_heads, head_dim]) in their slots of this layer."""
    kv = torch.stack((k, v), dim=1).to(kv_cache.dtype)  # [T, 2, kv_heads, head_dim]
    kv_cache[meta.slot_block_ids, layer_idx, :, meta.slot_offsets] = kv


def gather_kv(
    kv_cache: torch.Tensor, layer_idx: int, block_tables: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """K/V of this layer for each row of `block_tables` ([N, max_blocks]), keys in order.

    Returns [2, N, kv_heads, max_blocks * block_size, head_dim] (a strided view: N and
    kv_heads are swapped in memory). The only copy is one gather of whole blocks from a
    heads-outermost view of the layer, which already leaves each head's keys contiguous.
    """
    num_rows, max_blocks = block_tables.shape
    by_head = kv_cache.select(1, layer_idx).permute(1, 3, 0, 2, 4)  # [2, kvh, blocks, bs, hd]
    picked = by_head.index_select(2, block_tables.view(-1))  # [2, kvh, N * max_blocks, bs, hd]
    num_kv_heads, block_size, head_dim = picked.shape[1], picked.shape[3], picked.shape[4]
    ctx = picked.view(2, num_kv_heads, num_rows, max_blocks * block_size, head_dim)
    return ctx.transpose(1, 2).to(dtype)  # [2, N, kvh, ctx, hd]


@dataclass(frozen=True)
class AttentionOptions:
    """How one layer's scores are formed: `scale` (usually head_dim ** -0.5), an optional
    `sliding_window` (a query sees only the last that many keys, itself included) and an
    optional `softcap` (scores become softcap * tanh(scores / softcap) before the mask)."""

    scale: float
    sliding_window: int | None = None
    softcap: float | None = None


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    opts: AttentionOptions,
) -> torch.Tensor:
    """q [N, H, q_len, hd], k/v [N, kvh, k_len, hd], mask broadcastable to [N, H, q_len, k_len]
    (True = attend; None = causal). SDPA unless the scores are soft-capped, which SDPA cannot
    do; then the same computation in plain ops, softmax in float32 as transformers does."""
    if opts.softcap is None:
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=opts.scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    group = q.shape[1] // k.shape[1]  # query head h reads KV head h // group
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * opts.scale  # [N, H, q_len, k_len]
    scores = torch.tanh(scores / opts.softcap) * opts.softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)  # [N, H, q_len, hd]


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_idx: int,
    decodes: DecodeBatch,
    opts: AttentionOptions,
) -> torch.Tensor:
    """q: [D, H, hd], one query per sequence, over its whole context. Returns [D, H, hd].
    On CPU with a float32 cache, the compiled kernel reads the KV in place (engine/kernels);
    elsewhere, or where it could not be built, the context is gathered for SDPA."""
    kernels = _kernels_for(q, kv_cache) if opts.softcap is None else None
    if kernels is not None:
        window = opts.sliding_window or 0
        return kernels.paged_decode_attention(
            q.contiguous(), kv_cache, layer_idx, decodes.block_tables, decodes.seq_lens,
            opts.scale, window,
        )  # fmt: skip
    layer_kv = gather_kv(kv_cache, layer_idx, decodes.block_tables, q.dtype)  # [2, D, kvh, ctx, hd]
    mask = decodes.key_mask  # [D, 1, 1, ctx]
    if opts.sliding_window is not None:
        mask = decodes.window_mask(opts.sliding_window)
    out = attend(q[:, :, None], layer_kv[0], layer_kv[1], mask, opts)  # [D, H, 1, hd]
    return out[:, :, 0]  # [D, H, hd]


def prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_idx: int,
    seg: PrefillSegment,
    opts: AttentionOptions,
) -> torch.Tensor:
    """q: [q_len, H, hd], the segment's new tokens, causal over its context. Returns the same."""
    layer_kv = gather_kv(kv_cache, layer_idx, seg.block_ids[None], q.dtype)  # [2, 1, kvh, ctx, hd]
    layer_kv = layer_kv[:, :, :, : seg.seq_len]  # [2, 1, kvh, seq_len, hd]
    mask = seg.attn_mask  # [q_len, seq_len] or None (plain causal)
    if opts.sliding_window is not None and seg.seq_len > opts.sliding_window:
        mask = seg.causal_mask(opts.sliding_window)
    out = attend(q.transpose(0, 1)[None], layer_kv[0], layer_kv[1], mask, opts)  # [1, H, q, hd]
    return out[0].transpose(0, 1)  # [q_len, H, hd]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_idx: int,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's tokens 0..pos (or its window).

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]. Returns [T, num_heads,
    head_dim]. K/V of the new tokens are written to the cache first, then read back with the
    context through the block tables, so prefix hits, chunks and decodes share one path.
    Decodes run as one batch; each prefill chunk runs alone over its own context.
    `sliding_window` and `softcap` are as in `AttentionOptions`; `rope` (cos, sin, each
    [T, 1, head_dim]) rotates q and k first (`store_kv`).
    """
    opts = AttentionOptions(scale, sliding_window, softcap)
    q = store_kv(q, k, v, kv_cache, layer_idx, meta, rope)
    decodes = meta.decodes
    if decodes is not None and decodes.token_indices is None:  # decode-only step
        return decode_attention(q, kv_cache, layer_idx, decodes, opts)  # [T, H, hd]
    out = torch.empty_like(q)  # [T, H, hd]
    if decodes is not None:
        rows = decodes.token_indices  # [D]
        out[rows] = decode_attention(q[rows], kv_cache, layer_idx, decodes, opts)
    for seg in meta.prefills:
        rows = slice(seg.token_start, seg.token_end)
        out[rows] = prefill_attention(q[rows], kv_cache, layer_idx, seg, opts)
    return out  # [T, H, hd]
