"""paged_attention against a plain per-sequence SDPA on dense K/V, and the compiled CPU kernels
against the torch paths they replace (no Ray, no model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pdcluster.engine import attention
from pdcluster.engine.attention import (
    AttentionMetadata,
    AttentionOptions,
    DecodeBatch,
    apply_rope,
    paged_attention,
    write_kv,
)
from pdcluster.engine.kernels import cpu_kernels

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_BLOCKS = 4, 6, 2, 8, 64

# (num_computed_tokens, num_new_tokens) per sequence.
MIXED = [(0, 7), (5, 1), (13, 19), (20, 1), (0, 1), (3, 2), (9, 1), (0, 16)]
BATCHES = {
    "mixed": MIXED,
    "decode_only": [(c, 1) for c in (0, 4, 11, 30)],
    "prefill_only": [(0, 5), (6, 10)],
}


def make_tables(seqs: list[tuple[int, int]], gen: torch.Generator) -> list[list[int]]:
    """Disjoint shuffled block tables, one spare block each so tables are not all tight."""
    ids = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables = []
    for computed, new in seqs:
        n = -(-(computed + new) // BLOCK_SIZE) + 1
        tables.append(ids[:n])
        ids = ids[n:]
    return tables


def write_dense(kv_cache: torch.Tensor, table: list[int], k: torch.Tensor, v: torch.Tensor):
    """Put a sequence's cached K/V ([n, kvh, hd]) into layer 0 through its block table."""
    for pos in range(k.shape[0]):
        block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
        kv_cache[block, 0, 0, offset], kv_cache[block, 0, 1, offset] = k[pos], v[pos]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, computed: int) -> torch.Tensor:
    """q: [new, H, hd]; k, v: [seq_len, kvh, hd]. Causal, queries at the sequence's end."""
    new, seq_len = q.shape[0], k.shape[0]
    group = NUM_HEADS // NUM_KV_HEADS
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, seq_len, hd]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, seq_len, hd]
    q_pos = computed + torch.arange(new)  # [new]
    mask = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [new, seq_len]
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask)
    return out.transpose(0, 1)  # [new, H, hd]


@pytest.mark.parametrize("name", list(BATCHES))
def test_paged_attention_matches_dense_per_sequence(name):
    seqs = BATCHES[name]
    gen = torch.Generator().manual_seed(0)
    # Unwritten slots hold noise (finite), so anything read past a sequence's end shows.
    kv_cache = torch.randn(NUM_BLOCKS, 1, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    tables = make_tables(seqs, gen)
    qs, ks, vs, new_ks, new_vs, want = [], [], [], [], [], []
    for (computed, new), table in zip(seqs, tables):
        k = torch.randn(computed + new, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        v = torch.randn(computed + new, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        q = torch.randn(new, NUM_HEADS, HEAD_DIM, generator=gen)
        write_dense(kv_cache, table, k[:computed], v[:computed])
        qs.append(q), ks.append(k), vs.append(v)
        new_ks.append(k[computed:]), new_vs.append(v[computed:])
        want.append(reference(q, k, v, computed))

    meta = AttentionMetadata.build(
        [c for c, _ in seqs], [n for _, n in seqs], tables, BLOCK_SIZE, "cpu"
    )
    got = paged_attention(
        torch.cat(qs), torch.cat(new_ks), torch.cat(new_vs), kv_cache, 0, meta, HEAD_DIM**-0.5
    )  # [T, H, hd]

    torch.testing.assert_close(got, torch.cat(want), rtol=1e-5, atol=1e-5)
    for (computed, new), table, k in zip(seqs, tables, ks):  # new K landed in its slots
        last = computed + new - 1
        torch.testing.assert_close(
            kv_cache[table[last // BLOCK_SIZE], 0, 0, last % BLOCK_SIZE], k[last]
        )


def test_metadata_splits_decodes_from_prefill_segments():
    meta = AttentionMetadata.build(
        [c for c, _ in MIXED],
        [n for _, n in MIXED],
        make_tables(MIXED, torch.Generator().manual_seed(0)),
        BLOCK_SIZE,
        "cpu",
    )
    # Rows in T: 0-6 | 7 | 8-26 | 27 | 28 | 29-30 | 31 | 32-47. A short chunk over a cached
    # context (3, 2) goes as one-token rows, each reading the keys up to its own.
    assert meta.decodes.token_indices.tolist() == [7, 27, 28, 29, 30, 31]
    assert meta.decodes.key_mask[:, 0, 0].sum(-1).tolist() == [6, 21, 1, 4, 5, 10]
    bounds = [(s.token_start, s.token_end, s.seq_len) for s in meta.prefills]
    assert bounds == [(0, 7, 7), (8, 27, 32), (32, 48, 16)]
    # A chunk with no cached context is plain causal; one after a prefix hit gets a mask.
    assert [s.attn_mask is None for s in meta.prefills] == [True, False, True]
    assert meta.prefills[1].attn_mask.shape == (19, 32)


def test_decode_only_step_has_no_row_indices():
    meta = AttentionMetadata.build([3, 8], [1, 1], [[1], [2, 3, 4]], BLOCK_SIZE, "cpu")
    assert meta.decodes.token_indices is None and meta.prefills == []


@pytest.fixture(scope="module")
def kernels():
    ops = cpu_kernels()
    if ops is None:
        pytest.skip("the CPU kernels could not be built here (see their log)")
    return ops


@pytest.mark.parametrize("window", [None, 5])
def test_decode_kernel_matches_the_gathered_path(kernels, window, monkeypatch):
    gen = torch.Generator().manual_seed(1)
    num_layers, seq_lens = 3, [1, 4, 5, 17, 30, 9]
    kv_cache = torch.randn(
        NUM_BLOCKS, num_layers, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=gen
    )
    tables = make_tables([(n - 1, 1) for n in seq_lens], gen)
    decodes = DecodeBatch.build(
        list(range(len(seq_lens))), seq_lens, tables, BLOCK_SIZE, len(seq_lens), "cpu"
    )
    q = torch.randn(len(seq_lens), NUM_HEADS, HEAD_DIM, generator=gen)
    opts = AttentionOptions(scale=0.3, sliding_window=window)
    got = attention.decode_attention(q, kv_cache, 1, decodes, opts)
    monkeypatch.setattr(attention, "cpu_kernels", lambda: None)
    want = attention.decode_attention(q, kv_cache, 1, decodes, opts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_decode_kernel_rejects_what_it_cannot_read(kernels):
    kv_cache = torch.zeros(4, 1, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    q = torch.zeros(1, NUM_HEADS, HEAD_DIM)
    table, lens = torch.tensor([[0, 1]]), torch.tensor([3])
    with pytest.raises(RuntimeError, match="float32"):
        kernels.paged_decode_attention(q.double(), kv_cache, 0, table, lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernels.paged_decode_attention(q, kv_cache, 0, torch.tensor([[0, 9]]), lens, 1.0, 0)
    with pytest.raises(RuntimeError, match="sequence length"):
        kernels.paged_decode_attention(q, kv_cache, 0, table, torch.tensor([9]), 1.0, 0)


def test_rope_and_cache_kernel_is_bitwise_the_unfused_ops(kernels):
    """q, k and v as views into one fused projection's output, as the fused modes hold them."""
    gen = torch.Generator().manual_seed(2)
    seqs = [(0, 5), (6, 1), (3, 4)]
    meta = AttentionMetadata.build(
        [c for c, _ in seqs], [n for _, n in seqs], make_tables(seqs, gen), BLOCK_SIZE, "cpu"
    )
    sizes = (NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM)
    qkv = torch.randn(meta.num_tokens, sum(sizes), generator=gen) * 3
    q, k, v = (
        t.view(meta.num_tokens, -1, HEAD_DIM) for t in qkv.split(sizes, dim=-1)
    )  # strided views
    angles = torch.rand(meta.num_tokens, 1, HEAD_DIM, generator=gen) * 40
    cos, sin = angles.cos(), angles.sin()
    shape = (NUM_BLOCKS, 2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    want_cache, got_cache = torch.zeros(shape), torch.zeros(shape)
    write_kv(apply_rope(k, cos, sin), v, want_cache, 1, meta)
    got_q = kernels.rope_and_cache_kv(
        q, k, v, cos, sin, got_cache, 1, meta.slot_block_ids, meta.slot_offsets
    )
    assert torch.equal(got_q, apply_rope(q, cos, sin))
    assert torch.equal(got_cache, want_cache)


GENERATE = """
import json, sys
from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.kernels import cpu_kernels
llm = LLM(sys.argv[1], num_blocks=64)
params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
outputs = llm.generate(["hello world", "one two three four five six"], params)
print(json.dumps([cpu_kernels() is not None, [o.token_ids for o in outputs]]))
"""


def _generate(model: str, **env: str) -> tuple[bool, list[list[int]]]:
    done = subprocess.run(
        [sys.executable, "-c", GENERATE, model], capture_output=True, text=True, timeout=600,
        env={**os.environ, **env},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    built, tokens = json.loads(done.stdout.strip().splitlines()[-1])
    return built, tokens


def test_without_a_compiler_torch_paths_give_the_same_tokens(kernels, preset_dir, tmp_path):
    model = preset_dir("tiny-llama")
    built, want = _generate(model)
    assert built
    unbuilt = {"CXX": str(tmp_path / "no-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    built, got = _generate(model, **unbuilt)
    assert not built and got == want
