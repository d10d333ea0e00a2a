"""RayECConnector consumer side on a real local Ray: deferral, wake-up, fallback, and
outputs checked against their checksums."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from pdcluster.connectors.checksum import digest
from pdcluster.connectors.faults import flipped
from pdcluster.connectors.ray_ec import EncoderOutput, RayECConnector
from pdcluster.engine.request import MultiModalFeature, Request
from pdcluster.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def encode_task(ray_session):
    @ray_session.remote(num_cpus=0)
    def encode(hashes: list[str], gate: object, fail: str) -> dict[str, EncoderOutput]:
        """As E's encode: each output with its checksum; `fail`: "raise", or "corrupt" (a
        bit of the last output flipped after it was hashed)."""
        ray_session.get(gate.wait.remote())
        if fail == "raise":
            raise RuntimeError("encoder failed")
        arrays = [np.full((4, 8), i, np.float32) for i in range(len(hashes))]
        outputs = {h: EncoderOutput(a, digest(a)) for h, a in zip(hashes, arrays, strict=True)}
        if fail == "corrupt":
            outputs[hashes[-1]] = EncoderOutput(flipped(arrays[-1]), digest(arrays[-1]))
        return outputs

    return encode


@pytest.fixture
def gate(ray_session):
    @ray_session.remote(num_cpus=0)
    class Gate:
        def __init__(self) -> None:
            self.event = None

        async def wait(self) -> None:
            self.event = self.event or asyncio.Event()
            await self.event.wait()

        async def open(self) -> None:
            self.event = self.event or asyncio.Event()
            self.event.set()

    handle = Gate.remote()
    yield handle
    ray_session.kill(handle)


def deferred(encode_task, gate, mm_hash: str, fail: str = ""):
    """A consumer connector, a request with one image, and its in-flight encode call."""
    woken = threading.Event()
    ec = RayECConnector("consumer", timeout_s=60, wake=woken.set)
    features = [MultiModalFeature(mm_hash, offset=1, length=4)]
    request = Request(mm_hash, [1, 9, 9, 9, 9, 2], SamplingParams(), mm_features=features)
    ec.add_handle(request.request_id, [encode_task.remote([mm_hash], gate, fail)])
    return ec, request, woken


def test_deferred_until_the_outputs_land_and_their_arrival_wakes_the_instance(
    ray_session, encode_task, gate
):
    ec, request, woken = deferred(encode_task, gate, "img-a")
    assert not ec.ensure_cache_available(request, 0) and ec.awaits_outputs("img-a")
    assert not woken.wait(0.2)  # nothing landed: the instance may sleep
    ray_session.get(gate.open.remote())
    assert woken.wait(30)
    assert not ec.awaits_outputs("img-a")
    assert ec.ensure_cache_available(request, 0) and ec.has_cache_item("img-a")
    assert ec.stats().pending == 0 and ec.stats().fallbacks == 0


@pytest.mark.parametrize("fail", ["raise", "corrupt"])
def test_a_failed_or_corrupt_encoder_output_falls_back_to_local_encoding(
    ray_session, encode_task, gate, fail
):
    ec, request, woken = deferred(encode_task, gate, f"img-{fail}", fail)
    ray_session.get(gate.open.remote())
    assert woken.wait(30)
    assert ec.ensure_cache_available(request, 0)  # proceeds, encoding locally
    assert not ec.has_cache_item(f"img-{fail}") and ec.stats().fallbacks == 1
    assert ec.stats().checksum_failures == (fail == "corrupt")
