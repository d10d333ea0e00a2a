"""The fault-injection suite: each case runs 32 concurrent streams through E1 P2 D1
(tiny-llava) while a fault strikes, armed through the instances' test-only hook
(connectors/faults.py, on in this session's Ray only) or by killing an actor, and checks that

- every output is the colocated greedy one, token for token (0 wrong tokens),
- no client sees an error (streams move, corrupt bytes are recomputed),
- every instance ends with all its blocks free and nothing queued or held,
- nothing created by the case is left in the object store.

Every case runs again at 8 instances (E2 P3 D3) under `slow`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import ray

from pdcluster.cluster.client import Cluster
from pdcluster.connectors.faults import Fault, FaultSpec
from pdcluster.engine import SamplingParams
from pdcluster.engine.llm import RequestOutput
from tests.cluster_utils import (
    assert_clean,
    collect,
    instance_with,
    kill,
    kv_pool_actor,
    live_object_ids,
    random_image,
    start,
    total,
    until,
    wait_restarted,
    wait_until,
)

NUM_STREAMS = 32
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LEASE_S = 4.0
# Turn 2 of a conversation is prefilled on a P (loading the reply's blocks from the KV pool),
# never on D from its own cache.
SUITE = dict(connector={"kv_lease_s": LEASE_S}, router={"decode_prefix_fraction": 1.0})


def prompts(tag: str, images: bool = False) -> list[Any]:
    """NUM_STREAMS distinct prompts; with `images`, every other one shows an image."""
    out: list[Any] = []
    for i in range(NUM_STREAMS):
        text = f"{tag} {i}: the {i * 7}th reason to check every byte is"
        if images and i % 2:
            out.append(
                {"prompt": f"{text} <image>", "multi_modal_data": {"image": random_image(i)}}
            )
        else:
            out.append(text)
    return out


SIZES = {"4": dict(encoder=1, prefill=2, decode=1), "8": dict(encoder=2, prefill=3, decode=3)}


@pytest.fixture(scope="module", params=["4", pytest.param("8", marks=pytest.mark.slow)])
def suite(request, ray_session, model_dir):
    """The cluster, at 4 instances (default run) or 8 (`slow`)."""
    with start(model_dir, **SIZES[request.param], **SUITE) as cluster:
        yield cluster


@pytest.fixture
def clean(suite):
    """After the case: no fault left armed, every instance back and idle, nothing leaked."""
    baseline = live_object_ids()
    yield baseline
    arm(suite, None, None)
    assert wait_until(lambda: all(s.healthy for s in suite.stats()), 120)
    assert_clean(suite, baseline, timeout_s=60)


def ids(cluster: Cluster, role: str) -> list[str]:
    return sorted(i for i, (r, _) in cluster.instances.items() if r == role)


def arm(cluster: Cluster, role: str | None, spec: FaultSpec | None) -> None:
    """Arm `spec` in every instance of `role` (None: every instance; spec None: disarm)."""
    targets = [h for r, h in cluster.instances.values() if role is None or r == role]
    for ref in [h.inject_fault.remote(spec) for h in targets]:
        with contextlib.suppress(ray.exceptions.RayActorError):  # restarting: back unarmed
            ray.get(ref)


async def kill_one_with(cluster: Cluster, role: str, path: str) -> dict[str, Any]:
    """Once an instance of `role` has figure `path` non-zero, kill it (Ray restarts it
    under its name): its id, the epoch and the pid it had."""
    assert await until(lambda: instance_with(cluster, role, path))
    victim = instance_with(cluster, role, path)
    epoch = next(s.epoch for s in cluster.stats() if s.instance_id == victim)
    return {"id": victim, "epoch": epoch, "pid": kill(cluster, victim)}


def run_streams(
    cluster: Cluster, batch: list[Any], during: Callable[[list[asyncio.Task]], Any] | None = None
) -> list[RequestOutput | None]:
    """Stream every prompt of `batch` at once; `during(tasks)` (a coroutine function) acts
    while they run. A cancelled stream's output is None."""

    async def scenario() -> list[RequestOutput | None]:
        tasks = [
            asyncio.ensure_future(collect(cluster, cluster.make_request(p, PARAMS))) for p in batch
        ]
        if during is not None:
            await during(tasks)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return [None if isinstance(r, asyncio.CancelledError) else r for r in results]

    return asyncio.run(scenario())


def assert_exact(outputs: list[RequestOutput | None], batch: list[Any], reference) -> None:
    """Every stream that was not cancelled ended normally with the colocated tokens."""
    for prompt, out in zip(batch, outputs, strict=True):
        if out is None:
            continue
        assert not isinstance(out, BaseException), out
        assert out.finish_reason == "length", (prompt, out.finish_reason)
        assert out.token_ids == reference(prompt, PARAMS).token_ids, prompt


# ---- bytes ---------------------------------------------------------------------------------
def test_a_corrupt_kv_object_is_recomputed_never_served(suite, clean, reference):
    """A bit flipped in P's published KV after P hashed it: D's check fails, D prefills the
    prompt itself (whatever kv_load_failure_policy says), and P's blocks are freed at once."""
    failures = total(suite, "decode", "kv_transfer.checksum_failures")
    expired = total(suite, "prefill", "kv_transfer.leases_expired")
    arm(suite, "prefill", FaultSpec(Fault.CORRUPT_KV, times=4))
    batch = prompts("corrupt kv")
    assert_exact(run_streams(suite, batch), batch, reference)
    assert total(suite, "decode", "kv_transfer.checksum_failures") - failures >= 4
    assert total(suite, "prefill", "kv_transfer.leases_expired") == expired  # acked, not leased


def test_a_corrupt_encoder_output_is_encoded_again(suite, clean, reference):
    """A bit flipped in E's output after E hashed it: P encodes that image itself."""
    failures = total(suite, "prefill", "ec.checksum_failures")
    arm(suite, "encoder", FaultSpec(Fault.CORRUPT_ENCODER_OUTPUT, times=3))
    batch = prompts("corrupt image", images=True)
    assert_exact(run_streams(suite, batch), batch, reference)
    # Three strikes per E; at least one E encodes three of the batch's 16 images.
    found = total(suite, "prefill", "ec.checksum_failures") - failures
    assert 3 <= found <= 3 * len(ids(suite, "encoder"))


# ---- acks and leases -----------------------------------------------------------------------
def test_an_ack_delayed_past_the_lease(suite, clean, reference):
    """D's acks arrive after P's lease: P freed the blocks at the lease; the late acks are
    counted and ignored, never applied to blocks reused since."""
    expired = total(suite, "prefill", "kv_transfer.leases_expired")
    ignored = total(suite, "prefill", "kv_transfer.acks_ignored")
    arm(suite, "decode", FaultSpec(Fault.DELAY_ACK, times=4, seconds=LEASE_S + 1))
    batch = prompts("late ack")
    assert_exact(run_streams(suite, batch), batch, reference)

    def late() -> tuple[int, int]:  # (acks ignored, leases expired) since the batch began
        return (
            total(suite, "prefill", "kv_transfer.acks_ignored") - ignored,
            total(suite, "prefill", "kv_transfer.leases_expired") - expired,
        )

    # Four strikes per D: each a lease expired on P, then an ack that came too late.
    assert wait_until(lambda: late()[0] >= 4 and late()[0] == late()[1], 3 * LEASE_S), late()


@pytest.mark.slow  # flaky after the cases before it (cause not found yet; issue 40 note)
def test_a_prefill_restarted_under_its_name_refuses_its_predecessors_acks(suite, clean, reference):
    """P dies with sends awaiting acks and comes back under the same name with a new epoch:
    acks meant for its predecessor reach it and are refused (counted), not applied."""
    # Long enough for P to be back: a call to an actor still restarting fails, not queues.
    arm(suite, "decode", FaultSpec(Fault.DELAY_ACK, times=NUM_STREAMS, seconds=20.0))
    batch = prompts("restarted")
    killed: dict[str, Any] = {}

    async def kill_a_sender(tasks: list[asyncio.Task]) -> None:
        killed.update(await kill_one_with(suite, "prefill", "scheduler.num_pending_sends"))

    assert_exact(run_streams(suite, batch, kill_a_sender), batch, reference)
    wait_restarted(suite, killed["id"], killed["pid"])
    after = next(s for s in suite.stats() if s.instance_id == killed["id"])
    assert after.epoch != killed["epoch"]
    assert wait_until(lambda: total(suite, "prefill", "kv_transfer.acks_refused") >= 1, 45)


# ---- instances lost mid-transfer -------------------------------------------------------------
def test_prefill_killed_after_publish_before_decode_reads(suite, clean, reference):
    """D's reads are held back; P dies holding published KV: D's reads of it fail (or find
    the object still in this node's store) and D prefills; P's unsent requests move."""
    arm(suite, "decode", FaultSpec(Fault.DELAY_LOAD, times=NUM_STREAMS, seconds=1.5))
    batch = prompts("prefill lost")
    killed: dict[str, Any] = {}

    async def kill_a_publisher(tasks: list[asyncio.Task]) -> None:
        killed.update(await kill_one_with(suite, "prefill", "scheduler.num_pending_sends"))

    assert_exact(run_streams(suite, batch, kill_a_publisher), batch, reference)
    wait_restarted(suite, killed["id"], killed["pid"])


def test_decode_killed_mid_load(suite, clean, reference):
    """D dies with loads in flight: every stream moves and ends with the right tokens; P's
    blocks for the dead D are freed by the Front's aborts."""
    arm(suite, "decode", FaultSpec(Fault.DELAY_LOAD, times=NUM_STREAMS, seconds=2.0))
    batch = prompts("decode lost")
    killed: dict[str, Any] = {}
    moves = suite.front.num_moves

    async def kill_a_loader(tasks: list[asyncio.Task]) -> None:
        killed.update(await kill_one_with(suite, "decode", "scheduler.num_pending_recvs"))

    assert_exact(run_streams(suite, batch, kill_a_loader), batch, reference)
    assert suite.front.num_moves > moves
    wait_restarted(suite, killed["id"], killed["pid"])


@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_requests_aborted_mid_transfer(suite, clean, reference, side):
    """Half the clients leave while their KV is in flight (D's reads held back) or while P
    holds it for D (D paused): D frees its blocks once the read has landed, P at the abort."""
    decodes = [suite.instances[i][1] for i in ids(suite, "decode")]
    if side == "decode":
        arm(suite, "decode", FaultSpec(Fault.DELAY_LOAD, times=NUM_STREAMS, seconds=1.5))
        in_transfer = ("decode", "scheduler.num_pending_recvs")
    else:
        ray.get([d.pause.remote() for d in decodes])
        in_transfer = ("prefill", "scheduler.num_pending_sends")
    batch = prompts(f"abort on {side}")

    async def leave(tasks: list[asyncio.Task]) -> None:
        assert await until(lambda: total(suite, *in_transfer) > 0)
        for task in tasks[::2]:
            task.cancel()
        if side == "prefill":
            await asyncio.sleep(0)  # the aborts go out before D resumes
            await asyncio.to_thread(ray.get, [d.resume.remote() for d in decodes])

    outputs = run_streams(suite, batch, leave)
    assert outputs[::2].count(None) >= 1
    assert_exact(outputs, batch, reference)


# ---- the cluster KV pool ---------------------------------------------------------------------
def test_the_kv_pools_owner_lost_during_a_load(suite, clean, reference):
    """Turn 2 loads turn 1's reply from the KV pool (held back on P); the pool's owner dies
    meanwhile and restarts empty: the loads land or are recomputed, and the readers' releases
    of pins from the lost incarnation are refused by the new one."""
    turn1 = [
        [11 + i, 40 + i, 7, 300 + i, 9, 12, 13, 14, 15, 16, 17, 18] for i in range(NUM_STREAMS)
    ]
    first = run_streams(suite, turn1)
    assert_exact(first, turn1, reference)
    turn2 = [[*p, *out.token_ids, 5, 6, 7] for p, out in zip(turn1, first, strict=True)]
    pool = kv_pool_actor(suite)
    assert wait_until(lambda: ray.get(pool.stats.remote()).num_entries >= NUM_STREAMS)
    # Held past the pool's restart (~3 s): the loads' releases reach the new incarnation.
    arm(suite, "prefill", FaultSpec(Fault.DELAY_LOAD, times=NUM_STREAMS, seconds=6.0))

    async def lose_the_pool(tasks: list[asyncio.Task]) -> None:
        assert await until(lambda: total(suite, "prefill", "kv_pool.pending_loads") > 0)
        ray.kill(pool, no_restart=False)

    assert_exact(run_streams(suite, turn2, lose_the_pool), turn2, reference)
    assert wait_until(lambda: refused_releases(pool) >= 1, 60)


def refused_releases(pool: ray.actor.ActorHandle) -> int:
    """The pool's count of refused releases; 0 while it restarts."""
    try:
        return ray.get(pool.stats.remote()).num_refused_releases
    except ray.exceptions.RayActorError:
        return 0
