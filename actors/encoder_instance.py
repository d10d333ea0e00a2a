"""EncoderInstanceActor: an E instance, which runs the vision encoder only. Its `encode` call
returns the encoder outputs of a request's images (and the EC connector publishes them to
the object store for the P that reads them); it streams no tokens. The step thread, pulls
(load, drain), stats and shutdown are the shared ones (actors/instance_base.py).
"""

from __future__ import annotations

import asyncio
import time

from pdcluster.actors.instance_base import InstanceBase, InstanceSpec, KVEventBatch, StepItems
from pdcluster.actors.pixels import prefetch
from pdcluster.actors.step_commands import AddRequest
from pdcluster.connectors.ray_ec import EncoderOutput, RayECConnector
from pdcluster.engine.encoder_core import EncoderCore
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.request import Request

Encoded = tuple[EngineCoreOutput, dict[str, EncoderOutput]]  # its last output, outputs by mm_hash


class EncoderInstanceActor(InstanceBase):
    """Wrap with `ray.remote(EncoderInstanceActor)` (the pool controller does)."""

    core: EncoderCore

    def __init__(self, spec: InstanceSpec) -> None:
        self._encodes: dict[str, asyncio.Future[Encoded]] = {}  # request id -> its outputs
        self._mm_hashes: dict[str, list[str]] = {}  # request id -> its images
        super().__init__(spec)

    def _build_core(self, spec: InstanceSpec) -> EncoderCore:
        return EncoderCore(spec.engine, RayECConnector("producer", spec.ec_timeout_s))

    async def encode(self, request: Request) -> dict[str, EncoderOutput]:
        """The encoder outputs of every image of `request`, by mm_hash."""
        rid = request.request_id
        if self._streams.aborted_before_start(rid):
            return {}
        self._start_reaper()
        future = self._encodes[rid] = asyncio.get_running_loop().create_future()
        await prefetch(request.mm_features)
        if future.done():  # aborted meanwhile
            self._encodes.pop(rid, None)
            return {}
        self._mm_hashes[rid] = [f.mm_hash for f in request.mm_features]
        self._inbox.put(AddRequest(request, time.time()))
        try:
            out, outputs = await future
        finally:
            self._encodes.pop(rid, None)
            self._mm_hashes.pop(rid, None)
        if out.finish_reason == "error":
            raise ValueError(out.error or "encoding failed")
        return outputs

    # ---- hooks of InstanceBase ----------------------------------------------------------
    def _take_step(
        self, started_s: float, outputs: list[EngineCoreOutput]
    ) -> tuple[StepItems, KVEventBatch]:
        """Its outputs go to the `encode` calls, not to consumers' streams."""
        for out in outputs:
            self._deliver(out)
        self.core.ec_connector.clear_outbox()
        return [], []

    def _deliver(self, out: EngineCoreOutput) -> None:
        if self._loop is not None and out.finished:
            outputs = self.core.ec_connector.take_outputs(self._mm_hashes.get(out.request_id, []))
            self._loop.call_soon_threadsafe(self._encoded, out, outputs)

    def _forget(self, request_id: str) -> None:
        future = self._encodes.get(request_id)
        if future is not None and not future.done():
            future.set_result((EngineCoreOutput(request_id, [], finish_reason="abort"), {}))

    def _num_calls(self) -> int:
        return len(self._encodes)

    def _encoded(self, out: EngineCoreOutput, outputs: dict[str, EncoderOutput]) -> None:
        future = self._encodes.get(out.request_id)
        if future is not None and not future.done():  # else `encode` was aborted
            future.set_result((out, outputs))
