"""Milliseconds per layer of `paged_attention` on mixed prefill/decode batches, one thread.

SmolLM2-135M attention shapes (9 query heads, 3 KV heads, head_dim 64), block size 16,
float32 on CPU. Each decode reads a context of `--decode-context` tokens; prefill chunks
start after `--prefill-cached` cached tokens. The metadata build (once per step, shared by
all layers) is timed apart.

    python -m pdcluster.benchmarks.attention_step [--repeats 5] [--decode-context 512]
        [--save before.json] [--baseline before.json]

`--save` writes ms per layer by batch; `--baseline` reads such a file (e.g. saved at an older
commit) and prints the ratio baseline / now.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pdcluster.engine.attention import AttentionMetadata, paged_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


@dataclass(frozen=True)
class Batch:
    name: str
    prefill_lens: list[int]
    num_decodes: int


BATCHES = (
    Batch("1x1024 prefill + 63 decodes", [1024], 63),
    Batch("4x256 prefill + 60 decodes", [256] * 4, 60),
    Batch("64 decodes", [], 64),
)


def step_inputs(batch: Batch, args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """(num_computed_tokens, num_scheduled_tokens) per sequence: prefills first."""
    computed = [args.prefill_cached] * len(batch.prefill_lens)
    computed += [args.decode_context - 1] * batch.num_decodes
    return computed, list(batch.prefill_lens) + [1] * batch.num_decodes


def block_tables(seq_lens: list[int]) -> tuple[list[list[int]], int]:
    """Disjoint, shuffled block tables (block 0 left unused) and the number of blocks."""
    counts = [-(-n // BLOCK_SIZE) for n in seq_lens]
    ids = (torch.randperm(sum(counts)) + 1).tolist()
    tables, start = [], 0
    for n in counts:
        tables.append(ids[start : start + n])
        start += n
    return tables, sum(counts) + 1


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run(batch: Batch, args: argparse.Namespace) -> tuple[float, float]:
    """(metadata build ms per step, paged_attention ms per layer)."""
    computed, scheduled = step_inputs(batch, args)
    tables, num_blocks = block_tables([c + s for c, s in zip(computed, scheduled)])
    kv_cache = torch.randn(num_blocks, 1, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    num_tokens = sum(scheduled)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM)  # [T, H, hd]
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)  # [T, kvh, hd]
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)  # [T, kvh, hd]

    def build() -> AttentionMetadata:
        return AttentionMetadata.build(computed, scheduled, tables, BLOCK_SIZE, "cpu")

    meta = build()
    build_ms = median_ms(build, args.repeats)
    attn_ms = median_ms(
        lambda: paged_attention(q, k, v, kv_cache, 0, meta, HEAD_DIM**-0.5), args.repeats
    )
    return build_ms, attn_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-context", type=int, default=512)
    parser.add_argument("--prefill-cached", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--save", help="write {batch: attention ms/layer} as JSON here")
    parser.add_argument("--baseline", help="JSON from --save to compare against")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else {}
    print(f"{'batch':<30} {'build ms/step':>14} {'attn ms/layer':>14} {'baseline':>9} {'ratio':>6}")
    results = {}
    with torch.inference_mode():
        for batch in BATCHES:
            build_ms, attn_ms = run(batch, args)
            results[batch.name] = attn_ms
            base = baseline.get(batch.name)
            base_s = f"{base:>9.3f} {base / attn_ms:>5.2f}x" if base else f"{'-':>9} {'-':>6}"
            print(f"{batch.name:<30} {build_ms:>14.3f} {attn_ms:>14.3f} {base_s}")
    if args.save:
        Path(args.save).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
