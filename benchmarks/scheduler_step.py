"""Microseconds per scheduler step (schedule() + update_from_output()), no model.

Runner outputs are built by hand between the timed calls. Default workload: 256 requests of
512 distinct prompt tokens and 128 output tokens, block size 16, 8192 blocks, 8192-token
budget, 256 sequences; prefix caching on and off.

    python -m pdcluster.benchmarks.scheduler_step [--prefix-caching {on,off,both}]

`--shared-prefix-len N` counts admissions instead of timing steps: every request's prompt is
the same N tokens then `--unique-len` tokens of its own, all arriving together. It prints how
many requests the first step admits, how many of them hit the prefix cache, and the prompt
tokens computed (not taken from the cache) until every prompt is prefilled.

    python -m pdcluster.benchmarks.scheduler_step --num-requests 128 --shared-prefix-len 384 --unique-len 8
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time

from pdcluster.engine.config import CacheConfig, SchedulerConfig
from pdcluster.engine.outputs import RunnerOutput, SchedulerOutput
from pdcluster.engine.request import Request
from pdcluster.engine.sampling_params import SamplingParams
from pdcluster.engine.scheduler import Scheduler


def fake_runner_output(scheduler: Scheduler, so: SchedulerOutput, token_id: int) -> RunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    requests = scheduler.requests
    sampled = []
    for rid in req_ids:
        r = requests[rid]
        sampled.append([token_id] if r.num_computed_tokens >= r.num_tokens else [])
    return RunnerOutput(req_ids, {rid: i for i, rid in enumerate(req_ids)}, sampled)


def make_scheduler(args: argparse.Namespace, prefix_caching: bool) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=args.budget,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.prompt_len + args.output_len + 16,
            enable_prefix_caching=prefix_caching,
        ),
        CacheConfig(block_size=args.block_size, num_blocks=args.num_blocks),
    )


def run(args: argparse.Namespace, prefix_caching: bool) -> dict[str, float]:
    scheduler = make_scheduler(args, prefix_caching)
    rng = random.Random(0)
    for i in range(args.num_requests):
        prompt = [rng.randrange(3, 32000) for _ in range(args.prompt_len)]
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        scheduler.add_request(Request(f"r{i}", prompt, params, eos_token_ids=(2,)))
    if args.gc_freeze:  # as an engine does once set up: long-lived objects leave GC scans
        gc.collect()
        gc.freeze()
    all_us, decode_us, decode_running = [], [], []
    while scheduler.has_requests():
        t0 = time.perf_counter()
        so = scheduler.schedule()
        t1 = time.perf_counter()
        ro = fake_runner_output(scheduler, so, token_id=5)
        t2 = time.perf_counter()
        scheduler.update_from_output(so, ro)
        t3 = time.perf_counter()
        us = (t1 - t0 + t3 - t2) * 1e6
        all_us.append(us)
        num_reqs = len(so.num_scheduled_tokens)
        if num_reqs and so.total_num_scheduled_tokens == num_reqs and not so.scheduled_new_reqs:
            decode_us.append(us)  # every scheduled request decodes one token
            decode_running.append(num_reqs)
    all_us.sort()
    gc.unfreeze()
    return {
        "steps": len(all_us),
        "mean": statistics.fmean(all_us),
        "p50": all_us[len(all_us) // 2],
        "p99": all_us[min(len(all_us) - 1, int(len(all_us) * 0.99))],
        "decode_steps": len(decode_us),
        "decode_mean": statistics.fmean(decode_us) if decode_us else float("nan"),
        "decode_p50": statistics.median(decode_us) if decode_us else float("nan"),
        "decode_running": statistics.fmean(decode_running) if decode_running else 0.0,
    }


def run_shared_prefix(args: argparse.Namespace) -> dict[str, int]:
    """Admission of a burst sharing one prefix: first-step admissions and prompt tokens
    computed until every prompt is prefilled."""
    scheduler = make_scheduler(args, prefix_caching=True)
    rng = random.Random(0)
    prefix = [rng.randrange(3, 32000) for _ in range(args.shared_prefix_len)]
    requests = []
    for i in range(args.num_requests):
        prompt = prefix + [rng.randrange(3, 32000) for _ in range(args.unique_len)]
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        requests.append(Request(f"r{i}", prompt, params, eos_token_ids=(2,)))
        scheduler.add_request(requests[-1])
    first: dict[str, int] = {}
    num_steps = num_prompt_tokens = 0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in requests):
        so = scheduler.schedule()
        for rid, n in so.num_scheduled_tokens.items():
            r = scheduler.requests[rid]
            num_prompt_tokens += max(0, min(n, r.num_prompt_tokens - (r.num_computed_tokens - n)))
        if not num_steps:
            first = {
                "admitted": len(so.scheduled_new_reqs),
                "hits": sum(1 for n in so.scheduled_new_reqs if n.num_computed_tokens),
                "tokens": so.total_num_scheduled_tokens,
            }
        scheduler.update_from_output(so, fake_runner_output(scheduler, so, token_id=5))
        num_steps += 1
    return {**first, "steps": num_steps, "prompt_tokens": num_prompt_tokens}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefix-caching", choices=["on", "off", "both"], default="both")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--budget", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--no-gc-freeze",
        dest="gc_freeze",
        action="store_false",
        help="keep long-lived objects in GC scans (shows gen-2 collection pauses in p99)",
    )
    p.add_argument("--shared-prefix-len", type=int, default=0)
    p.add_argument("--unique-len", type=int, default=8)
    args = p.parse_args()
    if args.shared_prefix_len:
        r = run_shared_prefix(args)
        print(
            f"{args.num_requests} requests, {args.shared_prefix_len} shared + {args.unique_len} "
            f"unique prompt tokens, budget {args.budget}: first step admits {r['admitted']} "
            f"({r['hits']} with a prefix hit, {r['tokens']} tokens); {r['prompt_tokens']} "
            f"prompt tokens computed in {r['steps']} steps until all are prefilled"
        )
        return
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.prefix_caching]
    for prefix_caching in modes:
        r = run(args, prefix_caching)
        print(
            f"prefix_caching={'on' if prefix_caching else 'off':3s}  steps={r['steps']}  "
            f"all steps: mean={r['mean']:.0f}us p50={r['p50']:.0f}us p99={r['p99']:.0f}us  "
            f"steady decode ({r['decode_steps']} steps, {r['decode_running']:.0f} running avg): "
            f"mean={r['decode_mean']:.0f}us p50={r['decode_p50']:.0f}us"
        )


if __name__ == "__main__":
    main()
