"""Time to first token of long prompts handed from P to D, against the prefill alone, in one
run (`pdcluster bench --handoff-ttft`).

The same `--num-prompts` prompts (`--prompt-tokens` random ordinary token ids each) are sent
one at a time (nothing queues) to two topologies launched in turn in one embedded Ray: 1P1D
with `--max-tokens` greedy `ignore_eos` tokens, and one colocated (mixed) instance with
max_tokens=1, whose TTFT is the prefill alone. The P->D handoff is not streamed per chunk:
D receives the whole prompt's KV after P's prefill.

Reported: client TTFT p50/p90 of each, the ratio 1P1D ÷ prefill alone, the handoff part
(TTFT_pd - TTFT_prefill, per prompt then p50), P's and D's stage times from the gateway's
traces (P prefill, P first token -> D received, D KV wait, D first step), and the load
average at the start and end of each topology's run.

    python -m pdcluster.benchmarks.handoff_ttft --model smollm2-135m --num-prompts 6 \\
        --prompt-tokens 2048 --out handoff-out
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

from pdcluster.benchmarks.metrics import percentile
from pdcluster.benchmarks.report import loadavg, save_results
from pdcluster.benchmarks.sessions import TOKEN_RANGE, int_pair
from pdcluster.benchmarks.stages import request_stages
from pdcluster.benchmarks.targets import embedded_ray, pd_config
from pdcluster.engine import SamplingParams

STAGES = ("prefill", "to_decode", "kv_wait", "first_decode_step")


def make_prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [
        [rng.randrange(*args.token_range) for _ in range(args.prompt_tokens)]
        for _ in range(args.num_prompts)
    ]


async def first_token_s(cluster: Any, prompt: list[int], max_tokens: int) -> tuple[str, float]:
    """(request id, seconds from submission to its first token); runs it to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = cluster.make_request({"prompt_token_ids": prompt}, params)
    sent_s, ttft_s = time.perf_counter(), None
    async for out in cluster.stream(request):
        if out.error:
            raise RuntimeError(f"request {request.request_id}: {out.error}")
        if ttft_s is None and out.new_token_ids:
            ttft_s = time.perf_counter() - sent_s
    return request.request_id, ttft_s or 0.0


def run_topology(
    args: argparse.Namespace, prompts: list[list[int]], colocated: bool
) -> dict[str, Any]:
    """Each prompt in turn on 1P1D, or on one mixed instance with max_tokens=1."""
    from pdcluster.cluster.control.launch import launch

    engine = {"max_num_seqs": 4, "max_model_len": args.prompt_tokens + args.max_tokens + 16}
    none = {"count": 0}
    mixed = {"prefill": none, "decode": none, "mixed": {"count": 1, "num_cpus": 1}}
    cluster = launch(pd_config(args, engine, **(mixed if colocated else {})))
    max_tokens = 1 if colocated else args.max_tokens
    try:
        asyncio.run(first_token_s(cluster, prompts[0][: args.prompt_tokens // 4], 1))  # warm-up
        load_start = loadavg()
        ttfts = [asyncio.run(first_token_s(cluster, p, max_tokens)) for p in prompts]
        load_end = loadavg()
        traces = {t.request_id: t for t in cluster.front.traces()}
    finally:
        cluster.shutdown()
    stages = [request_stages(traces[rid], s) for rid, s in ttfts if rid in traces]
    return {
        "topology": "1 mixed, max_tokens=1" if colocated else "1P1D",
        "ttft_ms": [_ms(s) for _, s in ttfts],
        "stage_p50_ms": {k: _p50([s.get(k) for s in stages]) for k in STAGES},
        "load_avg_start": load_start,
        "load_avg_end": load_end,
    }


def summarize(pd: dict[str, Any], alone: dict[str, Any]) -> dict[str, Any]:
    def p(values: list[float], q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else round(v, 1)

    handoff = [a - b for a, b in zip(pd["ttft_ms"], alone["ttft_ms"])]
    pd_p50, alone_p50 = p(pd["ttft_ms"], 50), p(alone["ttft_ms"], 50)
    return {
        "ttft_pd_ms": {"p50": pd_p50, "p90": p(pd["ttft_ms"], 90)},
        "ttft_prefill_alone_ms": {"p50": alone_p50, "p90": p(alone["ttft_ms"], 90)},
        "ttft_pd_over_prefill_alone_p50": round(pd_p50 / alone_p50, 3) if alone_p50 else None,
        "handoff_ms": {"p50": p(handoff, 50), "max": p(handoff, 100)},
    }


def _p50(values: list[float | None]) -> float | None:
    v = percentile([x for x in values if x is not None], 50)
    return None if v is None else round(v, 1)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdcluster bench --handoff-ttft",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--prompt-tokens", type=int, default=2048, help="token ids per prompt")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per 1P1D request")
    p.add_argument("--token-range", type=int_pair, default=TOKEN_RANGE, help="LO,HI token ids")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(prefills=1, decodes=1)  # the disaggregated topology: 1P1D
    p.add_argument("--out", type=Path, default=None, help="folder for results.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    prompts = make_prompts(args)
    with embedded_ray(3):
        pd = run_topology(args, prompts, colocated=False)
        alone = run_topology(args, prompts, colocated=True)
    result = {"command": argv, "summary": summarize(pd, alone), "pd": pd, "prefill_alone": alone}
    print(json.dumps(result, indent=2))
    save_results(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
