"""Open-loop load client: sends each request at its arrival time and streams the answer.
With `max_concurrency`, as in `vllm bench serve`, a request that arrives while that many are
in flight waits for one to finish (the arrival schedule is kept; the sent rate may fall).

asyncio + httpx against an OpenAI-compatible gateway. Per request it records the time to
the first streamed token (TTFT), the gaps between streamed chunks (ITL), the end-to-end
latency and the exact output token count (from the usage chunk). A run stops itself at
`max_run_s`: requests not yet answered then are cancelled (which aborts them server-side)
and counted as errors.

`ClientProcess` sends requests one at a time from a separate process, over one keep-alive
connection: what a real client does, and no competition for the GIL of a gateway served in
the calling process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

import httpx
from tqdm import tqdm

from pdcluster.benchmarks.workload import RequestSpec


@dataclass(frozen=True)
class PreparedRequest:
    spec: RequestSpec
    path: str  # API path, e.g. /v1/completions
    body: dict[str, Any]


@dataclass
class RequestResult:
    spec: RequestSpec
    send_s: float = 0.0  # since the run started
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        """(e2e - ttft) / (n - 1): None for failed or single-token requests."""
        if not self.ok or self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "arrival_s": self.spec.arrival_s,
            "send_s": self.send_s,
            "prompt_len": self.spec.prompt_len,
            "output_len": self.spec.output_len,
            "has_image": self.spec.has_image,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "ttft_ms": _ms(self.ttft_s),
            "tpot_ms": _ms(self.tpot_s),
            "e2e_ms": _ms(self.e2e_s),
            "itl_ms": [round(x * 1e3, 3) for x in self.itl_s],
            "error": self.error,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


@dataclass
class RunOutcome:
    results: list[RequestResult]
    duration_s: float  # first send to last answer (or the deadline)


def make_client(api_key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    return httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(None))


async def stream_one(
    client: httpx.AsyncClient, url: str, request: PreparedRequest, result: RequestResult
) -> RequestResult:
    """Send one streaming request, filling `result` as chunks arrive."""
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url + request.path, json=request.body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if _on_chunk(json.loads(line[6:]), result):
                    if result.ttft_s is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
        result.e2e_s = time.perf_counter() - start
        if result.error is None and result.num_output_tokens == 0:
            result.error = "no usage chunk (output token count unknown)"
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    except asyncio.CancelledError:
        result.error = "cancelled at the run's deadline"
    return result


def _on_chunk(chunk: dict[str, Any], result: RequestResult) -> bool:
    """Record usage and errors; True when the chunk carries generated output."""
    usage = chunk.get("usage")
    if usage:
        result.num_output_tokens = usage["completion_tokens"]
        result.num_prompt_tokens = usage["prompt_tokens"]
    carries = False
    for choice in chunk.get("choices", []):
        if choice.get("finish_reason") == "error":
            result.error = choice.get("error") or "the request failed"
        delta = choice.get("delta")
        if delta is not None and "role" in delta:
            continue  # chat's opening chunk: no token yet
        carries = True  # one chunk per output: a token or those that came together
    return carries


async def run_load(
    url: str,
    requests: list[PreparedRequest],
    max_run_s: float,
    api_key: str | None = None,
    desc: str = "",
    max_concurrency: int | None = None,
) -> RunOutcome:
    """Open loop: request i is sent at its arrival time whatever the others are doing, or,
    with `max_concurrency`, at its arrival time or when a slot frees, whichever is later."""
    results = [RequestResult(r.spec) for r in requests]
    bar = tqdm(total=len(requests), desc=desc, unit="req", leave=False, dynamic_ncols=True)
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    async with make_client(api_key) as client:
        start = time.perf_counter()
        deadline = start + max_run_s
        tasks = []
        for request, result in zip(requests, results):
            delay = start + request.spec.arrival_s - time.perf_counter()
            if time.perf_counter() + max(delay, 0) >= deadline:
                break
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(_send(client, url, request, result, start, slots))
            task.add_done_callback(lambda _: bar.update(1))
            tasks.append(task)
        for result in results[len(tasks) :]:
            result.error = "not sent before the run's deadline"
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - time.perf_counter()))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        duration = time.perf_counter() - start
    bar.close()
    return RunOutcome(results, duration)


async def _send(
    client: httpx.AsyncClient,
    url: str,
    request: PreparedRequest,
    result: RequestResult,
    start: float,
    slots: asyncio.Semaphore | None,
) -> RequestResult:
    """Stream one request once a concurrency slot is free (at once without `slots`);
    `send_s` is when it goes out."""
    if slots is None:
        result.send_s = time.perf_counter() - start
        return await stream_one(client, url, request, result)
    try:
        async with slots:
            result.send_s = time.perf_counter() - start
            return await stream_one(client, url, request, result)
    except asyncio.CancelledError:  # still waiting for a slot at the run's deadline
        result.error = "cancelled at the run's deadline, waiting for a --max-concurrency slot"
        return result


class ClientProcess:
    """Streaming requests sent one at a time by a child process (spawned: the caller may run
    Ray and threads) over one keep-alive connection, opened before the first request."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_client_process_main, args=(child, url, api_key), daemon=True
        )
        self._process.start()
        child.close()
        try:
            error = self._receive()
        except BaseException:
            self.close()
            raise
        if error is not None:
            self.close()
            raise RuntimeError(f"the client process cannot reach {url}: {error}")

    def send(self, request: PreparedRequest) -> RequestResult:
        """Stream one request to its end; its timings are taken in the child process."""
        self._conn.send(request)
        return self._receive()

    def _receive(self) -> Any:
        if not self._conn.poll(self.timeout_s):
            raise TimeoutError(f"the client process did not answer in {self.timeout_s} s")
        return self._conn.recv()

    def close(self) -> None:
        if self._process.is_alive():
            with contextlib.suppress(OSError):  # it may be exiting already
                self._conn.send(None)
            self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    def __enter__(self) -> ClientProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _client_process_main(conn: Connection, url: str, api_key: str | None) -> None:
    asyncio.run(_client_process_loop(conn, url, api_key))


async def _client_process_loop(conn: Connection, url: str, api_key: str | None) -> None:
    """Answer None (or the error) once connected; then one RequestResult per request, until
    None. Waiting on the pipe blocks this process's only loop, which has nothing else to do."""
    async with make_client(api_key) as client:
        try:
            (await client.get(f"{url}/v1/models")).raise_for_status()
        except httpx.HTTPError as exc:
            conn.send(f"{type(exc).__name__}: {exc}")
            return
        conn.send(None)
        while (request := conn.recv()) is not None:
            conn.send(await stream_one(client, url, request, RequestResult(request.spec)))
