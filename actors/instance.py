"""InstanceActor: one E, P, D or mixed instance as a Ray actor with its own step loop.

The engine is stepped on a dedicated thread; Ray calls arrive on the actor's event loop and
talk to that thread through an inbox (commands in) and per-consumer outboxes (outputs out,
read by each gateway replica with one `pull` per step for all its requests here, see
actors/streams.py). A P given a `Route.decode_id` hands its finished request straight to
that D (P tells D: no third process on the handoff) and streams the first token itself. The loop keeps stepping while the scheduler has any request, including finished ones
whose KV load is in flight; after a step that ran no model it yields about 1 ms. It blocks on
the inbox when there is nothing to do (every command, shutdown's included, wakes it), nothing
but sends awaiting acks (an ack wakes it; leases are checked every INBOX_POLL_S meanwhile),
or nothing but requests deferred on an encoder's outputs (whose arrival wakes it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
import torch
from ray.actor import ActorHandle

from pdcluster.actors.instance_metrics import InstanceMetrics
from pdcluster.actors.kv_events import KVEventLog
from pdcluster.actors.messages import InstanceStats, LoadReport, PullReply, Route, StageTimes
from pdcluster.actors.pixels import prefetch
from pdcluster.actors.priority import run_at_normal_priority
from pdcluster.actors.stage_clock import StageClock
from pdcluster.actors.step_commands import WAKE, AbortRequests, AddRequest, StepCommand, Wake
from pdcluster.actors.streams import PULL_WAIT_S, Outboxes, reap_orphans
from pdcluster.actors.tp_worker import exit_instance, start_ray_workers
from pdcluster.connectors.base import KVConnectorBase
from pdcluster.connectors.multi import MultiKVConnector
from pdcluster.connectors.ray_ec import RayECConnector
from pdcluster.connectors.ray_kv import RayKVConnector
from pdcluster.connectors.ray_kv_pool import RayKVPoolConnector
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.core import EngineCore, resolve_device
from pdcluster.engine.encoder_core import EncoderCore
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.parallel import RankLost
from pdcluster.engine.precision import Precision
from pdcluster.engine.presets import resolve_model_dir
from pdcluster.engine.request import Request
from pdcluster.routing.handoff import for_decode, for_prefill

logger = logging.getLogger(__name__)

ROLES = ("encoder", "prefill", "decode", "mixed")
IDLE_YIELD_S = 0.001  # after a step that ran no model
INBOX_POLL_S = 0.1  # how often a loop waiting on remote work wakes (to check leases)
IDLE_WAIT_S = 1.0  # a loop with no work at all waits this long (a command wakes it at once)
DRAIN_QUIET_S = 1.0  # a draining instance is done once it held nothing for this long


@dataclass(frozen=True)
class InstanceSpec:
    instance_id: str  # also the Ray actor name: consumers ack producers by it
    role: str
    engine: EngineConfig
    model_name: str  # the id clients use: the `model_name` label of the exported metrics
    kv_lease_s: float = 60.0
    kv_load_timeout_s: float = 60.0
    kv_pool: str | None = None  # the cluster KV pool's owner actor (None: no pool)
    ec_timeout_s: float = 30.0
    stream_idle_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")


def build_core(
    spec: InstanceSpec, wake: Callable[[], None] | None = None
) -> EngineCore | EncoderCore:
    """The engine for a role, with the connectors that role needs; `wake` is called when
    encoder outputs that a deferred request waits for have landed."""
    device = resolve_device(spec.engine.device)
    dtype = Precision.resolve(spec.engine.dtype, spec.engine.quantization, device).dtype
    if spec.role == "encoder":
        return EncoderCore(spec.engine, RayECConnector("producer", spec.ec_timeout_s))
    block_size = spec.engine.cache.block_size
    connectors: list[KVConnectorBase] = []
    if spec.role in ("prefill", "decode"):
        connectors.append(
            RayKVConnector(
                engine_id=spec.instance_id,
                role="producer" if spec.role == "prefill" else "consumer",
                block_size=block_size,
                lease_s=spec.kv_lease_s,
                load_timeout_s=spec.kv_load_timeout_s,
            )
        )
    if spec.kv_pool is not None:
        pool = ray.get_actor(spec.kv_pool)
        connectors.append(RayKVPoolConnector(pool, block_size, spec.kv_load_timeout_s))
    kv = MultiKVConnector(connectors) if len(connectors) > 1 else next(iter(connectors), None)
    ec = RayECConnector("consumer", spec.ec_timeout_s, device, dtype, wake)
    return EngineCore(spec.engine, kv_connector=kv, ec_connector=ec, tp_launcher=start_ray_workers)


def handoff_connector(core: EngineCore | EncoderCore) -> RayKVConnector | None:
    """The connector that hands KV from P to D, if this core has one."""
    kv = getattr(core, "kv_connector", None)
    if isinstance(kv, MultiKVConnector):
        return kv.find(RayKVConnector)
    return kv if isinstance(kv, RayKVConnector) else None


class InstanceActor:
    """Wrap with `ray.remote(InstanceActor)`; see actors/launch helpers in cluster/control/launch.py."""

    def __init__(self, spec: InstanceSpec) -> None:
        logging.basicConfig(level=logging.INFO)
        run_at_normal_priority()
        # Each node resolves the model itself (a preset is written locally on first use).
        engine = dataclasses.replace(spec.engine, model=resolve_model_dir(spec.engine.model))
        spec = dataclasses.replace(spec, engine=engine)
        self.spec = spec
        self._node_id = ray.get_runtime_context().get_node_id()
        self._inbox: queue.SimpleQueue[StepCommand] = queue.SimpleQueue()
        self.core = build_core(spec, wake=lambda: self._inbox.put(WAKE))
        if isinstance(self.core, EngineCore):
            self.core.enable_kv_events()
        self._streams = Outboxes(spec.stream_idle_timeout_s)
        self._clock = StageClock(spec.instance_id, spec.role)  # the step thread's
        self._kv_log = KVEventLog()
        self._handoffs: dict[str, tuple[Request, str]] = {}  # P: request id -> (it, its D)
        self._decode_handles: dict[str, ActorHandle] = {}
        self._encodes: dict[str, asyncio.Future] = {}  # encoder: request id -> its outputs
        self._mm_hashes: dict[str, list[str]] = {}  # encoder: request id -> its images
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reaper: asyncio.Task | None = None
        self._stats = InstanceStats(spec.instance_id, spec.role)
        self._metrics = InstanceMetrics(spec.model_name, spec.instance_id, spec.role)
        self._stopping = False
        self._draining = False
        self._paused = threading.Event()
        self._num_steps = 0
        self._num_pulls = 0  # answered, for every consumer: the control plane's call rate
        self._load_key: tuple[Any, ...] = ()  # the step thread's last published load
        self._thread = threading.Thread(target=self._run, name="step-loop", daemon=True)
        self._thread.start()

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
        if route.ec_handle is None and request.kv_transfer_params is None:
            await prefetch(request.mm_features)  # this instance encodes its images
        if route.decode_id is not None:
            self._handoffs[rid] = (request, route.decode_id)
            request = for_prefill(request)
        self._inbox.put(AddRequest(request, received_s, route.ec_handle))

    @ray.method(enable_task_events=False)  # the most frequent call: no per-call event to the GCS
    async def pull(
        self, consumer_id: str, epoch: str | None = None, events_after: int = -1,
        num_promised: int = 0, wait_s: float = PULL_WAIT_S,
    ) -> PullReply:  # fmt: skip
        """Every output for the consumer's requests since its last pull (waiting up to
        `wait_s` for one), with this instance's load and prefix-cache events after the
        consumer's cursor (`epoch`, `events_after`: from its previous reply).
        `num_promised`: the consumer's requests planned onto this D that are still on their
        P (a drain waits for them). A change of load or prefix cache ends the wait early
        (actors/streams.py); a consumer new to this incarnation is answered at once."""
        self._start_reaper()
        if epoch != self._kv_log.epoch:  # a new consumer, or one that knew another incarnation
            wait_s = 0.0
        outputs = await self._streams.pull(consumer_id, wait_s, num_promised)
        self._num_pulls += 1
        s = self._stats.scheduler
        load = LoadReport(
            num_active=s.num_unfinished + len(self._encodes),
            queued_prefill_tokens=s.prefill_tokens_queued,
            kv_tokens=s.kv_tokens_reserved,
            num_blocks_free=s.num_blocks_free,
            num_blocks_total=s.num_blocks_total,
        )
        events = self._kv_log.since(epoch, events_after)
        accepting = not (self._draining or self._stopping)
        stage_times = self._streams.take_stage_times(consumer_id)
        return PullReply(outputs, load, events, accepting, stage_times)

    async def encode(self, request: Request) -> dict[str, np.ndarray]:
        """Encoder role: the encoder outputs of every image of `request`, by mm_hash."""
        if self.spec.role != "encoder":
            raise ValueError(f"instance {self.spec.instance_id} is not an encoder")
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

    async def abort(self, request_ids: list[str]) -> None:
        self._abort(list(request_ids))

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._streams.close(request_id)
            self._handoffs.pop(request_id, None)
            future = self._encodes.get(request_id)
            if future is not None and not future.done():
                future.set_result((EngineCoreOutput(request_id, [], finish_reason="abort"), {}))
        self._inbox.put(AbortRequests(request_ids))

    async def ack_kv(self, request_id: str) -> None:
        """A consumer has read this request's KV (producer role)."""
        kv = handoff_connector(self.core)
        if kv is not None:
            kv.ack(request_id)
            self._inbox.put(WAKE)  # an idle loop steps to free the blocks

    async def stats(self) -> InstanceStats:
        num_streams = len(self._streams) + len(self._encodes)
        return dataclasses.replace(self._stats, num_streams=num_streams, num_pulls=self._num_pulls)

    async def health(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    async def pause(self) -> None:
        """Stop stepping (commands are still taken in): for maintenance, and for tests that
        hold an instance still at a chosen stage of a request."""
        self._paused.set()

    async def resume(self) -> None:
        self._paused.clear()
        self._inbox.put(WAKE)

    async def drain(self, timeout_s: float) -> bool:
        """Stop being offered new requests (pull replies say so), finish what is held (KV held
        for a D included, until acked or leased), and return True once nothing has been held
        for DRAIN_QUIET_S: requests planned just before replicas noticed still arrive and
        are served. False when `timeout_s` passed first."""
        self._draining = True
        self._streams.notify()  # replicas stop routing here now (and say what they promised)
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < DRAIN_QUIET_S:
            if time.monotonic() > deadline:
                return False
            if self._holds_anything():
                quiet_since = time.monotonic()
            await asyncio.sleep(0.05)
        return True

    def _holds_anything(self) -> bool:
        """Requests here, or promised: planned onto this D by a replica, still on their P."""
        return bool(
            self._stats.num_active
            or len(self._streams)
            or self._encodes
            or self._streams.num_promised()
        )

    async def shutdown(self) -> None:
        self._stopping = True
        self._streams.notify()
        self._inbox.put(WAKE)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)
        self.core.shutdown()

    def _start_reaper(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._reaper = self._loop.create_task(reap_orphans(self._streams, self._abort))

    # ---- the step loop (its own thread) -------------------------------------------------
    def _run(self) -> None:
        self._publish_stats()
        while not self._stopping:
            core = self.core
            idle = self._paused.is_set() or not core.has_work() or core.waits_only_on_remote()
            self._drain_inbox(block=idle)  # an ack, like any command, ends the wait
            if not self._paused.is_set() and core.has_work() and not self._step_once():
                time.sleep(IDLE_YIELD_S)
            self._metrics.maybe_record(self._stats)
        self._fail_all("instance is shutting down", unavailable=True)

    def _step_once(self) -> bool:
        """One engine step and the delivery of its outputs; True when a model ran. (A method
        of its own so that no output, and no KV handle in one, outlives the step.)"""
        started_s = time.time()
        try:
            outputs, model_executed = self.core.step()
        except RankLost as exc:
            exit_instance(str(exc))
        except Exception as exc:  # noqa: BLE001 - a step failure must not kill the actor
            logger.exception("step failed on %s", self.spec.instance_id)
            self._fail_all(f"internal error on {self.spec.instance_id}: {exc}")
            return False
        self._num_steps += 1
        done = self._stamp(started_s, outputs)
        if isinstance(self.core, EncoderCore):  # its outputs go to the `encode` calls
            for out in outputs:
                self._deliver(out)
            self.core.ec_connector.clear_outbox()
            outputs, events = [], []
        else:
            events = self.core.take_kv_events()
        changed = self._publish_stats()
        if self._loop is not None and (outputs or events or changed):
            items = [(out, done.get(out.request_id)) for out in outputs]
            self._loop.call_soon_threadsafe(self._after_step, items, events, changed)
        return model_executed

    def _after_step(
        self,
        items: list[tuple[EngineCoreOutput, StageTimes | None]],
        events: list[tuple[bool, int]],
        changed: bool,
    ) -> None:
        """On the event loop: a step's outputs to their consumers, its prefix-cache events
        to the log; pulls hear of a changed load or cache."""
        for out, stage_times in items:
            self._route(out, stage_times)
        if events:
            self._kv_log.extend(events)
        if events or changed:
            self._streams.notify()

    def _stamp(self, started_s: float, outputs: list[EngineCoreOutput]) -> dict[str, StageTimes]:
        """Stage times of the step that just ran; those of the requests it ended here."""
        if not len(self._clock):
            return {}
        running = (r.request_id for r in self.core.scheduler.running)
        return self._clock.after_step(started_s, time.time(), running, outputs)

    def _drain_inbox(self, block: bool) -> None:
        try:
            if block:
                timeout_s = INBOX_POLL_S if self.core.has_work() else IDLE_WAIT_S
                command = self._inbox.get(timeout=timeout_s)
            else:
                command = self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
        if self._publish_stats() and self._loop is not None:
            self._loop.call_soon_threadsafe(self._streams.notify)

    def _handle(self, command: StepCommand) -> None:
        match command:
            case AddRequest():
                self._add(command)
            case AbortRequests(request_ids=request_ids):
                self.core.abort_requests(request_ids)
                self._clock.forget(request_ids)
            case Wake():
                pass  # it ended the wait: that was all

    def _add(self, command: AddRequest) -> None:
        request = command.request
        try:
            self.core.add_request(request)
        except ValueError as exc:
            out = EngineCoreOutput(request.request_id, [], finish_reason="error", error=str(exc))
            self._deliver(out)
            return
        if isinstance(self.core, EngineCore):
            self._clock.received(request.request_id, command.received_s)
        ec = getattr(self.core, "ec_connector", None)
        if command.ec_handle and isinstance(ec, RayECConnector):
            ec.add_handle(request.request_id, command.ec_handle)

    def _deliver(self, out: EngineCoreOutput) -> None:
        """Hand one output outside a step's batch to the event loop (from the step thread)."""
        if self._loop is None:
            return
        if self.spec.role == "encoder":
            if out.finished:
                outputs = self.core.ec_connector.take_outputs(
                    self._mm_hashes.get(out.request_id, [])
                )
                self._loop.call_soon_threadsafe(self._encoded, out, outputs)
        else:
            self._loop.call_soon_threadsafe(self._route, out, None)

    def _route(self, out: EngineCoreOutput, stage_times: StageTimes | None) -> None:
        """On the event loop: P's finished prefill goes on to its D, the rest to the
        consumer (with the request's stage times when it leaves here)."""
        if out.finished and out.request_id in self._handoffs:
            self._hand_off(out, stage_times)
        else:
            self._streams.put(out, stage_times)

    def _encoded(self, out: EngineCoreOutput, outputs: dict[str, np.ndarray]) -> None:
        future = self._encodes.get(out.request_id)
        if future is not None and not future.done():  # else `encode` was aborted
            future.set_result((out, outputs))

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

    def _fail_all(self, message: str, unavailable: bool = False) -> None:
        """Finish every request with an error (after an internal failure, or `unavailable`
        at shutdown: another instance may serve them)."""
        request_ids = self.core.fail_all()
        self._clock.forget(request_ids)
        for request_id in request_ids:
            out = EngineCoreOutput(
                request_id, [], finish_reason="error", error=message, unavailable=unavailable
            )
            self._deliver(out)

    def _publish_stats(self) -> bool:
        """A snapshot read by `stats()` and pulls (the step thread alone touches the
        engine); True when the load that pulls report changed."""
        stats = InstanceStats.from_engine(
            self.core.stats(),
            instance_id=self.spec.instance_id,
            role=self.spec.role,
            pid=os.getpid(),
            node_id=self._node_id,
            num_threads=torch.get_num_threads(),
            paused=self._paused.is_set(),
            num_steps=self._num_steps,
            num_active=len(self.core.request_ids()),
            num_stage_clocks=len(self._clock),
        )
        self._stats = stats
        s = stats.scheduler  # routing's load
        key = (s.num_unfinished, s.prefill_tokens_queued, s.kv_tokens_reserved)
        changed, self._load_key = key != self._load_key, key
        return changed
