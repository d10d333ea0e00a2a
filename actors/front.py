"""Front: one gateway replica's client of the instance pool (control and data plane).

Each replica plans its own requests with a `RouterPolicy` (no call to any central actor),
submits them straight to the chosen instances, and reads its tokens straight from the
instance that generates them: one pull loop per instance carries the outputs of all of
this replica's requests there, one call per step, with the instance's load and its
prefix-cache events. P hands a request to its D itself (actors/instance.py), so the first
token comes from P and the rest from D, through no other process.

Faults: a request whose instance dies (or restarts, or leaves the pool, or reports that it
cannot serve it) moves: it is planned again on live instances as its prompt plus every token
its client got (routing/handoff.py `resume`), and the client's stream goes on from the next
token. After `migration_limit` moves it ends with finish_reason "error". Every instance
holding state for a request is told when it is aborted, fails or moves. The Front runs its Ray
calls on an event loop of its own thread, so callers on any event loop (a gateway's, or a
fresh `asyncio.run` per call) can stream; a gateway that serves on that loop itself
(`run_coroutine`) streams with no hop between threads: outputs go straight to its streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.actor import ActorHandle

from pdcluster.actors.messages import KVEvents, PullReply, RequestTrace, Route, StageTimes
from pdcluster.actors.pixels import by_reference
from pdcluster.actors.replies import Replies
from pdcluster.actors.streams import PULL_WAIT_S
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.request import Request
from pdcluster.routing.handoff import max_new_tokens, resume
from pdcluster.routing.policy import Load, Plan, RouterConfig, RouterPolicy

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 5.0  # an instance's stats call, when the caller names no bound
PULL_TIMEOUT_S = PULL_WAIT_S + 5.0  # a pull unanswered this long: its instance is unhealthy
RETRY_PULL_S = 0.5  # pause between pulls of an instance that failed
MEMBERS_POLL_S = 1.0  # how often the pool's membership is re-read
CLOSE_TIMEOUT_S = 10.0
LATENCY_REPORT_ROUNDS = 5  # membership polls between two latency reports to the planner
MAX_TRACES = 10_000  # finished requests' traces kept for `Front.traces`
TRACE_PROMPT_HEAD = 8  # prompt token ids a trace keeps

_FRONTS: weakref.WeakSet[Front] = weakref.WeakSet()


@dataclass(frozen=True)
class _Sink:
    """Where one request's batches go: a queue on the caller's event loop (the caller's
    index of the request with each batch)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[tuple[int, list[EngineCoreOutput]]]
    index: int


@dataclass
class _Flight:
    """One request this replica serves, as its outputs come in."""

    request: Request  # this attempt's: its id is the one instances know (see `_submit`)
    sink: _Sink
    client_id: str  # the request id the caller knows
    origin: Request = field(init=False)  # the first attempt's: the client's request
    plan: Plan | None = None
    sources: set[str] = field(default_factory=set)  # instances whose outputs count now
    # Where this replica's load accounting counts the request (see `_release`).
    encode_on: str | None = None
    prefill_on: str | None = None  # set while P has not produced the first token
    decode_on: str | None = None
    early: list[EngineCoreOutput] = field(default_factory=list)  # D's, before P's token
    # What reached the client: a move resumes after these tokens and this text.
    sent_token_ids: list[int] = field(default_factory=list)
    sent_text: str = ""
    attempts: int = 0  # plans so far: the first, then one per move
    started_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    num_tokens: int = 0
    started_wall_s: float = field(default_factory=time.time)  # for the trace, like:
    first_token_wall_s: float | None = None
    stage_times: list[StageTimes] = field(default_factory=list)  # as instances let it go

    def __post_init__(self) -> None:
        self.origin = self.request


class Front:
    """`members`: a callable returning {instance id: role}, or None when it cannot tell
    (polled for joins and leaves). `kv_pool_events`: a callable returning the cluster KV
    pool's events after a cursor (epoch, cursor), or None when it cannot tell (polled as
    the membership is; absent when there is no pool)."""

    def __init__(
        self,
        members: Callable[[], dict[str, str] | None],
        config: RouterConfig,
        report_latency: Callable[[float | None, float | None], None] | None = None,
        kv_pool_events: Callable[[str | None, int], KVEvents | None] | None = None,
    ) -> None:
        self.config = config
        self._kv_pool_events = kv_pool_events
        self._kv_pool_cursor: tuple[str | None, int] = (None, -1)
        self.replica_id = f"front-{uuid.uuid4().hex[:12]}"
        self._members = members
        self._report_latency = report_latency  # this replica's TTFT/TPOT p90, to the planner
        self._latencies: deque[tuple[float, float, float | None]] = deque(maxlen=1000)
        self._traces: deque[RequestTrace] = deque(maxlen=MAX_TRACES)
        self.policy = RouterPolicy({}, config)
        self._handles: dict[str, ActorHandle] = {}
        self._pullers: dict[str, asyncio.Task] = {}
        # Object ids of pulls in flight, and of recent ones: a pull is no leaked object.
        self._pulls_in_flight: set[str] = set()
        self._recent_pulls: deque[tuple[float, str]] = deque(maxlen=100_000)
        self._flights: dict[str, _Flight] = {}  # by the id instances know
        self._wire_ids: dict[str, str] = {}  # the caller's request id -> that id
        self.num_started = 0  # requests this replica has served (or is serving)
        self.num_moves = 0  # attempts planned again after their instance was lost
        # D instance id -> requests planned onto it that are still on their P
        self._promised: Counter[str] = Counter()
        # Batches for callers, by their event loop, until the end of this loop iteration
        self._outgoing: dict[asyncio.AbstractEventLoop, list[_Outgoing]] = {}
        self._loop = _new_event_loop()
        self._replies = Replies(self._loop)
        self._thread = threading.Thread(target=self._loop.run_forever, name="front", daemon=True)
        self._thread.start()
        self._call(self._sync_members).result()
        self._watcher = asyncio.run_coroutine_threadsafe(self._watch_members(), self._loop)
        _FRONTS.add(self)

    # ---- client API (any thread, any event loop) ---------------------------------------
    async def stream(self, request: Request) -> AsyncIterator[EngineCoreOutput]:
        """Outputs of one request as they arrive; leaving early aborts it everywhere."""
        async with contextlib.aclosing(self.stream_group([request])) as outputs:
            async for _, out in outputs:
                yield out

    async def stream_group(
        self, requests: list[Request]
    ) -> AsyncIterator[tuple[int, EngineCoreOutput]]:
        """(index in `requests`, output) as outputs arrive. The requests sample one prompt
        (a client's n > 1, see routing/fanout.py): they share one plan, so their P (or mixed
        instance) computes the prompt once and the others hit its prefix cache. Leaving
        early aborts every unfinished one everywhere."""
        loop = asyncio.get_running_loop()
        batches: asyncio.Queue[tuple[int, list[EngineCoreOutput]]] = asyncio.Queue()
        sinks = [_Sink(loop, batches, i) for i in range(len(requests))]
        self._on_loop(loop, self._start, requests, sinks)
        unfinished = set(range(len(requests)))
        try:
            while unfinished:
                index, batch = await batches.get()
                for out in batch:
                    if out.finished:
                        unfinished.discard(index)
                    yield index, out
        finally:
            if unfinished:
                rids = [requests[i].request_id for i in unfinished]
                self._on_loop(loop, self._abort, rids)

    def handles(self) -> dict[str, tuple[str, ActorHandle]]:
        """The pool as this replica sees it: instance id -> (role, handle)."""
        return {iid: (self.policy.instances[iid].role, h) for iid, h in self._handles.items()}

    def cluster_stats(self, timeout_s: float = STATS_TIMEOUT_S) -> Future[list[dict[str, Any]]]:
        """Every instance's stats; one that does not answer within `timeout_s` is unhealthy
        and, with only its id and role, `reachable: False`."""
        return self._call(self._stats(timeout_s))

    def traces(self) -> list[RequestTrace]:
        """The latest finished requests' traces (at most MAX_TRACES), oldest first."""
        return self._call(lambda: list(self._traces)).result()

    def num_in_flight(self) -> int:
        return len(self._wire_ids)

    def pull_object_ids(self, since: float) -> set[str]:
        """Object ids of pulls in flight or started after `since` (time.monotonic())."""
        recent = {i for t, i in list(self._recent_pulls) if t >= since}
        return set(self._pulls_in_flight) | recent

    def close(self) -> None:
        try:
            self._call(self._stop()).result(timeout=CLOSE_TIMEOUT_S)
        except TimeoutError:  # something blocked the loop: stop it all the same
            logger.warning("the front did not stop within %.0f s", CLOSE_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=CLOSE_TIMEOUT_S)

    def run_coroutine(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        """Run `coro` on the Front's event loop (e.g. the gateway's HTTP server, whose
        streams then get their outputs with no cross-thread hop)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _on_loop(self, caller: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
        """Run `fn(*args)` on the Front's loop: now when the caller is on it."""
        if caller is self._loop:
            fn(*args)
        else:
            self._loop.call_soon_threadsafe(fn, *args)

    def _call(self, coro_or_fn: Any) -> Any:
        if asyncio.iscoroutine(coro_or_fn):
            return asyncio.run_coroutine_threadsafe(coro_or_fn, self._loop)
        return asyncio.run_coroutine_threadsafe(_as_coro(coro_or_fn), self._loop)

    # ---- planning (the Front's thread from here on) ------------------------------------
    def _start(self, requests: list[Request], sinks: list[_Sink]) -> None:
        """Start a group of requests sampling one prompt, all on the first one's plan."""
        features = requests[0].mm_features
        if features:  # the caller's requests keep their pixels; ours refer to them
            features = by_reference(features)  # one put per image, for the whole group
        plan = None
        for request, sink in zip(requests, sinks):
            rid = request.request_id
            if rid in self._wire_ids:
                self._send(sink, rid, [_error(rid, f"request id {rid!r} is already in use")])
                continue
            if features:
                request = copy.copy(request)
                request.mm_features = features
            flight = self._flights[rid] = _Flight(request, sink, rid)
            self._wire_ids[rid] = rid
            self.num_started += 1
            self._submit(flight, plan)
            plan = plan or flight.plan

    def _submit(self, flight: _Flight, plan: Plan | None = None) -> None:
        """Plan the request (unless given its group's `plan`) and send it to its instances.
        Another attempt resumes after what the client got, under a new id: an instance that
        never saw the earlier one may still hold its abort."""
        flight.attempts += 1
        if flight.attempts > 1:
            rid = f"{flight.client_id}~{flight.attempts}"
            request = resume(flight.origin, rid, flight.sent_token_ids, flight.sent_text)
            del self._flights[flight.request.request_id]
            flight.request = request
            self._flights[request.request_id] = flight
            self._wire_ids[flight.client_id] = request.request_id
        request = flight.request
        try:
            plan = plan or self.policy.plan(
                request.prompt_token_ids, _images(request), request.cache_salt
            )
        except RuntimeError as exc:  # no live instance
            self._finish(flight, [_error(request.request_id, str(exc), unavailable=True)])
            return
        flight.plan, flight.early = plan, []
        ec_handle = None
        if plan.encoder_id is not None:
            flight.encode_on = plan.encoder_id
            self.policy.on_encode_start(plan.encoder_id)
            ec_handle = [self._handles[plan.encoder_id].encode.remote(request)]
        decode_id = plan.decode_id
        if plan.disaggregated and max_new_tokens(request, self.config.max_model_len) > 1:
            flight.prefill_on, flight.sources = plan.prefill_id, {plan.prefill_id, decode_id}
            self._promised[decode_id] += 1
            self.policy.on_prefill_start(
                plan.prefill_id, request.prompt_token_ids, _images(request), request.cache_salt
            )
            self._decode_started(flight, decode_id, cached=False)  # D's KV is spoken for
            route = Route(self.replica_id, ec_handle, decode_id)
            self._handles[plan.prefill_id].submit.remote(request, route)
            return
        target = plan.prefill_id or decode_id  # a one-token request ends on P
        flight.sources = {target}
        self._decode_started(flight, target)
        self._handles[target].submit.remote(request, Route(self.replica_id, ec_handle))

    def _decode_started(self, flight: _Flight, instance_id: str, cached: bool = True) -> None:
        request = flight.request
        flight.decode_on = instance_id
        self.policy.on_decode_start(
            instance_id,
            request.prompt_token_ids,
            max_new_tokens(request, self.config.max_model_len),
            _images(request),
            cached,
            request.cache_salt,
        )

    def _prefill_ended(self, flight: _Flight) -> None:
        """P is done with the request (and so is E: P used or gave up its outputs)."""
        if flight.prefill_on is not None:
            self.policy.on_prefill_end(flight.prefill_on, flight.request.num_prompt_tokens)
            self._promised[flight.plan.decode_id] -= 1
            flight.prefill_on = None
        if flight.encode_on is not None:
            self.policy.on_encode_end(flight.encode_on)
            flight.encode_on = None

    def _release(self, flight: _Flight) -> None:
        """Undo this attempt's accounting: its outputs are over, by end or failure."""
        self._prefill_ended(flight)
        if flight.decode_on is not None:
            request = flight.request
            max_tokens = max_new_tokens(request, self.config.max_model_len)
            self.policy.on_decode_end(flight.decode_on, request.num_prompt_tokens + max_tokens)
            flight.decode_on = None
        flight.sources = set()

    def _finish(self, flight: _Flight, batch: list[EngineCoreOutput]) -> None:
        self._flights.pop(flight.request.request_id, None)
        self._wire_ids.pop(flight.client_id, None)
        self._release(flight)
        self._deliver(flight, batch)
        self._trace(flight)
        if flight.first_token_s is not None:
            now = time.monotonic()
            tpot = None
            if flight.num_tokens > 1:
                tpot = (now - flight.first_token_s) / (flight.num_tokens - 1)
            self._latencies.append((now, flight.first_token_s - flight.started_s, tpot))

    def _trace(self, flight: _Flight) -> None:
        request = flight.origin
        trace = RequestTrace(
            flight.client_id,
            tuple(request.prompt_token_ids[:TRACE_PROMPT_HEAD]),
            request.num_prompt_tokens,
            flight.num_tokens,
            flight.started_wall_s,
            flight.first_token_wall_s,
            time.time(),
            flight.stage_times,
            flight.attempts - 1,
        )
        self._traces.append(trace)

    def latency_p90(self, window_s: float = 60.0) -> tuple[float | None, float | None]:
        """TTFT and TPOT p90 (ms) of the requests this replica finished in the window."""
        since = time.monotonic() - window_s
        recent = [(t, p) for end, t, p in self._latencies if end >= since]
        ttft = _p90([t for t, _ in recent])
        tpot = _p90([p for _, p in recent if p is not None])
        return ttft, tpot

    def _deliver(self, flight: _Flight, batch: list[EngineCoreOutput]) -> None:
        for out in batch:
            flight.sent_token_ids += out.new_token_ids
            flight.sent_text += out.new_text
        if flight.request.request_id != flight.client_id:  # a later attempt's outputs
            num_prompt = flight.origin.num_prompt_tokens  # a resumed prompt's cache is no hit
            batch = [
                dataclasses.replace(
                    o, request_id=flight.client_id,
                    num_cached_tokens=min(o.num_cached_tokens, num_prompt),
                )
                for o in batch
            ]  # fmt: skip
        self._send(flight.sink, flight.client_id, batch)

    def _send(self, sink: _Sink, client_id: str, batch: list[EngineCoreOutput]) -> None:
        """Hand a batch to its caller: at once on the Front's own loop; for another loop,
        what this loop iteration queued for it crosses threads in one call (`_flush`),
        however many requests and pulls it holds."""
        if sink.loop is self._loop:
            sink.queue.put_nowait((sink.index, batch))
            return
        if not self._outgoing:
            self._loop.call_soon(self._flush)
        self._outgoing.setdefault(sink.loop, []).append((sink, client_id, batch))

    def _flush(self) -> None:
        outgoing, self._outgoing = self._outgoing, {}
        for loop, items in outgoing.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's event loop is closed: nobody reads these
                self._abort([client_id for _, client_id, _ in items])

    def _abort(self, client_ids: list[str]) -> None:
        aborted = []
        for client_id in client_ids:
            flight = self._flights.pop(self._wire_ids.pop(client_id, ""), None)
            if flight is not None:
                self._release(flight)
                aborted.append((flight.plan, flight.request.request_id))
        self._abort_on(aborted)

    def _abort_on(self, requests: list[tuple[Plan | None, str]]) -> None:
        """Tell every instance of each (plan, request id): whichever holds the request's
        state drops it. One call per instance."""
        by_instance: dict[str, list[str]] = {}
        for plan, request_id in requests:
            if plan is not None:
                for iid in {plan.encoder_id, plan.prefill_id, plan.decode_id} - {None}:
                    by_instance.setdefault(iid, []).append(request_id)
        for iid, request_ids in by_instance.items():
            handle = self._handles.get(iid)
            if handle is not None:
                handle.abort.remote(request_ids)

    # ---- data plane --------------------------------------------------------------------
    def _dispatch(self, instance_id: str, outputs: list[EngineCoreOutput]) -> None:
        batches: dict[str, list[EngineCoreOutput]] = {}
        moving: list[tuple[_Flight, str]] = []
        for out in outputs:
            flight = self._flights.get(out.request_id)
            if flight is None or instance_id not in flight.sources:
                continue  # aborted, or from an attempt given up
            if out.unavailable and self._may_move(flight):  # its tokens go out, then it moves
                moving.append((flight, f"instance {instance_id}: {out.error}"))
                if not out.new_token_ids:
                    continue
                out = dataclasses.replace(out, finish_reason=None, error=None, unavailable=False)
            batch = self._on_output(flight, instance_id, out)
            if batch:
                batches.setdefault(out.request_id, []).extend(batch)
        now = time.monotonic()
        for rid, batch in batches.items():
            flight = self._flights.get(rid)
            num_tokens = sum(len(o.new_token_ids) for o in batch)
            if num_tokens and flight.first_token_s is None:
                flight.first_token_s = now
                flight.first_token_wall_s = time.time()
            flight.num_tokens += num_tokens
            if batch[-1].finished:
                self._finish(flight, batch)
            else:
                self._deliver(flight, batch)
        for flight, why in moving:
            self._move(flight, why)

    def _on_output(
        self, flight: _Flight, instance_id: str, out: EngineCoreOutput
    ) -> list[EngineCoreOutput]:
        """What of `out` goes to the client now. P's only output is its first token, handed
        off (not finished) or final (EOS, error, a one-token request)."""
        plan = flight.plan
        prefilling = flight.prefill_on is not None
        if prefilling and instance_id == plan.decode_id:
            flight.early.append(out)  # D outran P's token through the other pull loop
            return []
        if prefilling:  # from P
            self._prefill_ended(flight)
            if out.finished:
                flight.sources = set()
                return [out]
            flight.sources = {plan.decode_id}
            request = flight.request
            self.policy.on_prompt_cached(
                plan.decode_id, request.prompt_token_ids, _images(request), request.cache_salt
            )
            batch, flight.early = [out, *flight.early], []
            return batch
        return [out]

    def _instance_lost(self, instance_id: str, reason: str) -> None:
        """The instance died, restarted or left: its requests move (or, moved too often,
        fail); the other holders drop their state."""
        self.policy.mark_dead(instance_id)
        for flight in [f for f in self._flights.values() if instance_id in f.sources]:
            self._move(flight, f"instance {instance_id} {reason}")

    def _may_move(self, flight: _Flight) -> bool:
        return flight.attempts <= self.config.migration_limit

    def _move(self, flight: _Flight, why: str) -> None:
        """This attempt is over (`why`): every instance of its plan drops it, and the
        request is planned again after what its client got, or fails once it has moved
        `migration_limit` times."""
        rid = flight.request.request_id
        self._release(flight)
        self._abort_on([(flight.plan, rid)])
        if not self._may_move(flight):
            message = f"{why} serving the request (moved {flight.attempts - 1} times)"
            self._finish(flight, [_error(rid, message, unavailable=True)])
            return
        logger.warning(
            "request %r: %s after %d tokens; moving it (%d of at most %d moves)",
            flight.client_id, why, len(flight.sent_token_ids), flight.attempts,
            self.config.migration_limit,
        )  # fmt: skip
        self.num_moves += 1
        self._submit(flight)

    async def _pull_loop(self, instance_id: str) -> None:
        """Read one instance for as long as it is a member."""
        handle = self._handles[instance_id]
        epoch: str | None = None
        cursor = -1
        while True:
            ref = handle.pull.remote(
                self.replica_id, epoch, cursor, self._promised.get(instance_id, 0)
            )
            ref_id = ref.hex()
            self._pulls_in_flight.add(ref_id)
            self._recent_pulls.append((time.monotonic(), ref_id))
            try:
                reply = await self._pull_reply(instance_id, ref)
            except ray.exceptions.RayActorError:
                if self.policy.instances[instance_id].healthy or epoch is not None:
                    self._instance_lost(instance_id, "died")
                epoch, cursor = None, -1
                await asyncio.sleep(RETRY_PULL_S)
                continue
            finally:
                self._pulls_in_flight.discard(ref_id)
            events = reply.events
            if epoch is not None and events.epoch != epoch:
                self._instance_lost(instance_id, "restarted")
            epoch, cursor = events.epoch, events.cursor
            self._apply(instance_id, reply)

    async def _pull_reply(self, instance_id: str, ref: ray.ObjectRef) -> PullReply:
        """A pull's reply. One unanswered for PULL_TIMEOUT_S routes new requests around its
        instance, and is still waited for: the outputs it carries are its streams'."""
        late = self._loop.call_later(PULL_TIMEOUT_S, self._unanswered, instance_id)
        try:
            return await self._replies.future(ref)
        finally:
            late.cancel()

    def _unanswered(self, instance_id: str) -> None:
        logger.warning("instance %s does not answer; routing around it", instance_id)
        self.policy.mark_dead(instance_id)

    def _apply(self, instance_id: str, reply: PullReply) -> None:
        policy = self.policy
        if reply.accepting:
            policy.mark_alive(instance_id)
        else:
            policy.mark_dead(instance_id)
        load = reply.load
        policy.apply_report(
            instance_id,
            Load(load.num_active, load.queued_prefill_tokens, load.kv_tokens),
            load.num_blocks_total,
        )
        events = reply.events
        policy.apply_kv_events(instance_id, events.stored, events.removed, events.reset)
        for stage_times in reply.stage_times:  # before the outputs, which may end the flight
            flight = self._flights.get(stage_times.request_id)
            if flight is not None:
                flight.stage_times.append(stage_times)
        if reply.outputs:
            self._dispatch(instance_id, reply.outputs)

    # ---- membership --------------------------------------------------------------------
    async def _watch_members(self) -> None:
        """Poll the membership; now and then tell the planner this replica's latencies."""
        for round_index in itertools.count(1):
            await asyncio.sleep(MEMBERS_POLL_S)
            try:
                await self._sync_members_async()
                await self._sync_kv_pool_async()
                if self._report_latency and round_index % LATENCY_REPORT_ROUNDS == 0:
                    await asyncio.get_running_loop().run_in_executor(
                        None, self._report_latency, *self.latency_p90()
                    )
            except Exception:  # noqa: BLE001 - a failed read keeps the last membership
                logger.exception("reading the instance pool failed")

    async def _sync_members_async(self) -> None:
        """Read the membership and look up joined instances' handles off the loop (both
        are blocking Ray calls), then apply it."""
        lookup = self._members_with_handles
        members, handles = await asyncio.get_running_loop().run_in_executor(None, lookup)
        self._apply_members(members, handles)

    async def _sync_kv_pool_async(self) -> None:
        """Read the cluster KV pool's events since the last read (a blocking Ray call, off
        the loop) into the routing policy."""
        if self._kv_pool_events is None:
            return
        read = self._kv_pool_events
        events = await asyncio.get_running_loop().run_in_executor(None, read, *self._kv_pool_cursor)
        if events is None:
            return
        reset = events.reset or events.epoch != self._kv_pool_cursor[0]
        self.policy.apply_pool_events(events.stored, events.removed, reset)
        self._kv_pool_cursor = (events.epoch, events.cursor)

    def _sync_members(self) -> None:
        self._apply_members(*self._members_with_handles())

    def _members_with_handles(
        self,
    ) -> tuple[dict[str, str] | None, dict[str, ActorHandle]]:
        members = self._members()
        joined = [iid for iid in members or () if iid not in self._handles]
        handles = {}
        for iid in joined:
            with contextlib.suppress(ValueError):  # gone again already
                handles[iid] = ray.get_actor(iid)
        return members, handles

    def _apply_members(
        self, members: dict[str, str] | None, handles: dict[str, ActorHandle]
    ) -> None:
        """Start pulling joined instances, drop left ones; None (unknown) changes nothing."""
        if members is None:
            return
        for iid, handle in handles.items():
            if iid not in self._handles:
                self._handles[iid] = handle
                self.policy.add_instance(iid, members[iid])
                self._pullers[iid] = self._loop.create_task(self._pull_loop(iid))
        for iid in set(self._handles) - set(members):
            self._pullers.pop(iid).cancel()
            self._instance_lost(iid, "left the pool")
            self.policy.remove_instance(iid)
            del self._handles[iid]
            self._promised.pop(iid, None)

    async def _stats(self, timeout_s: float) -> list[dict[str, Any]]:
        ids = list(self._handles)
        results = await asyncio.gather(
            *(_answer(self._handles[i].stats.remote(), timeout_s) for i in ids),
            return_exceptions=True,
        )
        stats = []
        for iid, result in zip(ids, results):
            load = self.policy.instances[iid]
            ok = not isinstance(result, BaseException)
            stats.append({**(result if ok else {"id": iid, "role": load.role}),
                          "healthy": load.healthy and ok, "reachable": ok})  # fmt: skip
        return stats

    async def _stop(self) -> None:
        self._abort(list(self._wire_ids))
        tasks = [*self._pullers.values(), asyncio.wrap_future(self._watcher)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


_Outgoing = tuple[_Sink, str, list[EngineCoreOutput]]  # (sink, the caller's request id, batch)


def _put_all(items: list[_Outgoing]) -> None:
    """On the caller's event loop: hand each batch to its stream."""
    for sink, _, batch in items:
        sink.queue.put_nowait((sink.index, batch))


def _new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's where it is installed (ray[serve] brings it, with uvicorn[standard]): the loop
    uvicorn would serve on, for a gateway served from the Front's loop; else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def _as_coro(fn: Callable[[], Any]) -> Any:
    return fn()


async def _answer(ref: Any, timeout_s: float) -> Any:
    return await asyncio.wait_for(ref, timeout_s)


def _p90(values: list[float]) -> float | None:
    """The 90th percentile in milliseconds; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] * 1000


def _images(request: Request) -> list[tuple[int, int, str]]:
    return [(f.offset, f.end, f.mm_hash) for f in request.mm_features]


def _error(request_id: str, message: str, unavailable: bool = False) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id, [], finish_reason="error", error=message, unavailable=unavailable
    )


def pull_object_ids(since: float) -> set[str]:
    """`Front.pull_object_ids` of every Front of this process: objects that are no leak."""
    return {i for front in list(_FRONTS) for i in front.pull_object_ids(since)}
