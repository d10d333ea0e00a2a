"""The gateway's GroupRunner without Ray: a fake cluster's outputs, gathered to the gateway's
`stream_interval` and accumulated into results."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdcluster.cluster.api.metrics import GatewayMetrics
from pdcluster.cluster.api.results import Group, Result
from pdcluster.cluster.api.runner import GroupRunner
from pdcluster.engine.outputs import EngineCoreOutput


class FakeCluster:
    """Streams the (sequence index, output) pairs it is given, whatever the requests."""

    def __init__(self, outputs: list[tuple[int, EngineCoreOutput]]) -> None:
        self.outputs = outputs

    async def stream_group(self, requests):
        for item in self.outputs:
            yield item


def tokens(i: int, rid: str, ids: list[int], finish: str | None = None):
    return i, EngineCoreOutput(rid, ids, new_text="".join(f"<{t}>" for t in ids),
                               finish_reason=finish)  # fmt: skip


def run(interval: int, outputs) -> tuple[list[tuple[int, list[int]]], list[Result]]:
    runner = GroupRunner(FakeCluster(outputs), GatewayMetrics("m", 64), interval)
    results = [Result(0, 0, 3), Result(1, 0, 3)]
    requests = [SimpleNamespace(num_prompt_tokens=3)] * 2

    async def collect():
        return [
            (r.index, o.new_token_ids) async for r, o in runner.merged([Group(requests, results)])
        ]

    return asyncio.run(collect()), results


OUTPUTS = [
    tokens(0, "a", [1]), tokens(1, "b", [10]), tokens(0, "a", [2]), tokens(0, "a", [3]),
    tokens(1, "b", [11]), tokens(0, "a", [4]), tokens(0, "a", [5]), tokens(0, "a", [6], "length"),
    tokens(1, "b", [12, 13], "stop"),
]  # fmt: skip


@pytest.mark.parametrize("interval", [1, 2, 3, 64])
def test_stream_interval_gathers_tokens_after_the_first_and_loses_none(interval):
    sent, results = run(interval, OUTPUTS)
    a = [ids for i, ids in sent if i == 0]
    b = [ids for i, ids in sent if i == 1]
    assert a[0] == [1] and b[0] == [10]  # a sequence's first output goes at once
    expected_a = {1: [[1], [2], [3], [4], [5], [6]], 2: [[1], [2, 3], [4, 5], [6]],
                  3: [[1], [2, 3, 4], [5, 6]], 64: [[1], [2, 3, 4, 5, 6]]}  # fmt: skip
    assert a == expected_a[interval]
    assert [t for ids in b for t in ids] == [10, 11, 12, 13]
    assert results[0].token_ids == [1, 2, 3, 4, 5, 6] and results[0].finish_reason == "length"
    assert results[0].text == "<1><2><3><4><5><6>"
    assert results[1].token_ids == [10, 11, 12, 13] and results[1].finish_reason == "stop"
