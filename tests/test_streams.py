"""OutputStreams (the pull protocol between client, router and instances), without Ray."""

from __future__ import annotations

import asyncio

import pytest

from actors.streams import OutputStreams, reap_orphans
from engine.outputs import EngineCoreOutput


def out(rid: str, token: int, finish: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(rid, [token], finish_reason=finish)


def test_a_pull_takes_everything_queued_and_the_last_one_closes_the_stream():
    async def scenario():
        streams = OutputStreams(idle_timeout_s=60)
        streams.open("a")
        streams.put(out("a", 1))
        streams.put(out("a", 2))
        first = await streams.next_batch("a")
        streams.put(out("a", 3, "length"))
        last = await streams.next_batch("a")
        return first, last, "a" in streams

    first, last, still_open = asyncio.run(scenario())
    assert [o.new_token_ids for o in first] == [[1], [2]]
    assert last[-1].finish_reason == "length"
    assert not still_open


def test_a_pull_waits_for_output_and_close_wakes_it_with_an_abort():
    async def scenario():
        streams = OutputStreams(idle_timeout_s=60)
        streams.open("a")
        pull = asyncio.ensure_future(streams.next_batch("a"))
        await asyncio.sleep(0.01)
        assert not pull.done()
        streams.close("a")
        streams.put(out("a", 1))  # after the close: dropped
        return await pull, len(streams)

    batch, num_open = asyncio.run(scenario())
    assert [o.finish_reason for o in batch] == ["abort"]
    assert num_open == 0


def test_unknown_streams_read_as_aborted_and_ids_are_unique():
    async def scenario():
        streams = OutputStreams(idle_timeout_s=60)
        streams.open("a")
        with pytest.raises(ValueError, match="already in use"):
            streams.open("a")
        return await streams.next_batch("nope")

    assert asyncio.run(scenario())[0].finish_reason == "abort"


def test_an_abort_that_overtakes_its_start_is_remembered_once():
    streams = OutputStreams(idle_timeout_s=60)
    streams.close("early")
    assert streams.aborted_before_start("early")
    assert not streams.aborted_before_start("early")
    assert not streams.aborted_before_start("other")


def test_streams_nobody_pulls_are_reaped_but_a_waiting_pull_keeps_one_alive():
    async def scenario():
        streams = OutputStreams(idle_timeout_s=0.05)
        streams.open("orphan")
        streams.open("read")
        pull = asyncio.ensure_future(streams.next_batch("read"))
        aborted: list[str] = []

        def abort(ids: list[str]) -> None:
            aborted.extend(ids)
            for rid in ids:
                streams.close(rid)

        reaper = asyncio.ensure_future(reap_orphans(streams, abort))
        await asyncio.sleep(0.3)
        reaper.cancel()
        pull.cancel()
        return aborted, "read" in streams

    aborted, read_open = asyncio.run(scenario())
    assert aborted == ["orphan"]
    assert read_open
