"""Driving a request's sequences on the cluster: their outputs accumulated into results and
their metrics recorded; a client that goes away, or a sequence that fails, aborts the rest."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

from fastapi import Request

from pdcluster.cluster.api.cluster_client import ClusterClient
from pdcluster.cluster.api.errors import RETRY_AFTER_S, APIError
from pdcluster.cluster.api.metrics import GatewayMetrics
from pdcluster.cluster.api.results import Group, Result
from pdcluster.engine.outputs import EngineCoreOutput, coalesce
from pdcluster.engine.request import Request as EngineRequest

DISCONNECT_POLL_S = 0.1


class GroupRunner:
    """Runs groups of sequences (`ClusterClient.stream_group`) for one gateway replica.
    `stream_interval`: the tokens a sequence gathers before its next output goes on (its
    first and its last go at once); 1 passes each output on as it comes."""

    def __init__(
        self, cluster: ClusterClient, metrics: GatewayMetrics, stream_interval: int = 1
    ) -> None:
        self.cluster = cluster
        self.metrics = metrics
        self.stream_interval = stream_interval

    async def _outputs(self, group: Group) -> AsyncGenerator[tuple[Result, EngineCoreOutput], None]:
        """Drive one prompt's sequences, accumulating their results and recording their
        metrics (also when the client goes away: closing or cancelling this aborts the
        unfinished ones and counts them as aborted)."""
        timers = [self.metrics.start(r.num_prompt_tokens) for r in group.requests]
        try:
            source = (
                self._gathered(group.requests)
                if self.stream_interval > 1
                else self.cluster.stream_group(group.requests)
            )
            async with contextlib.aclosing(source) as outputs:
                async for i, out in outputs:
                    result = group.results[i]
                    timers[i].observe(out)
                    result.text += out.new_text
                    result.token_ids += out.new_token_ids
                    result.logprobs += out.new_logprobs or []
                    result.top_logprobs += out.new_top_logprobs or []
                    result.num_cached_tokens = max(result.num_cached_tokens, out.num_cached_tokens)

                    result.prompt_logprobs = out.prompt_logprobs or result.prompt_logprobs
                    if out.finished:
                        result.finish_reason, result.error = out.finish_reason, out.error
                        result.unavailable = out.unavailable
                    yield result, out
        finally:
            for timer, result in zip(timers, group.results):
                timer.finish(result.finish_reason)

    async def _gathered(
        self, requests: list[EngineRequest]
    ) -> AsyncGenerator[tuple[int, EngineCoreOutput], None]:
        """The cluster's outputs of `requests`, each sequence's gathered to `stream_interval`
        tokens (after its first output) into one."""
        interval = self.stream_interval  # > 1
        gathering: dict[int, list[EngineCoreOutput]] = {}  # by sequence: outputs held back
        started: set[int] = set()  # sequences whose first output went on
        async with contextlib.aclosing(self.cluster.stream_group(requests)) as outputs:
            async for i, out in outputs:
                if i in started:
                    held = gathering.setdefault(i, [])
                    held.append(out)
                    if not out.finished and sum(len(o.new_token_ids) for o in held) < interval:
                        continue
                    (out,) = coalesce(gathering.pop(i))
                started.add(i)
                yield i, out

    async def run_to_end(self, http: Request, groups: list[Group]) -> None:
        """Non-streaming: every sequence at once, into its result. A client that disconnects,
        or a sequence that fails, aborts the others."""

        async def drain() -> None:
            async with contextlib.aclosing(self.merged(groups)) as outputs:
                async for result, out in outputs:
                    if out.finish_reason == "error":
                        raise _failure(result)

        work = asyncio.ensure_future(drain())
        watch = asyncio.ensure_future(_wait_disconnect(http))
        try:
            done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                work.cancel()
                raise APIError(499, "client closed the request", "client_closed")
        finally:
            watch.cancel()
        work.result()

    async def merged(
        self, groups: list[Group]
    ) -> AsyncGenerator[tuple[Result, EngineCoreOutput], None]:
        """Outputs of several prompts' sequences as they arrive (closing this aborts all)."""
        if len(groups) == 1:  # no task and queue hop between the cluster and the client
            async with contextlib.aclosing(self._outputs(groups[0])) as outputs:
                async for item in outputs:
                    yield item
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(group: Group) -> None:
            async with contextlib.aclosing(self._outputs(group)) as outputs:
                async for item in outputs:
                    queue.put_nowait(item)

        tasks = [asyncio.ensure_future(pump(group)) for group in groups]
        remaining = sum(len(g.results) for g in groups)
        try:
            while remaining:
                result, out = await queue.get()
                remaining -= out.finished
                yield result, out
        finally:
            for task in tasks:
                task.cancel()


def _failure(result: Result) -> APIError:
    """A non-streamed request's error: 503 when it lost its instance (a retry may succeed)."""
    if result.unavailable:
        return APIError(
            503, result.error or "no instance could serve the request", "unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )  # fmt: skip
    return APIError(500, result.error or "the request failed", "request_failed")


async def _wait_disconnect(http: Request) -> None:
    while not await http.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)
