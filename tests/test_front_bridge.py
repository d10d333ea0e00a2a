"""The Front's loop bridge (actors/front/bridge.py): calls onto its thread's event loop and
batches back to callers on their own loops. No Ray."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdcluster.actors.front.bridge import LoopThread, Outbox, Sink
from pdcluster.engine.outputs import EngineCoreOutput


@pytest.fixture
def thread():
    loop_thread = LoopThread("test-front")
    yield loop_thread
    loop_thread.stop(timeout_s=5)


def out(rid: str, token: int) -> EngineCoreOutput:
    return EngineCoreOutput(rid, [token])


def test_call_runs_functions_and_coroutines_on_the_loop_thread(thread):
    async def where() -> str:
        return threading.current_thread().name

    assert thread.call(lambda: threading.current_thread().name).result(5) == "test-front"
    assert thread.call(where()).result(5) == "test-front"


def test_on_loop_runs_at_once_for_a_caller_on_the_loop(thread):
    ran = []

    async def on_the_loop() -> list[str]:
        thread.on_loop(asyncio.get_running_loop(), ran.append, "now")
        return list(ran)  # nothing yielded to the loop in between

    assert thread.call(on_the_loop()).result(5) == ["now"]


def test_on_loop_from_another_loop_runs_on_the_loop_thread(thread):
    ran = threading.Event()
    names = []

    def record() -> None:
        names.append(threading.current_thread().name)
        ran.set()

    async def caller() -> None:
        thread.on_loop(asyncio.get_running_loop(), record)

    asyncio.run(caller())
    assert ran.wait(5) and names == ["test-front"]


def test_a_batch_for_the_owning_loop_is_queued_at_once(thread):
    async def scenario() -> tuple[int, list[EngineCoreOutput]]:
        queue: asyncio.Queue = asyncio.Queue()
        outbox = Outbox(asyncio.get_running_loop(), lambda ids: None)
        outbox.send(Sink(asyncio.get_running_loop(), queue, 3), "a", [out("a", 1)])
        return queue.get_nowait()

    index, batch = thread.call(scenario()).result(5)
    assert index == 3 and batch[0].new_token_ids == [1]


def test_batches_for_another_loop_cross_in_one_call_in_order(thread):
    crossings = []

    async def caller() -> list[tuple[int, list[int]]]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        real_call = loop.call_soon_threadsafe

        def counted(*args):
            crossings.append(args[0])
            return real_call(*args)

        loop.call_soon_threadsafe = counted  # the Front's thread calls this to cross

        def on_front() -> None:  # one loop iteration of the Front: two requests' batches
            outbox = Outbox(thread.loop, lambda ids: None)
            outbox.send(Sink(loop, queue, 0), "a", [out("a", 1)])
            outbox.send(Sink(loop, queue, 1), "b", [out("b", 2)])
            outbox.send(Sink(loop, queue, 0), "a", [out("a", 3)])

        thread.call(on_front).result(5)
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(3)]
        return [(i, [o.new_token_ids[0] for o in batch]) for i, batch in got]

    assert asyncio.run(caller()) == [(0, [1]), (1, [2]), (0, [3])]
    assert len(crossings) == 1


def test_batches_for_a_closed_loop_are_reported_unread(thread):
    closed = asyncio.new_event_loop()
    closed.close()
    unread = []
    done = threading.Event()

    def on_front() -> None:
        outbox = Outbox(thread.loop, lambda ids: (unread.extend(ids), done.set()))
        outbox.send(Sink(closed, asyncio.Queue(), 0), "a", [out("a", 1)])
        outbox.send(Sink(closed, asyncio.Queue(), 1), "b", [out("b", 2)])

    thread.call(on_front).result(5)
    assert done.wait(5) and unread == ["a", "b"]


def test_a_stream_behind_its_pulls_reads_what_waited_as_one_output_per_request():
    from pdcluster.actors.front.front import _behind

    async def scenario():
        batches: asyncio.Queue = asyncio.Queue()
        for batch in [(0, [out("a", 1)]), (1, [out("b", 7)]), (0, [out("a", 2), out("a", 3)])]:
            batches.put_nowait(batch)
        first = await batches.get()
        return _behind(first, batches), batches.empty(), _behind((1, [out("b", 8)]), batches)

    behind, drained, alone = asyncio.run(scenario())
    assert [(i, o.request_id, o.new_token_ids) for i, o in behind] == [
        (0, "a", [1, 2, 3]),
        (1, "b", [7]),
    ]
    assert drained
    assert [(i, o.new_token_ids) for i, o in alone] == [(1, [8])]
