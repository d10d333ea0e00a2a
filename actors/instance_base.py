"""What every instance actor shares: its spec, the step thread and its inbox, the outboxes
that gateway replicas pull, stats, pause, drain and shutdown. The P/D/mixed instance
(actors/instance.py) and the encoder instance (actors/encoder_instance.py) add their engine
and where its outputs go.

The engine is stepped on a dedicated thread; Ray calls arrive on the actor's event loop and
talk to that thread through an inbox (typed commands in, actors/step_commands.py) and
per-consumer outboxes (outputs out, read by each gateway replica with one `pull` per step for
all its requests here, see actors/streams.py). The loop keeps stepping while the engine has
any request, including finished ones whose KV load is in flight; after a step that ran no
model it yields about 1 ms. It blocks on the inbox when there is nothing to do (every
command, shutdown's included, wakes it), nothing but sends awaiting acks (an ack wakes it;
leases are checked every INBOX_POLL_S meanwhile), or nothing but requests deferred on an
encoder's outputs (whose arrival wakes it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch

from pdcluster.actors.instance_metrics import InstanceMetrics
from pdcluster.actors.kv_events import KVEventLog
from pdcluster.actors.messages import InstanceStats, LoadReport, PullReply, StageTimes
from pdcluster.actors.priority import run_at_normal_priority
from pdcluster.actors.stage_clock import StageClock
from pdcluster.actors.step_commands import WAKE, AbortRequests, AddRequest, StepCommand, Wake
from pdcluster.actors.streams import PULL_WAIT_S, Outboxes, reap_orphans
from pdcluster.actors.tp_worker import exit_instance
from pdcluster.connectors import faults
from pdcluster.connectors.faults import FaultSpec
from pdcluster.engine.config import EngineConfig
from pdcluster.engine.core import EngineCore
from pdcluster.engine.encoder_core import EncoderCore
from pdcluster.engine.lora.adapter import LoRAAdapterError
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.parallel import RankLost
from pdcluster.engine.presets import resolve_model_dir
from pdcluster.routing.role import Role

logger = logging.getLogger(__name__)

IDLE_YIELD_S = 0.001  # after a step that ran no model
INBOX_POLL_S = 0.1  # how often a loop waiting on remote work wakes (to check leases)
IDLE_WAIT_S = 1.0  # a loop with no work at all waits this long (a command wakes it at once)
DRAIN_QUIET_S = 1.0  # a draining instance is done once it held nothing for this long

StepItems = list[tuple[EngineCoreOutput, StageTimes | None]]  # a step's outputs for consumers
KVEventBatch = list[tuple[bool, int]]  # (stored, block hash) of one step


@dataclass(frozen=True)
class InstanceSpec:
    instance_id: str  # also the Ray actor name: consumers ack producers by it
    role: Role  # a role's name is taken too
    engine: EngineConfig
    model_name: str  # the id clients use: the `model_name` label of the exported metrics
    kv_lease_s: float = 60.0
    kv_load_timeout_s: float = 60.0
    kv_pool: str | None = None  # the cluster KV pool's owner actor (None: no pool)
    ec_timeout_s: float = 30.0
    stream_idle_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "role", Role.parse(self.role))


class InstanceBase:
    """An instance actor's shared part. A subclass builds its engine (`_build_core`), says
    where an output goes (`_deliver`, `_take_step`) and what calls it holds besides streams
    (`_num_calls`); it sets its own state before calling `InstanceBase.__init__`, which
    starts the step thread."""

    core: EngineCore | EncoderCore

    def __init__(self, spec: InstanceSpec) -> None:
        logging.basicConfig(level=logging.INFO)
        run_at_normal_priority()
        # Each node resolves the model itself (a preset is written locally on first use).
        engine = dataclasses.replace(spec.engine, model=resolve_model_dir(spec.engine.model))
        spec = dataclasses.replace(spec, engine=engine)
        self.spec = spec
        self._node_id = ray.get_runtime_context().get_node_id()
        self._inbox: queue.SimpleQueue[StepCommand] = queue.SimpleQueue()
        self._kv_log = KVEventLog()  # its epoch names this incarnation
        self.core = self._build_core(spec)
        self._streams = Outboxes(spec.stream_idle_timeout_s)
        self._clock = StageClock(spec.instance_id, spec.role)  # the step thread's
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reaper: asyncio.Task | None = None
        self._stats = InstanceStats(spec.instance_id, spec.role, epoch=self.epoch)
        self._metrics = InstanceMetrics(spec.model_name, spec.instance_id, spec.role)
        self._stopping = False
        self._draining = False
        self._paused = threading.Event()
        self._num_steps = 0
        self._num_pulls = 0  # answered, for every consumer: the control plane's call rate
        self._load_key: tuple[Any, ...] = ()  # the step thread's last published load
        self._thread = threading.Thread(target=self._run, name="step-loop", daemon=True)
        self._thread.start()

    @property
    def epoch(self) -> str:
        """This incarnation of the instance: a restart under the same name gets a new one."""
        return self._kv_log.epoch

    # ---- what a kind of instance supplies -----------------------------------------------
    def _build_core(self, spec: InstanceSpec) -> EngineCore | EncoderCore:
        raise NotImplementedError

    def _take_step(self, started_s: float, outputs: list[EngineCoreOutput]) -> tuple[
        StepItems, KVEventBatch
    ]:  # fmt: skip
        """On the step thread, after a step: its outputs for consumers (with the stage
        times of the requests that left here) and its prefix-cache events."""
        raise NotImplementedError

    def _deliver(self, out: EngineCoreOutput) -> None:
        """Hand one output outside a step's batch to the event loop (from the step thread)."""
        raise NotImplementedError

    def _added(self, command: AddRequest) -> None:
        """On the step thread: `command`'s request was taken by the engine."""

    def _forget(self, request_id: str) -> None:
        """On the event loop: the request was aborted here."""

    def _num_calls(self) -> int:
        """Calls waiting on this instance besides output streams."""
        return 0

    # ---- Ray-facing API (runs on the actor's event loop) --------------------------------
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
            num_active=s.num_unfinished + self._num_calls(),
            queued_prefill_tokens=s.prefill_tokens_queued,
            kv_tokens=s.kv_tokens_reserved,
            num_blocks_free=s.num_blocks_free,
            num_blocks_total=s.num_blocks_total,
            lora_adapters=() if self._stats.lora is None else self._stats.lora.resident,
        )
        events = self._kv_log.since(epoch, events_after)
        accepting = not (self._draining or self._stopping)
        stage_times = self._streams.take_stage_times(consumer_id)
        return PullReply(outputs, load, events, accepting, stage_times)

    async def abort(self, request_ids: list[str]) -> None:
        self._abort(list(request_ids))

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._streams.close(request_id)
            self._forget(request_id)
        self._inbox.put(AbortRequests(request_ids))

    async def stats(self) -> InstanceStats:
        num_streams = len(self._streams) + self._num_calls()
        return dataclasses.replace(self._stats, num_streams=num_streams, num_pulls=self._num_pulls)

    async def inject_fault(self, spec: FaultSpec | None) -> None:
        """Test-only (the fault-injection suite): arm a fault in this process, or disarm
        every one (None). PermissionError unless the process enables fault injection."""
        if spec is None:
            faults.disarm_all()
        else:
            faults.arm(spec)

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
            or self._num_calls()
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
        items, events = self._take_step(started_s, outputs)
        changed = self._publish_stats()
        if self._loop is not None and (items or events or changed):
            self._loop.call_soon_threadsafe(self._after_step, items, events, changed)
        return model_executed

    def _after_step(self, items: StepItems, events: KVEventBatch, changed: bool) -> None:
        """On the event loop: a step's outputs to their consumers, its prefix-cache events
        to the log; pulls hear of a changed load or cache."""
        for out, stage_times in items:
            self._route(out, stage_times)
        if events:
            self._kv_log.extend(events)
        if events or changed:
            self._streams.notify()

    def _route(self, out: EngineCoreOutput, stage_times: StageTimes | None) -> None:
        """On the event loop: an output to its consumer (with the request's stage times
        when it leaves here)."""
        self._streams.put(out, stage_times)

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
            # An adapter this instance cannot read (its folder missing on this node, say):
            # the gateway plans the request again, elsewhere if it can (router.migration_limit).
            moves = isinstance(exc, LoRAAdapterError)
            out = EngineCoreOutput(
                request.request_id, [], finish_reason="error", error=str(exc), unavailable=moves
            )
            self._deliver(out)
            return
        self._added(command)

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
            epoch=self.epoch,
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
