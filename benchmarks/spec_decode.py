"""Tokens/s of speculative decoding against none: n-gram drafts or a draft model.

Tasks (--task): `annotate` asks the model to return a short Python file with comments added,
so most of its output repeats its input, the case prompt lookup is for; `explain` asks for
free text, with nothing to look up, a draft model's case. Both engines run the same
checkpoint in the same format, greedy, in one process, alternating for --rounds rounds
(warmed up once each, the best round of each kept). Printed: tokens/s without and with
speculation, their ratio, the acceptance (accepted draft tokens per draft token, and per
position), and whether the outputs are token-identical.

- one: the task once, --max-tokens at most (both stop at the same EOS when identical);
- many: --streams copies of the task at once, each its own request number, the
  throughput ratio at a batch where verifying drafts competes with other requests for compute
  (the goal is no loss: >= 0.95x).

    python -m pdcluster.benchmarks.spec_decode [--model smollm2-135m] [--task annotate]
        [--method ngram|draft_model] [--draft-model PATH] [--draft-quantization int4]
        [--num-speculative-tokens 4] [--prompt-lookup-min 1] [--prompt-lookup-max 5]
        [--disable-by-batch-size N] [--loads one,many] [--max-tokens 384] [--streams 32]
        [--stream-max-tokens 128] [--rounds 2] [--threads 1]

A draft model defaults to the target itself in int4 (--draft-quantization).
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
from pdcluster.engine.config import DEFAULT_QUANTIZATION, QUANTIZATIONS, SPECULATIVE_METHODS
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


TASKS = {
    # input-grounded: most of the output repeats the input (prompt lookup's case)
    "annotate": "Add a short comment above each function in this Python file and return the "
    f"whole file.\n\n```python\n{CODE_FILE}```",
    # free text: nothing to look up; a draft model's case
    "explain": "Explain how a hash map works and when to use one, in about 300 words.",
}


def task(name: str, request_number: int | None = None) -> list[dict[str, str]]:
    ask = TASKS[name]
    if request_number is not None:
        ask = f"(request {request_number}) {ask}"
    return [{"role": "user", "content": ask}]


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
    label: str,
    base: LLM,
    spec: LLM,
    prompts: list[list[int]],
    params: SamplingParams,
    rounds: int,
) -> None:
    warm_up = dataclasses.replace(params, max_tokens=8)  # kernels, the prompts' prefix blocks
    for llm in (base, spec):
        llm.generate([{"prompt_token_ids": p} for p in prompts], warm_up)
    offs, ons = [], []
    for _ in range(rounds):  # alternating, so that a busy spell of the machine hits both
        offs.append(timed(base, prompts, params))
        ons.append(timed(spec, prompts, params))
    off = max(offs, key=lambda r: r.tokens_per_s)
    on = max(ons, key=lambda r: r.tokens_per_s)
    stats = on.spec
    per_pos = [round(n / max(stats.num_drafts, 1), 2) for n in stats.num_accepted_tokens_per_pos]
    print(
        f"{label}: {sum(len(t) for t in off.token_ids)} tokens, best of {rounds}\n"
        f"  without speculation: {off.tokens_per_s:.1f} tok/s\n"
        f"  with drafts:         {on.tokens_per_s:.1f} tok/s  "
        f"({on.tokens_per_s / off.tokens_per_s:.2f}x)\n"
        f"  acceptance: {stats.acceptance_rate:.2f} of {stats.num_draft_tokens} draft tokens "
        f"in {stats.num_drafts} drafts; accepted per draft by position {per_pos}\n"
        f"  identical outputs: {all(r.token_ids == off.token_ids for r in offs + ons)}"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=DEFAULT_QUANTIZATION, choices=QUANTIZATIONS)
    p.add_argument("--method", default="ngram", choices=SPECULATIVE_METHODS)
    p.add_argument("--draft-model", default=None, help="draft_model: its checkpoint (the target's)")
    p.add_argument("--draft-quantization", default="int4", choices=QUANTIZATIONS)
    p.add_argument("--task", default="annotate", choices=sorted(TASKS))
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=1)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--disable-by-batch-size", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=384, help="one stream's output at most")
    p.add_argument("--loads", type=lambda s: s.split(","), default=["one", "many"])
    p.add_argument("--streams", type=int, default=32, help="streams of the 'many' load")
    p.add_argument("--stream-max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2, help="timed runs of each engine, best kept")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    speculative_config = {
        "method": args.method,
        "num_speculative_tokens": args.num_speculative_tokens,
        "disable_by_batch_size": args.disable_by_batch_size,
    }
    if args.method == "ngram":
        speculative_config["prompt_lookup_min"] = args.prompt_lookup_min
        speculative_config["prompt_lookup_max"] = args.prompt_lookup_max
    else:
        speculative_config["model"] = args.draft_model or args.model
        speculative_config["quantization"] = args.draft_quantization
    engine = {"dtype": args.dtype, "quantization": args.quantization, "max_model_len": 4096}
    base = LLM(args.model, **engine)
    spec = LLM(args.model, **engine, speculative_config=speculative_config)
    print(
        f"{args.model} ({args.dtype}, quantization {args.quantization}), threads={args.threads}, "
        f"speculative_config={speculative_config}, load average {loadavg()}"
    )
    encode = base.tokenizer.encode_chat
    one = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    if "one" in args.loads:
        compare("one stream", base, spec, [encode(task(args.task))], one, args.rounds)
    if "many" in args.loads:
        many = SamplingParams(temperature=0.0, max_tokens=args.stream_max_tokens)
        prompts = [encode(task(args.task, i)) for i in range(args.streams)]
        compare(f"{args.streams} streams", base, spec, prompts, many, args.rounds)


if __name__ == "__main__":
    main()
