"""Paged KV cache and exact batched attention over it.

The cache of one instance is ONE tensor
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` (2 = K, V), so one block of
one request is contiguous across all layers and moves as a single slice.

A step's tokens are the concatenation, sequence by sequence, of each sequence's new tokens.
`AttentionMetadata.build` turns the step's bookkeeping into tensors once; every layer then runs
one vectorized `paged_attention` for the whole batch (prefill chunks and decodes mixed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engine.models.loader import ModelInfo


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
class AttentionMetadata:
    """Everything a layer needs for one step, built once per step.

    B = number of sequences, T = total new tokens, max_q = most new tokens of one sequence,
    max_blocks = most blocks any sequence reads this step.
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
    padded_token_index: torch.Tensor  # [T] long: index of each new token in [B * max_q]
    max_query_len: int
    attn_mask: torch.Tensor  # [B, 1, max_q, max_blocks * block_size] bool, True = attend

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
        max_q = max(num_scheduled_tokens)

        query_start_loc = torch.zeros(num_seqs + 1, dtype=torch.long, device=device)
        query_start_loc[1:] = torch.cumsum(query_lens, dim=0)
        seq_ids = torch.repeat_interleave(torch.arange(num_seqs, device=device), query_lens)  # [T]
        token_idx = torch.arange(num_tokens, device=device)  # [T]
        idx_in_seq = token_idx - query_start_loc[seq_ids]  # [T]
        positions = computed[seq_ids] + idx_in_seq  # [T]

        q_pos = computed[:, None] + torch.arange(max_q, device=device)[None, :]  # [B, max_q]
        k_pos = torch.arange(max_blocks * block_size, device=device)  # [max_ctx]
        mask = k_pos[None, None, :] <= q_pos[:, :, None]  # [B, max_q, max_ctx]
        # Padded query rows attend to key 0 only: never an all-False row (NaN), output dropped.
        is_pad_row = torch.arange(max_q, device=device)[None, :] >= query_lens[:, None]
        mask = torch.where(is_pad_row[:, :, None], k_pos[None, None, :] == 0, mask)

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
            padded_token_index=seq_ids * max_q + idx_in_seq,
            max_query_len=max_q,
            attn_mask=mask[:, None],  # [B, 1, max_q, max_ctx]
        )


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


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_idx: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's tokens 0..pos.

    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]. Returns [T, num_heads,
    head_dim]. K/V of the new tokens are written to the cache first, then read back with the
    context through the block tables, so prefix hits, chunks and decodes share one path.
    """
    write_kv(k, v, kv_cache, layer_idx, meta)
    num_seqs, max_q = meta.num_seqs, meta.max_query_len
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]

    # One gather of this layer's blocks along dim 0 (much cheaper than advanced indexing of
    # the strided 6-D view), then a single permute copy into [2, B, kvh, ctx, hd].
    flat_tables = meta.block_tables.view(-1)  # [B * max_blocks]
    layer_kv = kv_cache.select(1, layer_idx).index_select(0, flat_tables)
    layer_kv = layer_kv.view(num_seqs, -1, *layer_kv.shape[1:])  # [B, max_blocks, 2, bs, kvh, hd]
    layer_kv = layer_kv.to(q.dtype).permute(2, 0, 4, 1, 3, 5)  # [2, B, kvh, max_blocks, bs, hd]
    layer_kv = layer_kv.reshape(2, num_seqs, num_kv_heads, -1, head_dim)  # [2, B, kvh, ctx, hd]

    decode_only = max_q == 1  # every sequence has exactly one new token: no padding needed
    if decode_only:
        q_padded = q.reshape(num_seqs, 1, num_heads, head_dim).transpose(1, 2)  # [B, H, 1, hd]
    else:
        q_padded = q.new_zeros(num_seqs * max_q, num_heads, head_dim)  # [B * max_q, H, hd]
        q_padded[meta.padded_token_index] = q
        q_padded = q_padded.view(num_seqs, max_q, num_heads, head_dim).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        q_padded,  # [B, H, max_q, hd]
        layer_kv[0],
        layer_kv[1],
        attn_mask=meta.attn_mask,  # [B, 1, max_q, ctx]
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [B, H, max_q, hd]
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    return out if decode_only else out[meta.padded_token_index]  # [T, H, hd]
