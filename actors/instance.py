"""InstanceActor: one P, D or mixed instance as a Ray actor with its own step loop (the
shared part, the step thread included, is actors/instance_base.py; an encoder is
actors/encoder_instance.py).

A P given a `Route.decode_id` hands its finished request straight to that D (P tells D: no
third process on the handoff) and streams the first token itself; D reads the KV and streams
the rest. Every step's prefix-cache changes go to the instance's event log, which pulls carry
to the gateway replicas' routers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable

import ray
from ray.actor import ActorHandle

from pdcluster.actors.instance_base import InstanceBase, InstanceSpec, KVEventBatch, StepItems
from pdcluster.actors.messages import Route, StageTimes
from pdcluster.actors.pixels import prefetch
from pdcluster.actors.step_commands import WAKE, AbortRequests, AddRequest
from pdcluster.actors.tp_worker import start_ray_workers
from pdcluster.connectors.base import KVConnectorBase
from pdcluster.connectors.multi import MultiKVConnector
from pdcluster.connectors.ray_ec import RayECConnector
from pdcluster.connectors.ray_kv import RayKVConnector
from pdcluster.connectors.ray_kv_pool import RayKVPoolConnector
from pdcluster.engine.core import EngineCore, resolve_device
from pdcluster.engine.lora.adapter import LoRARequest
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.precision import Precision
from pdcluster.engine.request import Request
from pdcluster.routing.handoff import for_decode, for_prefill
from pdcluster.routing.role import Role


def build_core(
    spec: InstanceSpec, wake: Callable[[], None] | None = None, epoch: str | None = None
) -> EngineCore:
    """The engine of a P, D or mixed instance, with the connectors its role needs; `wake` is
    called when encoder outputs that a deferred request waits for have landed; `epoch` names
    this incarnation in its KV handles (a fresh one when None)."""
    device = resolve_device(spec.engine.device)
    dtype = Precision.resolve(spec.engine.dtype, spec.engine.quantization, device).dtype
    block_size = spec.engine.cache.block_size
    connectors: list[KVConnectorBase] = []
    if spec.role in (Role.PREFILL, Role.DECODE):
        connectors.append(
            RayKVConnector(
                engine_id=spec.instance_id,
                role="producer" if spec.role == Role.PREFILL else "consumer",
                block_size=block_size,
                lease_s=spec.kv_lease_s,
                load_timeout_s=spec.kv_load_timeout_s,
                epoch=epoch,
            )
        )
    if spec.kv_pool is not None:
        pool = ray.get_actor(spec.kv_pool)
        connectors.append(RayKVPoolConnector(pool, block_size, spec.kv_load_timeout_s))
    kv = MultiKVConnector(connectors) if len(connectors) > 1 else next(iter(connectors), None)
    ec = RayECConnector("consumer", spec.ec_timeout_s, device, dtype, wake)
    return EngineCore(spec.engine, kv_connector=kv, ec_connector=ec, tp_launcher=start_ray_workers)


def handoff_connector(core: EngineCore) -> RayKVConnector | None:
    """The connector that hands KV from P to D, if this core has one."""
    kv = core.kv_connector
    if isinstance(kv, MultiKVConnector):
        return kv.find(RayKVConnector)
    return kv if isinstance(kv, RayKVConnector) else None


class InstanceActor(InstanceBase):
    """A P, D or mixed instance; wrap with `ray.remote(InstanceActor)` (the pool controller,
    actors/pool_controller.py, does)."""

    core: EngineCore

    def __init__(self, spec: InstanceSpec) -> None:
        self._handoffs: dict[str, tuple[Request, str]] = {}  # P: request id -> (it, its D)
        self._decode_handles: dict[str, ActorHandle] = {}
        super().__init__(spec)

    def _build_core(self, spec: InstanceSpec) -> EngineCore:
        core = build_core(spec, wake=lambda: self._inbox.put(WAKE), epoch=self.epoch)
        core.enable_kv_events()
        return core

    # ---- Ray-facing API (runs on the actor's event loop) --------------------------------
    async def submit(self, request: Request, route: Route) -> None:
        """Start a request whose outputs `route.consumer_id` pulls. With `route.decode_id`
        (a P), the prompt is prefilled here and the request handed to that D."""
        received_s = time.time()
        rid = request.request_id
        if self._streams.aborted_before_start(rid):
            return
        self._start_reaper()
        try:
            self._streams.open(rid, route.consumer_id)
        except ValueError as exc:
            out = EngineCoreOutput(rid, [], finish_reason="error", error=str(exc))
            self._streams.reject(route.consumer_id, out)
            return
        await self._find_peers(request, route)
        if route.ec_handle is None and request.kv_transfer_params is None:
            await prefetch(request.mm_features)  # this instance encodes its images
        if route.decode_id is not None:
            self._handoffs[rid] = (request, route.decode_id)
            request = for_prefill(request)
        self._inbox.put(AddRequest(request, received_s, route.ec_handle))

    async def _find_peers(self, request: Request, route: Route) -> None:
        """Look up by name, off the step thread, the actors this request's step-thread work
        calls: a P's D (the handoff) and a D's P (the ack). A lookup asks Ray's GCS and waits
        while the GCS is down; made here, it holds back only a request to a peer this
        instance never reached, never the streams it runs. A peer that is gone is no error
        here: the handoff and the ack report it."""
        if route.decode_id is not None and route.decode_id not in self._decode_handles:
            with contextlib.suppress(ValueError):
                await asyncio.to_thread(self._decode_handle, route.decode_id)
        params = request.kv_transfer_params
        kv = handoff_connector(self.core)
        remote = params is not None and params.do_remote_prefill
        if kv is not None and remote and not kv.knows_producer(params.remote_engine_id):
            await asyncio.to_thread(kv.find_producer, params.remote_engine_id)

    async def load_lora(self, lora: LoRARequest) -> str | None:
        """Load a LoRA adapter for requests to come (off the step thread: it reads files);
        None, or why this instance cannot serve it."""
        try:
            await asyncio.to_thread(self.core.load_lora, lora)
        except ValueError as exc:
            return str(exc)
        self._inbox.put(WAKE)  # its stats say so
        return None

    async def unload_lora(self, name: str) -> None:
        """Forget a LoRA adapter; requests running on it finish."""
        self.core.unload_lora(name)
        self._inbox.put(WAKE)

    async def ack_kv(self, request_id: str, epoch: str) -> None:
        """A consumer has read this request's KV as incarnation `epoch` published it
        (producer role); an ack for another incarnation is refused."""
        kv = handoff_connector(self.core)
        if kv is not None:
            kv.ack(request_id, epoch)
            self._inbox.put(WAKE)  # an idle loop steps to free the blocks

    # ---- hooks of InstanceBase ----------------------------------------------------------
    def _take_step(
        self, started_s: float, outputs: list[EngineCoreOutput]
    ) -> tuple[StepItems, KVEventBatch]:
        done = self._stamp(started_s, outputs)
        items = [(out, done.get(out.request_id)) for out in outputs]
        return items, self.core.take_kv_events()

    def _stamp(self, started_s: float, outputs: list[EngineCoreOutput]) -> dict[str, StageTimes]:
        """Stage times of the step that just ran; those of the requests it ended here."""
        if not len(self._clock):
            return {}
        running = (r.request_id for r in self.core.scheduler.running)
        return self._clock.after_step(started_s, time.time(), running, outputs)

    def _added(self, command: AddRequest) -> None:
        request_id = command.request.request_id
        self._clock.received(request_id, command.received_s)
        ec = self.core.ec_connector
        if command.ec_handle and isinstance(ec, RayECConnector):
            ec.add_handle(request_id, command.ec_handle)

    def _deliver(self, out: EngineCoreOutput) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._route, out, None)

    def _forget(self, request_id: str) -> None:
        self._handoffs.pop(request_id, None)

    def _route(self, out: EngineCoreOutput, stage_times: StageTimes | None) -> None:
        """On the event loop: P's finished prefill goes on to its D, the rest to the
        consumer (with the request's stage times when it leaves here)."""
        if out.finished and out.request_id in self._handoffs:
            self._hand_off(out, stage_times)
        else:
            super()._route(out, stage_times)

    def _hand_off(self, out: EngineCoreOutput, stage_times: StageTimes | None) -> None:
        """P finished a prefill: pass the request to its D, which reads the KV and streams
        the rest; the first token goes to the consumer from here. A request that ends here
        (an error, EOS, a stop string) frees the KV nobody will read."""
        handoff = self._handoffs.pop(out.request_id, None)
        if handoff is None or out.request_id not in self._streams:
            return  # aborted meanwhile: the abort frees the KV
        request, decode_id = handoff
        params = out.kv_transfer_params
        out = dataclasses.replace(out, kv_transfer_params=None)
        if out.finish_reason != "length" or params is None:
            if params is not None:
                self._inbox.put(AbortRequests([out.request_id]))
            self._streams.put(out, stage_times)
            return
        try:
            handle = self._decode_handle(decode_id)
        except ValueError as exc:
            self._inbox.put(AbortRequests([out.request_id]))
            error = dataclasses.replace(
                out, finish_reason="error", error=str(exc), unavailable=True
            )
            self._streams.put(error, stage_times)
            return
        consumer_id = self._streams.consumer_of(out.request_id)
        decode = for_decode(request, out.new_token_ids[0], params, out.new_text)
        handle.submit.remote(decode, Route(consumer_id))
        self._streams.put(dataclasses.replace(out, finish_reason=None), stage_times)
        self._streams.close(out.request_id)  # D streams the rest; P holds KV until D's ack

    def _decode_handle(self, decode_id: str) -> ActorHandle:
        handle = self._decode_handles.get(decode_id)
        if handle is None:
            try:
                handle = self._decode_handles[decode_id] = ray.get_actor(decode_id)
            except ValueError:
                raise ValueError(f"decode instance {decode_id} is gone") from None
        return handle
