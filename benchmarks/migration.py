"""A decode instance killed under a streaming load: what clients see with migration off
(`router.migration_limit: 0`, streams fail as before) and on (the default), in one run.

For each limit: launch the topology (embedded Ray, every instance its own process), serve
its gateway on a loopback port, stream `--streams` concurrent greedy completions (distinct
prompts, `ignore_eos`, `--max-tokens` each) undisturbed, then the same again and
`ray.kill()` the decode instance holding the most streams once every stream has
`--kill-after-tokens` tokens (Ray restarts it). Per run it reports the streams that ended in
an error (an HTTP error or an SSE error chunk) and, of the streams that moved (the Front's
traces say which), the extra latency against the same stream undisturbed and the stall (the
longest gap between two chunks), against the undisturbed p50 TTFT (one prefill of a prompt
under this load: the goal is a stall of about one re-prefill of prompt + tokens so far).

    python -m benchmarks.migration --model smollm2-135m --prefills 1 --decodes 2 \\
        --streams 32 --max-tokens 128 --out migration-out
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.client import PreparedRequest, RequestResult, make_client, stream_one
from benchmarks.targets import embedded_ray, serve_in_thread
from benchmarks.workload import RequestSpec
from routing.policy import DEFAULT_MIGRATION_LIMIT

ENGINE = {"block_size": 16, "num_blocks": 1024, "max_num_seqs": 64, "max_model_len": 2048}
IDLE_TIMEOUT_S = 120.0


def prepared(num_streams: int, max_tokens: int, model: str, tag: str) -> list[PreparedRequest]:
    """Distinct prompts (no prefix shared beyond a few tokens), one request id each."""
    requests = []
    for i in range(num_streams):
        prompt = f"Story {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(24 + i % 16))
        body = {
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "request_id": f"{tag}-{i}",
        }  # fmt: skip
        requests.append(PreparedRequest(RequestSpec(0.0, 0, max_tokens), "/v1/completions", body))
    return requests


async def stream_all(
    url: str, requests: list[PreparedRequest], cluster: Any = None, kill_after: int = 0
) -> tuple[list[RequestResult], str | None]:
    """Every request at once; with `cluster`, the busiest decode instance is killed once
    every stream has `kill_after` chunks. Returns the results and the killed instance."""
    results = [RequestResult(r.spec) for r in requests]
    killed = None
    async with make_client() as client:
        tasks = [asyncio.ensure_future(stream_one(client, url, r, res))
                 for r, res in zip(requests, results)]  # fmt: skip
        if cluster is not None:
            while not all(r.ttft_s is not None and len(r.itl_s) + 1 >= kill_after
                          for r in results):  # fmt: skip
                if all(t.done() for t in tasks):
                    raise RuntimeError("the streams ended before the kill; raise --max-tokens")
                await asyncio.sleep(0.01)
            killed = await asyncio.get_running_loop().run_in_executor(None, kill_busiest, cluster)
        await asyncio.gather(*tasks)
    return results, killed


def kill_busiest(cluster: Any) -> str:
    import ray

    stats = [s for s in cluster.stats() if s["role"] == "decode" and s["healthy"]]
    victim = max(stats, key=lambda s: s.get("num_active", 0))["id"]
    ray.kill(cluster.instances[victim][1], no_restart=False)
    return victim


def run_one(args: argparse.Namespace, limit: int) -> dict[str, Any]:
    from cluster.config import ClusterConfig
    from cluster.control.launch import launch
    from cluster.replicas import gateway_app

    config = ClusterConfig.load(
        None,
        {
            "model": args.model,
            "engine": ENGINE,
            "prefill": {"count": args.prefills, "num_cpus": 1},
            "decode": {"count": args.decodes, "num_cpus": 1},
            "router": {"migration_limit": limit},
        },
    )
    cluster = launch(config)
    try:
        with serve_in_thread(gateway_app(cluster)) as url:
            name = cluster.model_name
            calm, _ = asyncio.run(
                stream_all(url, prepared(args.streams, args.max_tokens, name, f"calm{limit}"))
            )
            cluster.wait_idle(IDLE_TIMEOUT_S)
            tag = f"hit{limit}"
            requests = prepared(args.streams, args.max_tokens, name, tag)
            load_avg = os.getloadavg()[0]
            started = time.perf_counter()
            hit, killed = asyncio.run(stream_all(url, requests, cluster, args.kill_after_tokens))
            wall_s = time.perf_counter() - started
            moves = {_client_id(t.request_id, tag): t.num_moves for t in cluster.front.traces()}
    finally:
        cluster.shutdown()
    return summarize(limit, calm, hit, moves, tag, killed, wall_s, load_avg)


def summarize(
    limit: int,
    calm: list[RequestResult],
    hit: list[RequestResult],
    moves: dict[str, int],
    tag: str,
    killed: str | None,
    wall_s: float,
    load_avg: float,
) -> dict[str, Any]:
    moved = [i for i in range(len(hit)) if moves.get(f"{tag}-{i}", 0) > 0]
    extra = [hit[i].e2e_s - calm[i].e2e_s for i in moved if hit[i].ok]
    stalls = [max(hit[i].itl_s, default=0.0) for i in moved if hit[i].ok]
    calm_ttft = statistics.median(r.ttft_s for r in calm if r.ok)
    complete = [r for r in hit if r.ok and r.num_output_tokens == r.spec.output_len]
    return {
        "migration_limit": limit,
        "killed": killed,
        "streams": len(hit),
        "errors": sum(r.error is not None for r in hit),
        "complete": len(complete),
        "moved": len(moved),
        "extra_latency_ms_p50": _ms(statistics.median(extra)) if extra else None,
        "extra_latency_ms_max": _ms(max(extra)) if extra else None,
        "stall_ms_p50": _ms(statistics.median(stalls)) if stalls else None,
        "stall_ms_max": _ms(max(stalls)) if stalls else None,
        "calm_ttft_ms_p50": _ms(calm_ttft),
        "calm_itl_ms_max": _ms(max(max(r.itl_s, default=0.0) for r in calm if r.ok)),
        "wall_s": round(wall_s, 2),
        "load_avg_1m": round(load_avg, 2),
        "error_samples": sorted({r.error for r in hit if r.error})[:3],
    }


def _client_id(engine_id: str, tag: str) -> str:
    """The body's `request_id` (`{tag}-{i}`) in an engine request id like
    `cmpl-{tag}-{i}-{hex}`."""
    head = engine_id.rsplit("-", 1)[0]
    return head[head.find(tag) :] if tag in head else head


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prefills", type=int, default=1)
    parser.add_argument("--decodes", type=int, default=2)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--kill-after-tokens", type=int, default=16)
    parser.add_argument("--migration-limit", type=int, default=DEFAULT_MIGRATION_LIMIT)
    parser.add_argument("--out", type=Path, default=None, help="folder for results.json")
    args = parser.parse_args(argv)
    with embedded_ray(args.prefills + args.decodes + 1):
        rows = [run_one(args, limit) for limit in (0, args.migration_limit)]
    off, on = rows
    for row in rows:
        print(json.dumps(row))
    print(
        f"errors: {off['errors']}/{off['streams']} with migration off, {on['errors']}/"
        f"{on['streams']} on; moved streams: stall p50 {on['stall_ms_p50']} ms = "
        f"{(on['stall_ms_p50'] or 0) / on['calm_ttft_ms_p50']:.2f} x the undisturbed p50 TTFT"
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
