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

    python -m pdcluster.benchmarks.migration --model smollm2-135m --prefills 1 --decodes 2 \\
        --streams 32 --max-tokens 128 --out migration-out

With `--url` and `--address` it measures a cluster served from outside instead (`ray start
--head`, then `pdcluster serve --address`): this process streams to the gateway at `--url`
and, as a separate Ray driver of that cluster, kills the decode instance the gateway's
`/v1/cluster` shows running the most streams; moved streams are counted from the gateway's
`pdcluster_request_migrations_total`. One round, at the server's own `migration_limit`:

    python -m pdcluster.benchmarks.migration --url http://127.0.0.1:8000 --address 127.0.0.1:6379
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdcluster.actors.messages import InstanceStats
from pdcluster.benchmarks.client import PreparedRequest, RequestResult, make_client, stream_one
from pdcluster.benchmarks.report import save_results
from pdcluster.benchmarks.targets import embedded_ray, pd_config, serve_in_thread
from pdcluster.benchmarks.workload import RequestSpec
from pdcluster.cluster.config import RaySettings
from pdcluster.routing.policy import DEFAULT_MIGRATION_LIMIT

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
    url: str,
    requests: list[PreparedRequest],
    kill: Callable[[], str] | None = None,
    kill_after: int = 0,
) -> tuple[list[RequestResult], str | None]:
    """Every request at once; with `kill`, it is called (it kills an instance and names it)
    once every stream has `kill_after` chunks. Returns the results and the killed instance."""
    results = [RequestResult(r.spec) for r in requests]
    killed = None
    async with make_client() as client:
        tasks = [asyncio.ensure_future(stream_one(client, url, r, res))
                 for r, res in zip(requests, results)]  # fmt: skip
        if kill is not None:
            while not all(r.ttft_s is not None and len(r.itl_s) + 1 >= kill_after
                          for r in results):  # fmt: skip
                if all(t.done() for t in tasks):
                    raise RuntimeError("the streams ended before the kill; raise --max-tokens")
                await asyncio.sleep(0.01)
            killed = await asyncio.get_running_loop().run_in_executor(None, kill)
        await asyncio.gather(*tasks)
    return results, killed


def kill_busiest(stats: list[InstanceStats], namespace: str | None = None) -> str:
    """`ray.kill` (Ray restarts it) the healthy decode instance running the most requests."""
    import ray

    decodes = [s for s in stats if s.role == "decode" and s.healthy]
    victim = max(decodes, key=lambda s: s.scheduler.num_running).instance_id
    ray.kill(ray.get_actor(victim, namespace=namespace), no_restart=False)
    return victim


def run_one(args: argparse.Namespace, limit: int) -> dict[str, Any]:
    from pdcluster.cluster.control.launch import launch
    from pdcluster.cluster.replicas import gateway_app

    config = pd_config(args, ENGINE, router={"migration_limit": limit})
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
            kill = lambda: kill_busiest(cluster.stats())  # noqa: E731
            hit, killed = asyncio.run(stream_all(url, requests, kill, args.kill_after_tokens))
            wall_s = time.perf_counter() - started
            moves = {_client_id(t.request_id, tag): t.num_moves for t in cluster.front.traces()}
    finally:
        cluster.shutdown()
    moved = [i for i in range(len(hit)) if moves.get(f"{tag}-{i}", 0) > 0]
    return summarize(limit, calm, hit, moved, killed, wall_s, load_avg)


def run_outside(args: argparse.Namespace) -> dict[str, Any]:
    """One round against a gateway and cluster started elsewhere (see the module doc)."""
    import httpx
    import ray

    from pdcluster.cluster.control.launch import init_ray

    init_ray(RaySettings(address=args.address, namespace=args.namespace))  # token auth too
    url = args.url.rstrip("/")
    with httpx.Client(timeout=30) as http:
        name = http.get(f"{url}/v1/models").raise_for_status().json()["data"][0]["id"]

        def view() -> list[dict[str, Any]]:
            return http.get(f"{url}/v1/cluster").raise_for_status().json()["instances"]

        calm, _ = asyncio.run(
            stream_all(url, prepared(args.streams, args.max_tokens, name, "calm"))
        )
        wait_idle(view)
        moves_before = migrations(http.get(f"{url}/metrics").text)
        load_avg = os.getloadavg()[0]
        started = time.perf_counter()
        requests = prepared(args.streams, args.max_tokens, name, "hit")
        kill = lambda: kill_busiest(view(), args.namespace)  # noqa: E731
        hit, killed = asyncio.run(stream_all(url, requests, kill, args.kill_after_tokens))
        wall_s = time.perf_counter() - started
        wait_idle(view)
        num_moved = migrations(http.get(f"{url}/metrics").text) - moves_before
    ray.shutdown()
    row = summarize(None, calm, hit, None, killed, wall_s, load_avg)  # the server's limit
    row["migrations"] = num_moved  # moves, from the gateway's counter (a stream may move twice)
    return row


def wait_idle(view: Callable[[], list[dict[str, Any]]]) -> None:
    """Until every healthy instance the gateway shows runs nothing and has all blocks free."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while time.monotonic() < deadline:
        busy = [v for v in view() if v["healthy"] and (
            v["num_running"] or v["num_waiting"] or v["num_blocks_free"] != v["num_blocks_total"]
        )]  # fmt: skip
        if not busy:
            return
        time.sleep(0.2)
    raise TimeoutError(f"instances still busy after {IDLE_TIMEOUT_S} s: {busy}")


def migrations(exposition: str) -> int:
    """pdcluster_request_migrations_total in a /metrics exposition."""
    for line in exposition.splitlines():
        if line.startswith("pdcluster_request_migrations_total"):
            return int(float(line.split()[-1]))
    raise ValueError("the gateway exports no pdcluster_request_migrations_total")


def summarize(
    limit: int | None,
    calm: list[RequestResult],
    hit: list[RequestResult],
    moved: list[int] | None,
    killed: str | None,
    wall_s: float,
    load_avg: float,
) -> dict[str, Any]:
    """`moved`: indices of the streams that moved (None: not known per stream; the stall
    columns then take every stream of the round)."""
    per_stream = moved if moved is not None else range(len(hit))
    extra = [hit[i].e2e_s - calm[i].e2e_s for i in per_stream if hit[i].ok]
    stalls = [max(hit[i].itl_s, default=0.0) for i in per_stream if hit[i].ok]
    calm_ttft = statistics.median(r.ttft_s for r in calm if r.ok)
    complete = [r for r in hit if r.ok and r.num_output_tokens == r.spec.output_len]
    return {
        "migration_limit": limit,
        "killed": killed,
        "streams": len(hit),
        "errors": sum(r.error is not None for r in hit),
        "complete": len(complete),
        "moved": len(moved) if moved is not None else None,
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
    parser.add_argument("--url", help="a gateway served from outside (with --address)")
    parser.add_argument("--address", help="the Ray cluster behind --url, to kill an instance")
    parser.add_argument("--namespace", default=RaySettings.model_fields["namespace"].default)
    args = parser.parse_args(argv)
    if bool(args.url) != bool(args.address):
        parser.error("--url and --address go together")
    if args.url:
        rows = [run_outside(args)]
        print(json.dumps(rows[0]))
        print(
            f"errors: {rows[0]['errors']}/{rows[0]['streams']}; migrations: {rows[0]['migrations']}"
        )
    else:
        with embedded_ray(args.prefills + args.decodes + 1):
            rows = [run_one(args, limit) for limit in (0, args.migration_limit)]
        report(rows)
    save_results(args.out, rows)
    return 0


def report(rows: list[dict[str, Any]]) -> None:
    off, on = rows
    for row in rows:
        print(json.dumps(row))
    print(
        f"errors: {off['errors']}/{off['streams']} with migration off, {on['errors']}/"
        f"{on['streams']} on; moved streams: stall p50 {on['stall_ms_p50']} ms = "
        f"{(on['stall_ms_p50'] or 0) / on['calm_ttft_ms_p50']:.2f} x the undisturbed p50 TTFT"
    )


if __name__ == "__main__":
    raise SystemExit(main())
