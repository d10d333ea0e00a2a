"""The requests one gateway replica serves: each planned onto instances, its instances'
outputs turned into its client's batches, and moved when an instance it needs is lost.

A request whose instance dies (or restarts, or leaves the pool, or reports that it cannot
serve it) moves: it is planned again on live instances as its prompt plus every token its
client got (routing/handoff.py `resume`), and the client's stream goes on from the next
token. After `migration_limit` moves it ends with finish_reason "error". Every instance
holding state for a request is told when it is aborted, fails or moves. P hands a request
to its D itself, so its first token comes from P and the rest from D.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from pdcluster.actors.front.accounting import Accounting, images
from pdcluster.actors.front.bridge import Sink
from pdcluster.actors.front.flight import Flight, error_output
from pdcluster.actors.messages import Route, StageTimes
from pdcluster.actors.pixels import by_reference
from pdcluster.engine.kv_cache_manager import request_root
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.request import Request
from pdcluster.routing.handoff import resume
from pdcluster.routing.policy import Plan, RouterConfig, RouterPolicy

logger = logging.getLogger(__name__)


class InstanceCalls(Protocol):
    """What flights ask of the instances (instances.py `Instances`)."""

    def encode(self, instance_id: str, request: Request) -> list[Any]: ...
    def submit(self, instance_id: str, request: Request, route: Route) -> None: ...
    def abort(self, instance_id: str, request_ids: list[str]) -> None: ...


class Flights:
    """The replica's requests in flight, by the id instances know and the caller's id."""

    def __init__(
        self,
        replica_id: str,
        policy: RouterPolicy,
        config: RouterConfig,
        instances: InstanceCalls,
        send: Callable[[Sink, str, list[EngineCoreOutput]], None],
        on_finished: Callable[[Flight], None],
    ) -> None:
        self.replica_id = replica_id
        self.policy = policy
        self.config = config
        self.accounting = Accounting(policy, config.max_model_len)
        self._instances = instances
        self._send = send
        self._on_finished = on_finished  # after its last batch was sent
        self._flights: dict[str, Flight] = {}  # by the id instances know
        self._wire_ids: dict[str, str] = {}  # the caller's request id -> that id
        self.num_started = 0  # requests this replica has served (or is serving)
        self.num_moves = 0  # attempts planned again after their instance was lost

    def __len__(self) -> int:
        return len(self._wire_ids)

    def client_ids(self) -> list[str]:
        return list(self._wire_ids)

    # ---- planning ----------------------------------------------------------------------
    def start(self, requests: list[Request], sinks: list[Sink]) -> None:
        """Start a group of requests sampling one prompt, all on the first one's plan."""
        features = requests[0].mm_features
        if features:  # the caller's requests keep their pixels; ours refer to them
            features = by_reference(features)  # one put per image, for the whole group
        plan = None
        for request, sink in zip(requests, sinks):
            rid = request.request_id
            if rid in self._wire_ids:
                self._send(sink, rid, [error_output(rid, f"request id {rid!r} is already in use")])
                continue
            if features:
                request = copy.copy(request)
                request.mm_features = features
            flight = self._flights[rid] = Flight(request, sink, rid)
            self._wire_ids[rid] = rid
            self.num_started += 1
            self._submit(flight, plan)
            plan = plan or flight.plan

    def _submit(self, flight: Flight, plan: Plan | None = None) -> None:
        """Plan the request (unless given its group's `plan`) and send it to its instances.
        Another attempt resumes after what the client got, under a new id: an instance that
        never saw the earlier one may still hold its abort."""
        flight.attempts += 1
        if flight.attempts > 1:
            self._new_attempt(flight)
        request = flight.request
        try:
            lora = request.lora_request
            plan = plan or self.policy.plan(
                request.prompt_token_ids, images(request), request_root(request),
                None if lora is None else lora.name,
            )  # fmt: skip
        except RuntimeError as exc:  # no live instance
            self._finish(flight, [error_output(request.request_id, str(exc), unavailable=True)])
            return
        flight.plan, flight.early = plan, []
        charge = flight.charge = self.accounting.start(request, plan)
        ec_handle = None
        if plan.encoder_id is not None:
            ec_handle = self._instances.encode(plan.encoder_id, request)
        if charge.prefill_on is not None:  # P hands the request to D after its first token
            flight.sources = {plan.prefill_id, plan.decode_id}
            route = Route(self.replica_id, ec_handle, plan.decode_id)
            self._instances.submit(plan.prefill_id, request, route)
            return
        flight.sources = {charge.decode_on}
        self._instances.submit(charge.decode_on, request, Route(self.replica_id, ec_handle))

    def _new_attempt(self, flight: Flight) -> None:
        rid = f"{flight.client_id}~{flight.attempts}"
        request = resume(flight.origin, rid, flight.sent_token_ids, flight.sent_text)
        del self._flights[flight.request.request_id]
        flight.request = request
        self._flights[rid] = flight
        self._wire_ids[flight.client_id] = rid

    # ---- outputs -----------------------------------------------------------------------
    def add_stage_times(self, stage_times: list[StageTimes]) -> None:
        for times in stage_times:
            flight = self._flights.get(times.request_id)
            if flight is not None:
                flight.stage_times.append(times)

    def dispatch(self, instance_id: str, outputs: list[EngineCoreOutput]) -> None:
        """Outputs of one pull of `instance_id`: to their clients, one batch per request;
        a request whose instance cannot serve it sends what it has, then moves."""
        batches: dict[str, list[EngineCoreOutput]] = {}
        moving: list[tuple[Flight, str]] = []
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
            flight = self._flights[rid]
            flight.clock.on_tokens(sum(len(o.new_token_ids) for o in batch), now)
            if batch[-1].finished:
                self._finish(flight, batch)
            else:
                self._deliver(flight, batch)
        for flight, why in moving:
            self._move(flight, why)

    def _on_output(
        self, flight: Flight, instance_id: str, out: EngineCoreOutput
    ) -> list[EngineCoreOutput]:
        """What of `out` goes to the client now. P's only output is its first token, handed
        off (not finished) or final (EOS, error, a one-token request)."""
        plan = flight.plan
        if flight.prefilling and instance_id == plan.decode_id:
            flight.early.append(out)  # D outran P's token through the other pull loop
            return []
        if flight.prefilling:  # from P
            self.accounting.prefill_ended(flight.charge)
            if out.finished:
                flight.sources = set()
                return [out]
            flight.sources = {plan.decode_id}
            self.accounting.prompt_cached(flight.charge)
            batch, flight.early = [out, *flight.early], []
            return batch
        return [out]

    def _finish(self, flight: Flight, batch: list[EngineCoreOutput]) -> None:
        self._flights.pop(flight.request.request_id, None)
        self._wire_ids.pop(flight.client_id, None)
        self._release(flight)
        self._deliver(flight, batch)
        self._on_finished(flight)

    def _deliver(self, flight: Flight, batch: list[EngineCoreOutput]) -> None:
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

    def _release(self, flight: Flight) -> None:
        """Undo this attempt's accounting: its outputs are over, by end or failure."""
        if flight.charge is not None:
            self.accounting.release(flight.charge)
        flight.sources = set()

    # ---- faults and aborts -------------------------------------------------------------
    def instance_lost(self, instance_id: str, reason: str) -> None:
        """The instance died, restarted or left: its requests move (or, moved too often,
        fail); the other holders drop their state."""
        self.policy.mark_dead(instance_id)
        for flight in [f for f in self._flights.values() if instance_id in f.sources]:
            self._move(flight, f"instance {instance_id} {reason}")

    def _may_move(self, flight: Flight) -> bool:
        return flight.attempts <= self.config.migration_limit

    def _move(self, flight: Flight, why: str) -> None:
        """This attempt is over (`why`): every instance of its plan drops it, and the
        request is planned again after what its client got, or fails once it has moved
        `migration_limit` times."""
        rid = flight.request.request_id
        self._release(flight)
        self._abort_on([(flight.plan, rid)])
        if not self._may_move(flight):
            message = f"{why} serving the request (moved {flight.attempts - 1} times)"
            self._finish(flight, [error_output(rid, message, unavailable=True)])
            return
        logger.warning(
            "request %r: %s after %d tokens; moving it (%d of at most %d moves)",
            flight.client_id, why, len(flight.sent_token_ids), flight.attempts,
            self.config.migration_limit,
        )  # fmt: skip
        self.num_moves += 1
        self._submit(flight)

    def abort(self, client_ids: list[str]) -> None:
        """The callers left these requests: every instance holding one drops it."""
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
            self._instances.abort(iid, request_ids)
