"""Tokens/s of n-gram speculative decoding against none, on an input-grounded task.

The task: the model is asked to return a short Python file with comments added, so most of
its output repeats its input, the case prompt lookup is for. Both engines run the same checkpoint
in the same format, greedy, in one process one after the other (warmed up once each); printed
are tokens/s without and with speculation, their ratio, the acceptance (accepted draft tokens
per draft token, and per position), and whether the outputs are token-identical.

- one stream: the task once, --max-tokens at most (both stop at the same EOS when identical);
- --streams N (0: skip): N copies of the task at once, each its own request number, the
  throughput ratio at a batch where verifying drafts competes with other requests for compute
  (the goal is no loss: >= 0.95x).

    python -m pdcluster.benchmarks.spec_decode [--model smollm2-135m] [--num-speculative-tokens 4]
        [--prompt-lookup-min 1] [--prompt-lookup-max 5] [--disable-by-batch-size N]
        [--max-tokens 384] [--streams 32] [--stream-max-tokens 128] [--threads 1]

Defaults to the exact mode (float32, no quantization); --quantization measures another.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import torch

from pdcluster.benchmarks.report import loadavg
from pdcluster.engine import LLM, SamplingParams
from pdcluster.engine.config import DEFAULT_QUANTIZATION, QUANTIZATIONS
from pdcluster.engine.spec_decode.metrics import SpecDecodingStats

CODE_FILE = """\
import json
import os


def load_config(path):
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def merge(base, override):
    result = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = merge(result[key], value)
        else:
            result[key] = value
    return result


class Cache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.items = {}
        self.order = []

    def get(self, key):
        if key not in self.items:
            return None
        self.order.remove(key)
        self.order.append(key)
        return self.items[key]

    def put(self, key, value):
        if key in self.items:
            self.order.remove(key)
        elif len(self.items) >= self.capacity:
            oldest = self.order.pop(0)
            del self.items[oldest]
        self.items[key] = value
        self.order.append(key)
"""


def task(request_number: int | None = None) -> list[dict[str, str]]:
    ask = "Add a short comment above each function in this Python file and return the whole file."
    if request_number is not None:
        ask += f" (request {request_number})"
    return [{"role": "user", "content": f"{ask}\n\n```python\n{CODE_FILE}```"}]


@dataclass
class Run:
    token_ids: list[list[int]]
    seconds: float
    spec: SpecDecodingStats | None = None  # this run's, with speculation

    @property
    def tokens_per_s(self) -> float:
        return sum(len(t) for t in self.token_ids) / self.seconds


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> Run:
    before = llm.engine.stats().get("spec_decode")
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    seconds = time.perf_counter() - start
    spec = None if before is None else llm.engine.stats()["spec_decode"].since(before)
    return Run([o.token_ids for o in outputs], seconds, spec)


def compare(
    label: str, base: LLM, spec: LLM, prompts: list[list[int]], params: SamplingParams
) -> None:
    warm_up = dataclasses.replace(params, max_tokens=8)  # kernels, the prompts' prefix blocks
    for llm in (base, spec):
        llm.generate([{"prompt_token_ids": p} for p in prompts], warm_up)
    off, on = timed(base, prompts, params), timed(spec, prompts, params)
    stats = on.spec
    per_pos = [round(n / stats.num_drafts, 2) for n in stats.num_accepted_tokens_per_pos]
    print(
        f"{label}: {sum(len(t) for t in off.token_ids)} tokens\n"
        f"  without speculation: {off.tokens_per_s:.1f} tok/s\n"
        f"  with n-gram:         {on.tokens_per_s:.1f} tok/s  "
        f"({on.tokens_per_s / off.tokens_per_s:.2f}x)\n"
        f"  acceptance: {stats.acceptance_rate:.2f} of {stats.num_draft_tokens} draft tokens "
        f"in {stats.num_drafts} drafts; accepted per draft by position {per_pos}\n"
        f"  identical outputs: {on.token_ids == off.token_ids}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=DEFAULT_QUANTIZATION, choices=QUANTIZATIONS)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=1)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--disable-by-batch-size", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=384, help="one stream's output at most")
    p.add_argument("--streams", type=int, default=32, help="the batch load's streams; 0: skip")
    p.add_argument("--stream-max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    speculative_config = {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
        "disable_by_batch_size": args.disable_by_batch_size,
    }
    engine = {"dtype": args.dtype, "quantization": args.quantization, "max_model_len": 4096}
    base = LLM(args.model, **engine)
    spec = LLM(args.model, **engine, speculative_config=speculative_config)
    print(
        f"{args.model} ({args.dtype}, quantization {args.quantization}), threads={args.threads}, "
        f"speculative_config={speculative_config}, load average {loadavg()}"
    )
    encode = base.tokenizer.encode_chat
    one = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    compare("one stream", base, spec, [encode(task())], one)
    if args.streams:
        many = SamplingParams(temperature=0.0, max_tokens=args.stream_max_tokens)
        prompts = [encode(task(i)) for i in range(args.streams)]
        compare(f"{args.streams} streams", base, spec, prompts, many)


if __name__ == "__main__":
    main()
