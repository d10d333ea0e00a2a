"""Prefill and decode step time of one engine at tensor_parallel_size 1 vs N (float32, CPU).

Each TP size gets the same cores: rank 0 and every worker run `--cores // tp` torch threads.
A prefill step runs `--batch` prompts of `--prompt-len` tokens in one step; a decode step
runs one new token for each of them. Medians over `--decode-steps` decode steps and
`--repeats` prefill steps.

    python -m pdcluster.benchmarks.tp_step --model smollm2-135m [--tp 1 2] [--cores 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from pdcluster.engine.llm import LLM
from pdcluster.engine.sampling_params import SamplingParams


def step_ms(llm: LLM) -> float:
    start = time.perf_counter()
    llm.engine.step()
    return (time.perf_counter() - start) * 1e3


def measure(
    llm: LLM, batch: int, prompt_len: int, decode_steps: int, round_idx: int
) -> tuple[float, float]:
    """(prefill ms, median decode ms) of round `round_idx`: `batch` prompts of its own."""
    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
    base = 100 + 7 * round_idx * batch  # fresh prompts: no prefix-cache hit
    for i in range(batch):
        prompt = [(base + 13 * i + j) % 40000 + 10 for j in range(prompt_len)]
        request = llm.processor.process(f"r{round_idx}-{i}", {"prompt_token_ids": prompt}, params)
        llm.engine.add_request(request)
    prefill = step_ms(llm)
    decodes = [step_ms(llm) for _ in range(decode_steps)]
    while llm.engine.has_work():
        llm.engine.step()
    return prefill, statistics.median(decodes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--cores", type=int, default=os.cpu_count())
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f}; {args.batch} x {args.prompt_len} prompt tokens")
    for tp in args.tp:
        torch.set_num_threads(max(1, args.cores // tp))
        llm = LLM(args.model, dtype="float32", tensor_parallel_size=tp, num_blocks=512)
        try:
            measure(llm, args.batch, args.prompt_len, 4, 0)  # warm-up
            rounds = [
                measure(llm, args.batch, args.prompt_len, args.decode_steps, i + 1)
                for i in range(args.repeats)
            ]
        finally:
            llm.engine.shutdown()
        prefill = statistics.median(r[0] for r in rounds)
        decode = statistics.median(r[1] for r in rounds)
        print(
            f"TP{tp} ({torch.get_num_threads()} thread(s)/rank): prefill step {prefill:.1f} ms, "
            f"decode step {decode:.1f} ms; load average {os.getloadavg()[0]:.1f}"
        )


if __name__ == "__main__":
    main()
