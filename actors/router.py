"""RouterActor: runs the E->P->D flow of DESIGN.md for each request and streams tokens back.

E and P get their work at once (P defers the request until E's output is local); P runs the
prompt with max_tokens=1 and hands D the KV through `kv_transfer_params`; D streams the
rest. Any instance holding state for a request is told when the request is aborted or
when another instance of it dies.

Faults: an instance that dies before anything of the request reached the client (P while
prefilling, D of a colocated request) is routed around: the request is planned again, once.
One that dies later (D in transfer or decoding) ends the request with finish_reason "error";
the survivors are told to abort, so P frees the KV it held for the dead D at once. A health
loop marks instances dead and, once Ray has restarted them, alive again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import ray
from ray.actor import ActorHandle

from actors.streams import OutputStreams, reap_orphans
from cluster.router import Plan, RouterConfig, RouterPolicy
from engine.outputs import EngineCoreOutput
from engine.request import Request

logger = logging.getLogger(__name__)

HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 5.0
MAX_RETRIES = 1  # plans of a request after its instance died before it yielded anything


class InstanceDied(RuntimeError):
    """An instance's actor died (or restarted) while it served a request."""


class RouterActor:
    """Wrap with `ray.remote(RouterActor)`. `roles`: instance id (its actor's name) -> role.
    Instances are found by name, so a restarted router finds them again."""

    def __init__(self, roles: dict[str, str], config: RouterConfig) -> None:
        self.config = config
        self.handles: dict[str, ActorHandle] = {iid: ray.get_actor(iid) for iid in roles}
        self.policy = RouterPolicy(dict(roles), config)
        self._holders: dict[str, set[str]] = {}  # request id -> instances holding its state
        self._tasks: dict[str, asyncio.Task] = {}  # request id -> the task serving it
        self._streams = OutputStreams(config.stream_idle_timeout_s)
        self._background: list[asyncio.Task] = []

    # ---- public API --------------------------------------------------------------------
    async def generate(self, request: Request) -> list[EngineCoreOutput]:
        """Start serving a request; returns its first batch of outputs, `next_outputs` the
        rest (see actors/streams.py). A stream its client stops reading is aborted."""
        self._start_background_tasks()
        rid = request.request_id
        if self._streams.aborted_before_start(rid):
            return [EngineCoreOutput(rid, [], finish_reason="abort")]
        if rid in self._tasks or rid in self._streams:
            return [_error(rid, f"request id {rid!r} is already in use")]
        self._streams.open(rid)
        task = asyncio.get_running_loop().create_task(self._run(request))
        task.add_done_callback(lambda _: self._tasks.pop(rid, None))  # even if never run
        self._tasks[rid] = task
        return await self._streams.next_batch(rid)

    async def next_outputs(self, request_id: str) -> list[EngineCoreOutput]:
        """The outputs a started request produced since the last call (at least one)."""
        return await self._streams.next_batch(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop serving a request: it is aborted everywhere it holds state (queued,
        deferred, prefilling, held for D, loading on D, decoding)."""
        self._abort([request_id])

    async def cluster_stats(self) -> list[dict[str, Any]]:
        ids = list(self.handles)
        results = await asyncio.gather(
            *(self.handles[i].stats.remote() for i in ids), return_exceptions=True
        )
        stats = []
        for iid, result in zip(ids, results):
            load = self.policy.instances[iid]
            if isinstance(result, BaseException):
                result = {"id": iid, "role": load.role}
            stats.append(
                {**result, "healthy": load.healthy and not isinstance(result, BaseException)}
            )
        return stats

    async def num_in_flight(self) -> int:
        """Requests being served, or whose outputs await their client."""
        return len(self._tasks.keys() | set(self._streams))

    # ---- flows -------------------------------------------------------------------------
    async def _run(self, request: Request) -> None:
        """Serve one request into its stream; cancelled by `abort`."""
        rid = request.request_id
        self._holders[rid] = set()
        finished = False
        try:
            async for batch in self._serve(request):
                finished = batch[-1].finished
                for out in batch:
                    self._streams.put(out)
        except RuntimeError as exc:  # no live instance, or one died mid-request
            self._abort_holders(rid)  # survivors may hold its state, e.g. P's KV for a dead D
            finished = True
            self._streams.put(_error(rid, str(exc)))
        finally:
            if not finished:
                self._abort_holders(rid)
            del self._holders[rid]

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            task = self._tasks.get(rid)
            if task is not None:
                task.cancel()  # its `finally` aborts the request on the instances
            self._streams.close(rid)

    def _abort_holders(self, request_id: str) -> None:
        for iid in self._holders.get(request_id, ()):
            self.handles[iid].abort.remote([request_id])

    async def _serve(self, request: Request) -> AsyncIterator[list[EngineCoreOutput]]:
        """Plan and run the request. When an instance dies before anything reached the
        client, the request is planned again, once, around it (a second death is an error:
        a request that kills instances must not take the whole cluster down)."""
        rid = request.request_id
        for attempt in range(1 + MAX_RETRIES):
            plan = self.policy.plan(request.prompt_token_ids, _images(request))
            flow = self._disaggregated if plan.disaggregated else self._colocated
            yielded = False
            try:
                async for batch in flow(plan, request):
                    yielded = True
                    yield batch
                return
            except InstanceDied as exc:
                if yielded or attempt == MAX_RETRIES:
                    raise
                logger.warning("request %r: %s; planning it again", rid, exc)
                self._abort_holders(rid)  # e.g. E's encode for the lost attempt
                self._holders[rid] = set()

    async def _colocated(
        self, plan: Plan, request: Request
    ) -> AsyncIterator[list[EngineCoreOutput]]:
        ec_handle = self._start_encode(plan, request)
        try:
            async for batch in self._decode_on(plan.decode_id, request, ec_handle):
                yield batch
        finally:
            self._encode_done(plan)

    async def _disaggregated(
        self, plan: Plan, request: Request
    ) -> AsyncIterator[list[EngineCoreOutput]]:
        ec_handle = self._start_encode(plan, request)
        prefill_request = _for_prefill(request)
        self.policy.on_prefill_start(plan.prefill_id, request.prompt_token_ids, _images(request))
        last = None
        try:
            async for batch in self._stream(plan.prefill_id, prefill_request, ec_handle):
                last = batch[-1]
        finally:
            self.policy.on_prefill_end(plan.prefill_id, request.num_prompt_tokens)
            self._encode_done(plan)  # E's output was used (or given up on) by now
        if last is None:
            yield [_error(request.request_id, "prefill returned nothing")]
            return
        continues = last.finish_reason == "length" and not _done_after_first_token(
            request, self.config
        )
        if not continues or last.kv_transfer_params is None:
            if last.kv_transfer_params is not None:  # nobody will read the KV: free it now
                self.handles[plan.prefill_id].abort.remote([request.request_id])
            yield [dataclasses.replace(last, kv_transfer_params=None)]
            return  # error, abort, EOS, a stop string or max_tokens reached on P
        decode_request = _for_decode(request, last.new_token_ids[0], last.kv_transfer_params)
        yield [dataclasses.replace(last, finish_reason=None, kv_transfer_params=None)]
        del last  # from here on only the decode request refers to P's KV
        async for batch in self._decode_on(plan.decode_id, decode_request, None):
            yield batch

    async def _decode_on(
        self, instance_id: str, request: Request, ec_handle: list[ray.ObjectRef] | None
    ) -> AsyncIterator[list[EngineCoreOutput]]:
        """Stream `request` from the instance that decodes it, counting the KV tokens it
        holds there for the load policy meanwhile."""
        max_tokens = _max_tokens(request, self.config)
        self.policy.on_decode_start(
            instance_id, request.prompt_token_ids, max_tokens, _images(request)
        )
        try:
            async for batch in self._stream(instance_id, request, ec_handle):
                yield batch
        finally:
            self.policy.on_decode_end(instance_id, request.num_prompt_tokens + max_tokens)

    def _start_encode(self, plan: Plan, request: Request) -> list[ray.ObjectRef] | None:
        """Send the images to E without waiting; P gets the call's ref as its EC handle."""
        if plan.encoder_id is None:
            return None
        self._holders[request.request_id].add(plan.encoder_id)
        self.policy.on_encode_start(plan.encoder_id)
        return [self.handles[plan.encoder_id].encode.remote(request)]

    def _encode_done(self, plan: Plan) -> None:
        if plan.encoder_id is not None:
            self.policy.on_encode_end(plan.encoder_id)

    async def _stream(
        self, instance_id: str, request: Request, ec_handle: list[ray.ObjectRef] | None
    ) -> AsyncIterator[list[EngineCoreOutput]]:
        rid = request.request_id
        self._holders[rid].add(instance_id)
        handle = self.handles[instance_id]
        finished = False
        try:
            batch = await handle.generate.remote(request, ec_handle)
            while True:
                finished = batch[-1].finished
                yield batch
                if finished:
                    return
                batch = await handle.next_outputs.remote(rid)
        except ray.exceptions.RayActorError as exc:
            self.policy.mark_dead(instance_id)
            raise InstanceDied(f"instance {instance_id} died serving the request") from exc
        finally:
            if not finished:
                handle.abort.remote([rid])

    # ---- health ------------------------------------------------------------------------
    def _start_background_tasks(self) -> None:
        if not self._background:
            loop = asyncio.get_running_loop()
            self._background = [
                loop.create_task(self._health_loop()),
                loop.create_task(reap_orphans(self._streams, self._abort)),
            ]

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            for iid, handle in self.handles.items():
                if await _answers_health_check(handle):
                    self.policy.mark_alive(iid)
                elif self.policy.instances[iid].healthy:
                    logger.warning("instance %s is unhealthy; routing around it", iid)
                    self.policy.mark_dead(iid)


async def _answers_health_check(handle: ActorHandle) -> bool:
    """Whether the instance reports itself healthy in time. A failed call's error is read
    off its future, never raised: a raised error's traceback would put the call's ref in a
    reference cycle, keeping its object alive until the next garbage collection."""
    future = asyncio.wrap_future(handle.health.remote().future())
    done, _ = await asyncio.wait([future], timeout=HEALTH_TIMEOUT_S)
    if not done:
        future.cancel()
        return False
    return future.exception() is None and bool(future.result())


def _images(request: Request) -> list[tuple[int, int, str]]:
    return [(f.offset, f.end, f.mm_hash) for f in request.mm_features]


def _max_tokens(request: Request, config: RouterConfig) -> int:
    room = config.max_model_len - request.num_prompt_tokens
    asked = request.sampling_params.max_tokens
    return room if asked is None else min(asked, room)


def _done_after_first_token(request: Request, config: RouterConfig) -> bool:
    return _max_tokens(request, config) <= 1


def _for_prefill(request: Request) -> Request:
    """P computes the prompt and one token, then holds the KV for D."""
    params = dataclasses.replace(request.sampling_params, max_tokens=1, min_tokens=0)
    return _copy(request, request.prompt_token_ids, params, {"do_remote_decode": True})


def _for_decode(request: Request, first_token: int, kv_transfer_params: dict) -> Request:
    """D continues after P's first token, reading the prompt's KV from P."""
    p = request.sampling_params
    params = dataclasses.replace(
        p,
        max_tokens=None if p.max_tokens is None else p.max_tokens - 1,
        min_tokens=max(0, p.min_tokens - 1),
    )
    return _copy(request, [*request.prompt_token_ids, first_token], params, kv_transfer_params)


def _copy(request: Request, prompt: list[int], params, kv_transfer_params: dict) -> Request:
    return Request(
        request.request_id,
        prompt,
        params,
        eos_token_ids=request.eos_token_ids,
        mm_features=request.mm_features,
        kv_transfer_params=kv_transfer_params,
        arrival_time=request.arrival_time,
    )


def _error(request_id: str, message: str) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, [], finish_reason="error", error=message)
