"""A draft model across the P→D handoff: its KV for the prompt carried from P, against D
computing it again, in one run.

Two 1P1D topologies of `--model` (exact mode, float32) drafted by `--draft-model` (default:
the target itself in `--draft-quantization`), launched in turn in one embedded Ray:

- carried: P drafts too, so it computes the draft's KV beside each prompt's and the handoff
  carries it; D drafts from its first step;
- recomputed: only D drafts; its draft model first catches each prompt up in one pass.

Loads, the same prompts (a code file repeated to `--prompt-tokens`, then asked to go on) on
both: `sequential`, one request at a time, where the difference is the first token gap (D's
first step: the catch-up when recomputed) against the TTFT (P's prefill: the draft's too when
carried); `staggered`, `--streams` requests sent `--stagger-s` apart, where a recomputing D
stalls every running stream for each new prompt (the inter-token gaps' p99 shows it).

Printed: per topology and load, TTFT, first gap (token 1 -> 2), inter-token gap p50/p99,
request latency p50 and tokens/s per stream, D's draft acceptance and catch-up tokens, P's
bytes sent, and the ratios carried ÷ recomputed.

    python -m pdcluster.benchmarks.draft_handoff --prompt-tokens 1024 --max-tokens 64 \\
        --num-prompts 3 --streams 4 --stagger-s 1.0 [--out draft-handoff-out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from pdcluster.benchmarks.metrics import percentile
from pdcluster.benchmarks.report import loadavg, save_results
from pdcluster.benchmarks.spec_decode import CODE_FILE
from pdcluster.benchmarks.targets import embedded_ray, pd_config
from pdcluster.engine import SamplingParams
from pdcluster.engine.config import QUANTIZATIONS

TOPOLOGIES = ("carried", "recomputed")


def make_prompts(tokenizer: Any, num_prompts: int, prompt_tokens: int) -> list[list[int]]:
    """`num_prompts` prompts of `prompt_tokens` ids: the code file repeated (each prompt a
    different cut, so no prefix is shared), then an ask to go on."""
    code = tokenizer.encode(CODE_FILE)
    ask = tokenizer.encode("\n# The same file once more:\n")
    body = prompt_tokens - len(ask)
    copies = code * (body // len(code) + 2)
    return [copies[i * 7 : i * 7 + body] + ask for i in range(num_prompts)]


async def timed_stream(cluster: Any, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Send one request; the time of each token from submission (tokens of one event share
    it) and its end."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = cluster.make_request({"prompt_token_ids": prompt}, params)
    sent_s = time.perf_counter()
    token_s: list[float] = []
    async for out in cluster.stream(request):
        if out.error:
            raise RuntimeError(f"request {request.request_id}: {out.error}")
        token_s += [time.perf_counter() - sent_s] * len(out.new_token_ids)
    return {"token_s": token_s}


async def staggered(
    cluster: Any, prompts: list[list[int]], max_tokens: int, stagger_s: float
) -> list[dict[str, Any]]:
    async def delayed(i: int, prompt: list[int]) -> dict[str, Any]:
        await asyncio.sleep(i * stagger_s)
        return await timed_stream(cluster, prompt, max_tokens)

    return list(await asyncio.gather(*(delayed(i, p) for i, p in enumerate(prompts))))


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT, first gap, inter-token gaps (between token events) and latency, in ms."""
    ttft = [r["token_s"][0] for r in runs]
    first_gap = [r["token_s"][1] - r["token_s"][0] for r in runs]
    gaps = [
        b - a for r in runs for a, b in zip(r["token_s"], r["token_s"][1:]) if b > a
    ]  # one per event: tokens verified in one step arrive together
    latency = [r["token_s"][-1] for r in runs]
    tokens_per_s = [(len(r["token_s"]) - 1) / (r["token_s"][-1] - r["token_s"][0]) for r in runs]

    def ms(values: list[float], q: float) -> float:
        return round(percentile(values, q) * 1e3, 1)

    return {
        "ttft_ms_p50": ms(ttft, 50),
        "first_gap_ms_p50": ms(first_gap, 50),
        "itl_ms_p50": ms(gaps, 50),
        "itl_ms_p99": ms(gaps, 99),
        "latency_ms_p50": ms(latency, 50),
        "decode_tokens_per_s_p50": round(percentile(tokens_per_s, 50), 2),
    }


def run_topology(args: argparse.Namespace, name: str) -> dict[str, Any]:
    from pdcluster.cluster.control.launch import launch

    draft = {
        "method": "draft_model",
        "model": args.draft_model or args.model,
        "quantization": args.draft_quantization,
        "num_speculative_tokens": args.num_speculative_tokens,
    }
    drafting = {"count": 1, "num_cpus": 1, "engine": {"speculative_config": draft}}
    engine = {
        "max_num_seqs": max(4, args.streams),
        "max_model_len": args.prompt_tokens + args.max_tokens + 16,
        "num_threads": args.threads,
    }
    roles = {"decode": drafting}
    if name == "carried":
        roles["prefill"] = drafting
    cluster = launch(pd_config(args, engine, **roles))
    try:
        prompts = make_prompts(
            cluster.tokenizer, args.num_prompts + args.streams + 1, args.prompt_tokens
        )
        asyncio.run(timed_stream(cluster, prompts[0], 4))  # warm-up
        result: dict[str, Any] = {"load_avg_start": loadavg()}
        sequential = [
            asyncio.run(timed_stream(cluster, p, args.max_tokens))
            for p in prompts[1 : 1 + args.num_prompts]
        ]
        result["sequential"] = summarize(sequential)
        rest = prompts[1 + args.num_prompts :]
        result["staggered"] = summarize(
            asyncio.run(staggered(cluster, rest, args.max_tokens, args.stagger_s))
        )
        result["load_avg_end"] = loadavg()
        stats = {s.role.value: s for s in cluster.stats()}
    finally:
        cluster.shutdown()
    drafts = stats["decode"].spec_decode
    result["decode_acceptance"] = round(drafts.acceptance_rate, 3)
    result["decode_catch_up_tokens"] = drafts.num_catch_up_tokens
    result["prefill_bytes_sent"] = stats["prefill"].kv_transfer.bytes_sent
    return result


def ratios(carried: dict[str, Any], recomputed: dict[str, Any]) -> dict[str, Any]:
    """carried ÷ recomputed of each timing (below 1: carrying is faster)."""
    out = {}
    for load in ("sequential", "staggered"):
        for key, value in carried[load].items():
            if key.endswith("_ms_p50") or key.endswith("_ms_p99"):
                other = recomputed[load][key]
                out[f"{load}.{key}"] = round(value / other, 3) if other else None
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pdcluster.benchmarks.draft_handoff",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft-model", default=None, help="its checkpoint (default: the target)")
    p.add_argument("--draft-quantization", default="int4", choices=QUANTIZATIONS)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=3, help="of the sequential load")
    p.add_argument("--streams", type=int, default=4, help="of the staggered load")
    p.add_argument("--stagger-s", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per instance")
    p.add_argument("--out", type=Path, default=None, help="folder for results.json")
    p.set_defaults(prefills=1, decodes=1)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    with embedded_ray(3):
        runs = {name: run_topology(args, name) for name in TOPOLOGIES}
    result = {"command": argv, "ratios_carried_over_recomputed": ratios(**runs), **runs}
    print(json.dumps(result, indent=2))
    save_results(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
