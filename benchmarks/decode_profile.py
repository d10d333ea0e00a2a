"""Where one decode step's time goes: torch's profiler over --steps decode steps of --batch
streams, self CPU time per op grouped into matmuls, attention (KV write, gather, SDPA) and
the small ops (norms, RoPE, activations, residual adds, sampling), in ms per generated token (the short prompt's prefill included).

    python -m benchmarks.decode_profile [--model smollm2-135m] [--quantization int8]
        [--batch 1] [--steps 32] [--threads 1]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.report import loadavg
from engine import LLM, SamplingParams
from engine.config import DEFAULT_QUANTIZATION, QUANTIZATIONS

MATMUL_OPS = ("mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm", "aten::addmm", "aten::mm")
ATTENTION_OPS = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::index_select",
    "aten::_index_put_impl_",
)
TOP_OPS = 12  # small ops listed by name


def group_of(op: str) -> str:
    if op in MATMUL_OPS:
        return "matmul"
    return "attention" if op in ATTENTION_OPS else "small ops"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=DEFAULT_QUANTIZATION)
    p.add_argument("--batch", type=int, default=1, help="streams decoding together")
    p.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype="float32", quantization=args.quantization)
    prompts = [f"Hello there, number {i}" for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.steps, temperature=0, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params)
    per_group: dict[str, float] = defaultdict(float)
    small: dict[str, float] = {}
    for event in prof.key_averages():
        ms = event.self_cpu_time_total / 1e3 / args.steps
        per_group[group_of(event.key)] += ms
        if group_of(event.key) == "small ops":
            small[event.key] = ms
    print(
        f"{args.model} quantization={args.quantization} batch={args.batch} "
        f"threads={args.threads}, load average {loadavg()}; ms per generated token (self CPU time):"
    )
    for group, ms in sorted(per_group.items(), key=lambda kv: -kv[1]):
        print(f"  {group}: {ms:.2f}")
    print(f"  total: {sum(per_group.values()):.2f}")
    for op, ms in sorted(small.items(), key=lambda kv: -kv[1])[:TOP_OPS]:
        print(f"    {op}: {ms:.2f}")


if __name__ == "__main__":
    main()
