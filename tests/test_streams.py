"""Outboxes (the pull protocol between gateway replicas and instances) and the KV event log
that replicas read, without Ray."""

from __future__ import annotations

import asyncio

import pytest

from pdcluster.actors.kv_events import KVEventLog
from pdcluster.actors.streams import Outboxes, reap_orphans
from pdcluster.engine.outputs import EngineCoreOutput


def out(rid: str, token: int, finish: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(rid, [token], finish_reason=finish)


def test_one_pull_takes_every_output_of_the_consumers_requests_and_only_theirs():
    async def scenario():
        boxes = Outboxes(idle_timeout_s=60)
        boxes.open("a", "replica-1")
        boxes.open("b", "replica-1")
        boxes.open("c", "replica-2")
        boxes.put(out("a", 1))
        boxes.put(out("c", 7))
        boxes.put(out("b", 2, "length"))
        first = await boxes.pull("replica-1", wait_s=1)
        return first, await boxes.pull("replica-2", wait_s=1), len(boxes)

    first, second, num_open = asyncio.run(scenario())
    assert [(o.request_id, o.new_token_ids) for o in first] == [("a", [1]), ("b", [2])]
    assert [o.request_id for o in second] == ["c"]
    assert num_open == 2  # "b" finished; "a" and "c" still open


def test_a_requests_steps_since_the_last_pull_come_as_one_output():
    async def scenario():
        boxes = Outboxes(idle_timeout_s=60)
        boxes.open("a", "r")
        boxes.open("b", "r")
        boxes.put(EngineCoreOutput("a", [1], [-0.5], new_text="x", queue_time_s=0.2))
        boxes.put(out("b", 9))
        boxes.put(EngineCoreOutput("a", [2], [-0.25], new_text="y"))
        boxes.put(EngineCoreOutput("a", [3], [-1.0], new_text="z", finish_reason="stop"))
        return await boxes.pull("r", wait_s=1), len(boxes)

    (a, b), num_open = asyncio.run(scenario())
    assert (a.request_id, a.new_token_ids, a.new_logprobs) == ("a", [1, 2, 3], [-0.5, -0.25, -1.0])
    assert (a.new_text, a.finish_reason, a.queue_time_s) == ("xyz", "stop", 0.2)
    assert (b.request_id, b.new_token_ids, b.finished) == ("b", [9], False)
    assert num_open == 1


def test_a_pull_waits_for_output_and_returns_empty_after_its_wait():
    async def scenario():
        boxes = Outboxes(idle_timeout_s=60)
        boxes.open("a", "r")
        empty = await boxes.pull("r", wait_s=0.01)
        pull = asyncio.ensure_future(boxes.pull("r", wait_s=30))
        await asyncio.sleep(0)
        assert not pull.done()
        boxes.put(out("a", 1))
        return empty, await pull

    empty, batch = asyncio.run(scenario())
    assert empty == []
    assert [o.new_token_ids for o in batch] == [[1]]


def test_closed_requests_queue_nothing_and_ids_are_unique():
    boxes = Outboxes(idle_timeout_s=60)
    boxes.open("a", "r")
    with pytest.raises(ValueError, match="already in use"):
        boxes.open("a", "other")
    boxes.close("a")
    boxes.put(out("a", 1))  # after the close: dropped
    assert len(boxes) == 0
    assert asyncio.run(boxes.pull("r", wait_s=0.01)) == []


def test_an_abort_that_overtakes_its_start_is_remembered_once():
    boxes = Outboxes(idle_timeout_s=60)
    boxes.close("early")
    assert boxes.aborted_before_start("early")
    assert not boxes.aborted_before_start("early")
    assert not boxes.aborted_before_start("other")


def test_requests_of_a_consumer_that_stopped_pulling_are_reaped():
    async def scenario():
        boxes = Outboxes(idle_timeout_s=0.05)
        boxes.open("orphan", "dead-replica")
        boxes.open("read", "live-replica")
        pull = asyncio.ensure_future(boxes.pull("live-replica", wait_s=30))
        aborted: list[str] = []
        reaper = asyncio.ensure_future(reap_orphans(boxes, aborted.extend))
        await asyncio.sleep(0.3)
        reaper.cancel()
        pull.cancel()
        return aborted, "read" in boxes, "orphan" in boxes

    aborted, read_open, orphan_open = asyncio.run(scenario())
    assert aborted == ["orphan"]
    assert read_open and not orphan_open


def test_kv_events_after_a_cursor_net_out_and_a_stale_reader_gets_the_whole_set():
    log = KVEventLog(capacity=4)
    first = log.since(None, -1)  # a new reader: the whole (empty) set
    assert first.reset and first.stored == []
    log.extend([(True, 1), (True, 2), (False, 1)])
    delta = log.since(first.epoch, first.cursor)
    assert not delta.reset and delta.stored == [2] and delta.removed == [1]
    log.extend([(True, 3), (True, 4), (True, 5)])  # the log keeps 4: cursor 3 is gone
    assert log.since(delta.epoch, delta.cursor).stored == [3, 4, 5]
    stale = log.since(first.epoch, first.cursor)
    assert stale.reset and sorted(stale.stored) == [2, 3, 4, 5]
    assert log.since("an-earlier-incarnation", delta.cursor).reset


def test_an_idle_pull_waits_until_the_load_changes_and_then_answers_at_once():
    async def scenario():
        boxes = Outboxes(idle_timeout_s=60, refresh_s=0.0)
        boxes.open("a", "r")
        pull = asyncio.ensure_future(boxes.pull("r", wait_s=30))
        for _ in range(10):
            await asyncio.sleep(0)
        waited = not pull.done()  # nothing to say: a long-poll, not a fixed-rate answer
        boxes.notify()  # e.g. another replica's request was admitted here
        return waited, await pull, "a" in boxes

    waited, batch, still_open = asyncio.run(scenario())
    assert waited
    assert batch == [] and still_open  # a load-only answer carries no output


def test_load_changes_are_answered_at_most_every_refresh_but_outputs_at_once():
    async def scenario():
        boxes = Outboxes(idle_timeout_s=60, refresh_s=30)
        boxes.open("a", "r")
        boxes.notify()
        first = await boxes.pull("r", wait_s=30)  # the change, answered: never answered yet
        pull = asyncio.ensure_future(boxes.pull("r", wait_s=30))
        boxes.notify()  # within refresh_s of the last answer: held back
        for _ in range(10):
            await asyncio.sleep(0)
        held = not pull.done()
        boxes.put(out("a", 1))  # outputs are never held back
        return first, held, await pull

    first, held, batch = asyncio.run(scenario())
    assert first == [] and held
    assert [o.new_token_ids for o in batch] == [[1]]


def test_a_consumer_waiting_in_a_long_poll_is_alive():
    async def scenario():
        boxes = Outboxes(idle_timeout_s=0.01)
        boxes.open("a", "r")
        pull = asyncio.ensure_future(boxes.pull("r", wait_s=30))
        await asyncio.sleep(0)
        await asyncio.sleep(0.05)  # past idle_timeout_s since the box opened
        orphans = boxes.orphaned()
        boxes.put(out("a", 1, "length"))
        return orphans, await pull

    orphans, batch = asyncio.run(scenario())
    assert orphans == []
    assert [o.finish_reason for o in batch] == ["length"]
