"""Decode speed of weight formats side by side, and where a decode step's time goes.

Each mode (every --dtypes x --quantizations pair) is loaded once; then --rounds rounds each
time one generate call of --batch streams x --steps tokens per mode, in turn, and the best
round per mode counts:
wall ms and CPU ms (this thread's, torch runs on --threads 1) per step, and each mode's
speed-up over the first mode, measured in this run. CPU time is what to read on a shared
machine: other processes stretch the wall time, not the CPU time. Then
torch's profiler over one such call per mode: self CPU time per op grouped into matmuls,
attention (KV write, gather, SDPA), whole layers run as one kernel call (4-bit decode steps
of a few rows: engine/models/decode_kernel.py) and the small ops (norms, RoPE, activations,
residual adds, sampling), in ms per generated token (the short prompt's prefill included).

    python -m pdcluster.benchmarks.decode_profile [--model smollm2-135m] [--dtypes float32,bfloat16]
        [--quantizations none,int8,int4] [--batch 1] [--steps 32] [--rounds 3] [--threads 1]

A mode prints as DTYPE:QUANTIZATION, with the formats each linear shape was given at load.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from pdcluster.benchmarks.report import loadavg
from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.config import QUANTIZATIONS
from pdcluster.engine.models.packed_linear import PackedLinear
from pdcluster.engine.models.quantized_linear import WeightOnlyLinear
from pdcluster.engine.models.tiered_linear import TieredLinear

MATMUL_OPS = (
    "mkldnn::_linear_pointwise",
    "aten::_weight_int8pack_mm",
    "aten::_weight_int4pack_mm_for_cpu",
    "aten::addmm",
    "aten::mm",
    "pdcluster::int4_linear",
    "pdcluster::int8_linear",
)
ATTENTION_OPS = (
    "pdcluster::paged_decode_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::index_select",
    "aten::_index_put_impl_",
)
LAYER_OPS = ("pdcluster::decode_layer",)  # a whole decoder layer in one call (its matmuls too)
TOP_OPS = 12  # small ops listed by name


def group_of(op: str) -> str:
    if op in MATMUL_OPS:
        return "matmul"
    if op in LAYER_OPS:
        return "whole layers"
    return "attention" if op in ATTENTION_OPS else "small ops"


def profile_call(llm: LLM, prompts: list[str], params: SamplingParams, steps: int) -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params)
    per_group: dict[str, float] = defaultdict(float)
    small: dict[str, float] = {}
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / steps
        per_group[group_of(event.key)] += ms
        if group_of(event.key) == "small ops":
            small[event.key] = ms
    for group, ms in sorted(per_group.items(), key=lambda kv: -kv[1]):
        print(f"  {group}: {ms:.2f}")
    print(f"  total: {sum(per_group.values()):.2f}")
    for op, ms in sorted(small.items(), key=lambda kv: -kv[1])[:TOP_OPS]:
        print(f"    {op}: {ms:.2f}")


def formats_by_shape(llm: LLM) -> dict[str, str]:
    """'[in -> out]' -> the formats its linears serve rows in (as chosen at load)."""
    found = {}
    for module in llm.engine.runner.model.modules():
        if isinstance(module, (TieredLinear, WeightOnlyLinear, PackedLinear)):
            shape = f"[{module.in_features} -> {module.out_features}]"
            found.setdefault(shape, f"{type(module).__name__}({module.extra_repr()})")
    kernels = [
        k for m in llm.engine.runner.model.modules() if (k := getattr(m, "decode_kernel", None))
    ]
    if kernels:
        rows = min(k.max_rows for k in kernels)
        found["decoder layers"] = f"{len(kernels)} in one call each, up to {rows} rows"
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument(
        "--dtypes", type=lambda s: s.split(","), default=["float32"],
        help="comma list of auto, float32, bfloat16 (the linears' weights on CPU)",
    )  # fmt: skip
    p.add_argument(
        "--quantizations", type=lambda s: s.split(","), default=list(QUANTIZATIONS),
        help=f"comma list of {', '.join(QUANTIZATIONS)}; the first mode is the baseline",
    )  # fmt: skip
    p.add_argument("--batch", type=int, default=1, help="streams decoding together")
    p.add_argument("--steps", type=int, default=32, help="tokens per stream per call")
    p.add_argument("--rounds", type=int, default=3, help="timed calls per mode")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llms = {
        f"{d}:{q}": LLM(args.model, dtype=d, quantization=q)
        for d in args.dtypes
        for q in args.quantizations
    }
    prompts = [f"Hello there, number {i}" for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.steps, temperature=0, ignore_eos=True)
    best_ms = dict.fromkeys(llms, float("inf"))
    best_cpu_ms = dict.fromkeys(llms, float("inf"))
    for llm in llms.values():
        llm.generate(prompts, params)  # warm-up
    for _ in range(args.rounds):
        for mode, llm in llms.items():
            start, start_cpu = time.perf_counter(), time.thread_time()
            llm.generate(prompts, params)
            cpu_ms = (time.thread_time() - start_cpu) * 1e3 / args.steps
            best_ms[mode] = min(best_ms[mode], (time.perf_counter() - start) * 1e3 / args.steps)
            best_cpu_ms[mode] = min(best_cpu_ms[mode], cpu_ms)
    base = next(iter(llms))
    print(
        f"{args.model}, {args.batch} stream(s) x {args.steps} tokens, threads={args.threads}, "
        f"best of {args.rounds}, load average {loadavg()}:"
    )
    for mode, ms in best_ms.items():
        cpu_ms = best_cpu_ms[mode]
        print(
            f"  {mode}: {ms:.1f} ms per step ({best_ms[base] / ms:.2f}x {base}'s speed), "
            f"CPU {cpu_ms:.1f} ms per step ({best_cpu_ms[base] / cpu_ms:.2f}x)"
        )
        for shape, formats in formats_by_shape(llms[mode]).items():
            print(f"    {shape}: {formats}")
    for mode, llm in llms.items():
        print(f"profile, quantization={mode}, ms per generated token (self CPU time):")
        profile_call(llm, prompts, params, args.steps)


if __name__ == "__main__":
    main()
