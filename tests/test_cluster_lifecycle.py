"""The DESIGN.md seed behaviours end to end, and aborts at every stage: nothing leaks."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest
import ray

from pdcluster.actors.messages import Route
from tests.cluster_utils import (
    GREEDY,
    assert_clean,
    collect,
    handle,
    instance_stats,
    live_object_ids,
    random_image,
    start,
    until,
    wait_until,
)

LONG = dataclasses.replace(GREEDY, max_tokens=400)


@pytest.fixture(scope="module")
def epd(ray_session, model_dir):
    with start(model_dir, encoder=1, prefill=1, decode=1) as cluster:
        yield cluster


@pytest.fixture
def baseline(epd):
    ids = live_object_ids()
    yield ids
    for role in ("encoder", "prefill", "decode"):
        ray.get(handle(epd, role).resume.remote())
    assert_clean(epd, ids)


def mm_prompt(seed: int) -> dict:
    return {"prompt": "Look at <image> now.", "multi_modal_data": {"image": random_image(seed)}}


def test_deferred_on_encoder_while_text_request_proceeds(epd, baseline, reference):
    encoder = handle(epd, "encoder")
    ray.get(encoder.pause.remote())  # E's output for the image stays "in flight"

    async def scenario():
        mm_task = asyncio.create_task(collect(epd, epd.make_request(mm_prompt(7), GREEDY)))
        assert await until(lambda: instance_stats(epd, "prefill").scheduler.num_deferred == 1)
        text = await collect(epd, epd.make_request("A text request queued behind it", GREEDY))
        assert not mm_task.done() and instance_stats(epd, "prefill").scheduler.num_deferred == 1
        ray.get(encoder.resume.remote())
        return text, await mm_task

    text, mm = asyncio.run(scenario())
    assert text.token_ids == reference("A text request queued behind it").token_ids
    assert mm.token_ids == reference(mm_prompt(7)).token_ids
    assert instance_stats(epd, "prefill").ec.loaded >= 1  # loaded from E, not encoded on P


def test_prefill_holds_blocks_until_decode_acks(epd, baseline, reference):
    decode = handle(epd, "decode")
    ray.get(decode.pause.remote())
    acks_before = instance_stats(epd, "prefill").kv_transfer.acks_received

    async def scenario():
        task = asyncio.create_task(collect(epd, epd.make_request("Hold my blocks", GREEDY)))
        assert await until(lambda: instance_stats(epd, "prefill").scheduler.num_pending_sends == 1)
        held = instance_stats(epd, "prefill")
        assert held.scheduler.num_blocks_free < held.scheduler.num_blocks_total
        assert held.scheduler.num_running == 0 and held.scheduler.num_waiting == 0
        # P's loop keeps stepping (no model work) while the send is outstanding.
        assert await until(lambda: instance_stats(epd, "prefill").num_steps > held.num_steps)
        ray.get(decode.resume.remote())
        return await task

    out = asyncio.run(scenario())
    assert out.token_ids == reference("Hold my blocks").token_ids
    stats = instance_stats(epd, "prefill")
    assert stats.scheduler.num_blocks_free == stats.scheduler.num_blocks_total
    assert stats.kv_transfer.acks_received == acks_before + 1


def test_every_instance_runs_at_normal_priority_with_its_num_cpus_threads(epd):
    """Ray starts workers at niceness 15; an instance raises itself to 0 where it may (here:
    root), and runs torch on as many threads as CPUs it reserved (1)."""
    if os.geteuid() != 0:
        pytest.skip("raising a process's priority needs root or CAP_SYS_NICE")
    for role in ("encoder", "prefill", "decode"):
        stats = instance_stats(epd, role)
        assert stats.num_threads == 1
        threads = Path(f"/proc/{stats.pid}/task").iterdir()
        assert {os.getpriority(os.PRIO_PROCESS, int(t.name)) for t in threads} == {0}, role


async def _abort_when(cluster, request, stage_reached) -> None:
    task = asyncio.create_task(collect(cluster, request))
    assert await until(stage_reached)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_abort_while_queued_on_prefill(epd, baseline):
    ray.get(handle(epd, "prefill").pause.remote())
    request = epd.make_request("queued", GREEDY)
    asyncio.run(
        _abort_when(epd, request, lambda: instance_stats(epd, "prefill").scheduler.num_waiting)
    )


def test_abort_while_deferred_on_encoder(epd, baseline):
    ray.get(handle(epd, "encoder").pause.remote())
    request = epd.make_request(mm_prompt(11), GREEDY)
    stage = lambda: instance_stats(epd, "prefill").scheduler.num_deferred == 1  # noqa: E731
    asyncio.run(_abort_when(epd, request, stage))


def test_abort_between_prefill_and_decode(epd, baseline):
    ray.get(handle(epd, "decode").pause.remote())
    cancelled = instance_stats(epd, "prefill").kv_transfer.sends_cancelled
    request = epd.make_request("between P and D", GREEDY)
    stage = lambda: instance_stats(epd, "prefill").scheduler.num_pending_sends == 1  # noqa: E731
    asyncio.run(_abort_when(epd, request, stage))
    # P frees at once on the abort, not at the lease.
    assert wait_until(
        lambda: instance_stats(epd, "prefill").kv_transfer.sends_cancelled == cancelled + 1
    )


def test_abort_while_decoding(epd, baseline):
    request = epd.make_request("decode for a long time", LONG)
    stage = lambda: instance_stats(epd, "decode").scheduler.num_running == 1  # noqa: E731
    asyncio.run(_abort_when(epd, request, stage))


@pytest.mark.parametrize("delay_ms", [0, 2, 10, 30, 80])
def test_abort_at_any_moment(epd, baseline, delay_ms):
    """Prefilling, in transfer, loading on D: wherever the abort lands, nothing is held."""

    async def scenario():
        requests = [epd.make_request("x " * 200, LONG), epd.make_request(mm_prompt(3), LONG)]
        tasks = [asyncio.create_task(collect(epd, r)) for r in requests]
        await asyncio.sleep(delay_ms / 1000)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())


def test_the_leak_check_finds_an_object_left_in_the_store(epd):
    """assert_clean is no check that cannot fail: an object created after the baseline and
    still referenced fails it, and passes once dropped; calls in flight do not fail it."""
    ids = live_object_ids()
    kept = ray.put(b"left behind")
    with pytest.raises(AssertionError, match=kept.hex()):
        assert_clean(epd, ids, timeout_s=1.0)
    del kept
    assert_clean(epd, ids)


def test_lease_frees_blocks_when_decode_never_acks(ray_session, model_dir, reference):
    connector = {"kv_lease_s": 1.0}
    with start(model_dir, prefill=1, decode=1, connector=connector) as cluster:
        baseline = live_object_ids()
        decode = handle(cluster, "decode")
        ray.get(decode.pause.remote())

        async def scenario():
            task = asyncio.create_task(collect(cluster, cluster.make_request("lease", GREEDY)))
            assert await until(
                lambda: instance_stats(cluster, "prefill").kv_transfer.leases_expired == 1
            )
            stats = instance_stats(cluster, "prefill")
            assert stats.scheduler.num_blocks_free == stats.scheduler.num_blocks_total
            assert stats.scheduler.num_pending_sends == 0
            ray.get(decode.resume.remote())  # D still holds a ref: it reads, and its ack is late
            return await task

        out = asyncio.run(scenario())
        assert out.token_ids == reference("lease").token_ids
        assert wait_until(
            lambda: instance_stats(cluster, "prefill").kv_transfer.acks_ignored == 1
        ), str(instance_stats(cluster, "decode")) + str(instance_stats(cluster, "prefill"))
        assert_clean(cluster, baseline)


def test_a_client_that_stops_reading_has_its_request_aborted(ray_session, model_dir):
    """A gateway replica that dies without aborting: the instances abort its requests once
    it has not pulled for `stream_idle_timeout_s`, and every instance ends idle."""
    router = {"stream_idle_timeout_s": 1.0}
    with start(model_dir, prefill=1, decode=1, router=router) as cluster:
        baseline = live_object_ids()
        request = cluster.make_request("nobody reads this", LONG)
        decode = handle(cluster, "decode")
        decode_id = next(i for i, (role, _) in cluster.instances.items() if role == "decode")
        route = Route("a-replica-that-died", None, decode_id)  # it submits, then never pulls
        handle(cluster, "prefill").submit.remote(request, route)
        assert wait_until(lambda: instance_stats(cluster, "decode").scheduler.num_running == 1)
        ray.get(decode.pause.remote())  # from here only an abort can end the request
        assert wait_until(lambda: instance_stats(cluster, "decode").scheduler.num_running == 0)
        ray.get(decode.resume.remote())
        assert_clean(cluster, baseline)
