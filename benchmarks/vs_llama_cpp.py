"""pdcluster against llama.cpp's `llama-server` on the same GGUF, one server up at a time.

Streaming loads, the same token counts on both servers (every answer exactly as long as the
load says, with `ignore_eos`). Three `/v1/completions` loads of repeated words of the model's
own tokenizer:

- one: 1 stream, a short prompt, 64 tokens (--one-requests requests one after another);
- many: 32 streams at once, short prompts, 128 tokens;
- prefill: 16 streams at once, ~480-token prompts, 64 tokens;

and two `/v1/chat/completions` loads of one stream, --one-requests requests one after another,
--task-tokens tokens each, the tasks of `benchmarks.spec_decode` (where speculative decoding
is measured: give a pdcluster variant `--speculative-config`):

- annotate: return a short Python file with comments added (the answer repeats its input);
- chat: explain something in free text.

Each server is started, warmed up with one request, runs every load, and is stopped before the
next starts (each server may use both cores). Printed per load: output tokens/s, mean
inter-token latency, and pdcluster ÷ llama.cpp. Without --llama-server only pdcluster runs.

    python -m pdcluster.benchmarks.vs_llama_cpp --llama-server /work/peer/llama-server \\
        [--model smollm2-135m] [--quantization int8] [--loads one,many,prefill] \\
        [--variant "--num-threads 2" ...]

Each `--variant` is one more pdcluster server, with those serve flags added (one server
after the other, every one under the same loads).

llama.cpp runs as `llama-server -m FILE -t THREADS -np N --cont-batching -c CTX`; pdcluster as
`pdcluster serve --model MODEL --prefills 1 --decodes 1`. llama.cpp is never a dependency:
build it yourself and pass its path.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pdcluster.benchmarks.report import loadavg
from pdcluster.benchmarks.spec_decode import task
from pdcluster.engine.config import DEFAULT_QUANTIZATION, QUANTIZATIONS
from pdcluster.engine.presets import PACKAGED_MODELS, packaged_model_file, resolve_model_dir
from pdcluster.engine.tokenizer import Tokenizer

NO_KEEPALIVE = httpx.Limits(max_connections=None, max_keepalive_connections=0)
READY_TIMEOUT_S = 600.0  # a server that answers no /v1/models by then failed to start
WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "ran", "to", "see", "big", "red", "sun")


@dataclass(frozen=True)
class Load:
    name: str
    num_streams: int  # requests in flight at once
    num_requests: int
    prompt_len: int  # tokens (a chat task's prompt is the task's)
    output_len: int
    task: str | None = None  # a chat task of benchmarks.spec_decode


@dataclass(frozen=True)
class LoadResult:
    tokens_per_s: float
    mean_itl_ms: float  # between chunks that carry text
    num_tokens: int  # the usage chunks' output tokens (text chunks where a server sends none)


def make_loads(args: argparse.Namespace) -> dict[str, Load]:
    return {
        "one": Load("one", 1, args.one_requests, 8, 64),
        "many": Load("many", 32, 32, 8, 128),
        "prefill": Load("prefill", 16, 16, 480, 64),
        "annotate": Load("annotate", 1, args.one_requests, 0, args.task_tokens, "annotate"),
        "chat": Load("chat", 1, args.one_requests, 0, args.task_tokens, "explain"),
    }


def make_prompts(tokenizer: Tokenizer, load: Load, seed: int) -> list[str | list[dict]]:
    """Texts of exactly `load.prompt_len` tokens (words chosen so that each is one token), or
    a chat task's messages, each request numbered."""
    if load.task is not None:
        return [task(load.task, i) for i in range(load.num_requests)]
    rng = random.Random(seed)
    words = [w for w in WORDS if len(tokenizer.encode(" " + w)) == 1]
    return [
        "".join(" " + rng.choice(words) for _ in range(load.prompt_len))
        for _ in range(load.num_requests)
    ]


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> tuple[list[float], int | None]:
    """Stream one completion (a chat completion when `body` has messages): the arrival time
    of each chunk that carries text, and the output token count of the usage chunk (None
    when the server sends none)."""
    arrivals, num_tokens = [], None
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with client.stream("POST", url + path, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices", [])
            if any(c.get("text") or c.get("delta", {}).get("content") for c in choices):
                arrivals.append(time.perf_counter())
    return arrivals, num_tokens


async def run_load(
    url: str, model: str, load: Load, prompts: list[str] | list[list[dict]]
) -> LoadResult:
    """Send `load`'s requests, `num_streams` at a time; tokens/s over the whole load."""
    slots = asyncio.Semaphore(load.num_streams)
    gaps: list[float] = []
    num_tokens = 0

    async def one(client: httpx.AsyncClient, prompt: str | list[dict]) -> None:
        nonlocal num_tokens
        body = {
            "model": model, "max_tokens": load.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "messages" if load.task else "prompt": prompt,
        }  # fmt: skip
        async with slots:
            arrivals, counted = await _stream(client, url, body)
        num_tokens += len(arrivals) if counted is None else counted
        gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:]))

    # A new connection per request: llama-server's HTTP library drops an idle kept-alive one
    # as the next request goes out ("Server disconnected"); on loopback that costs ~0.1 ms.
    async with httpx.AsyncClient(timeout=None, limits=NO_KEEPALIVE) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, p) for p in prompts))
        seconds = time.perf_counter() - start
    return LoadResult(num_tokens / seconds, statistics.fmean(gaps) * 1e3, num_tokens)


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    """Until the server lists its models (or exits, or READY_TIMEOUT_S passes)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)  # polling a server that is still loading
    raise TimeoutError(f"no answer from {url} in {READY_TIMEOUT_S:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # pdcluster serve stops its Ray on Ctrl-C
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def server_commands(args: argparse.Namespace, gguf: Path) -> dict[str, list[str]]:
    max_streams = max(load.num_streams for load in make_loads(args).values())
    serve = [
        sys.executable, "-m", "pdcluster.cluster", "serve", "--model", args.model, "--prefills", "1",
        "--decodes", "1", "--port", str(args.port), "--quantization", args.quantization,
    ]  # fmt: skip
    commands = {
        " ".join(["pdcluster", *variant]): serve + variant
        for variant in [[], *(shlex.split(v) for v in args.variant)]
    }
    if args.llama_server:
        commands["llama.cpp"] = [
            args.llama_server, "-m", str(gguf), "-t", str(args.threads), "-np", str(max_streams),
            "--cont-batching", "-c", str(max_streams * 640), "--port", str(args.port),
            "--host", "127.0.0.1",
        ]  # fmt: skip
    return commands


def bench_server(
    name: str, command: list[str], args: argparse.Namespace, prompts: dict[str, list[str]]
) -> dict[str, LoadResult]:
    url = f"http://127.0.0.1:{args.port}"
    print(f"== {name}: {' '.join(command)}", flush=True)
    log_path = Path(
        f"/tmp/vs_llama_cpp-{'_'.join(name.split())}.log"
    )  # the server's output, for a failure
    print(f"   (its output: {log_path})", flush=True)
    log = log_path.open("wb")
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc)
        loads = make_loads(args)
        first = next(iter(prompts))
        warm = dataclasses.replace(loads[first], num_streams=1, num_requests=1, output_len=8)
        asyncio.run(run_load(url, args.model, warm, prompts[first][:1]))
        results = {}
        for load_name in args.loads:
            result = asyncio.run(run_load(url, args.model, loads[load_name], prompts[load_name]))
            results[load_name] = result
            print(
                f"  {load_name}: {result.tokens_per_s:.1f} tok/s, ITL {result.mean_itl_ms:.1f} ms "
                f"({result.num_tokens} tokens), load average {loadavg()}",
                flush=True,
            )
        return results
    finally:
        stop(proc)
        log.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", help="path of a llama.cpp llama-server binary")
    p.add_argument("--model", default="smollm2-135m", choices=sorted(PACKAGED_MODELS))
    p.add_argument("--quantization", choices=QUANTIZATIONS, default=DEFAULT_QUANTIZATION)
    p.add_argument(
        "--loads", type=lambda s: s.split(","), default=["one", "many", "prefill"],
        help="comma list of one, many, prefill, annotate, chat",
    )  # fmt: skip
    p.add_argument("--task-tokens", type=int, default=256, help="tokens per chat-task answer")
    p.add_argument(
        "--variant", action="append", default=[],
        help="serve flags of one more pdcluster server (repeatable)",
    )  # fmt: skip
    p.add_argument("--one-requests", type=int, default=3, help="requests of the 'one' load")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's -t")
    p.add_argument("--port", type=int, default=8731)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gguf = packaged_model_file(args.model)
    tokenizer = Tokenizer(resolve_model_dir(args.model))
    loads = make_loads(args)
    prompts = {name: make_prompts(tokenizer, loads[name], args.seed) for name in args.loads}
    print(f"load average at start {loadavg()}, {os.cpu_count()} CPUs", flush=True)
    results = {
        name: bench_server(name, command, args, prompts)
        for name, command in server_commands(args, gguf).items()
    }
    theirs = results.pop("llama.cpp", None)
    for name, ours in results.items() if theirs else ():
        print(f"{name} ÷ llama.cpp (tokens/s):")
        for load_name in args.loads:
            ratio = ours[load_name].tokens_per_s / theirs[load_name].tokens_per_s
            print(f"  {load_name}: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
