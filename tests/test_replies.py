"""`Replies` (actors/replies.py): Ray call results on one event loop, as `await ref` gives
them: values in any number at once, the task's own error, a dead actor's error, and a slow
result still delivered after its waiter gave up waiting on it for a while."""

from __future__ import annotations

import asyncio
import os

import pytest
import ray

from pdcluster.actors.replies import Replies


class Echo:
    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def echo(self, value: int) -> int:
        return value

    async def after_gate(self, value: int) -> int:
        await self.gate.wait()
        return value

    async def open_gate(self) -> None:
        self.gate.set()

    async def fail(self) -> None:
        raise ValueError("bad input")

    def die(self) -> None:
        os._exit(1)  # the process ends during the call: the caller gets RayActorError


def test_results_and_errors_arrive_as_await_ref_gives_them(ray_session):
    echo = ray.remote(Echo).options(max_concurrency=1000).remote()

    async def scenario() -> tuple[list[int], int]:
        replies = Replies(asyncio.get_running_loop())
        refs = [echo.echo.remote(i) for i in range(200)]  # many land in one wakeup
        values = await asyncio.gather(*(replies.future(ref) for ref in refs))
        with pytest.raises(ValueError, match="bad input"):
            ref = echo.fail.remote()
            await replies.future(ref)
        slow_ref = echo.after_gate.remote(7)
        slow = replies.future(slow_ref)
        with pytest.raises(asyncio.TimeoutError):  # a waiter that stops waiting a while
            await asyncio.wait_for(asyncio.shield(slow), 0.05)
        await echo.open_gate.remote()
        late = await slow  # ... still gets the result
        with pytest.raises(ray.exceptions.RayActorError):  # (a call after ray.kill may
            ref = echo.die.remote()  # still reach the process before it is gone)
            await replies.future(ref)
        return values, late

    values, late = asyncio.run(scenario())
    assert values == list(range(200)) and late == 7
