"""Stage times of the requests on one instance: when each arrived, was first run, produced
its first token and left (see `actors.messages.StageTimes`). Plain Python, used by the
instance's step thread only; stamps have step granularity."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pdcluster.actors.messages import StageTimes
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.routing.role import Role


@dataclass
class _Stamps:
    received_s: float
    scheduled_s: float | None = None
    first_token_s: float | None = None


class StageClock:
    def __init__(self, instance_id: str, role: Role) -> None:
        self.instance_id = instance_id
        self.role = role
        self._open: dict[str, _Stamps] = {}
        self._unscheduled: set[str] = set()  # open and not yet run

    def __len__(self) -> int:
        return len(self._open)

    def received(self, request_id: str, received_s: float) -> None:
        self._open[request_id] = _Stamps(received_s)
        self._unscheduled.add(request_id)

    def after_step(
        self,
        started_s: float,
        ended_s: float,
        running_ids: Iterable[str],
        outputs: list[EngineCoreOutput],
    ) -> dict[str, StageTimes]:
        """Stamp the step that ran from `started_s` to `ended_s` (`running_ids`: the
        requests running after it); returns the stage times of the requests whose last
        output here it produced (a finished output), which are forgotten."""
        if self._unscheduled:
            for rid in running_ids:
                if rid in self._unscheduled:
                    self._open[rid].scheduled_s = started_s
                    self._unscheduled.discard(rid)
        done: dict[str, StageTimes] = {}
        for out in outputs:
            stamps = self._open.get(out.request_id)
            if stamps is None:
                continue
            if stamps.scheduled_s is None:  # ran and finished within this step
                stamps.scheduled_s = started_s
                self._unscheduled.discard(out.request_id)
            if out.new_token_ids and stamps.first_token_s is None:
                stamps.first_token_s = ended_s
            if out.finished:
                done[out.request_id] = self._close(out.request_id, ended_s)
        return done

    def forget(self, request_ids: Iterable[str]) -> None:
        """Requests that ended without a last output from a step (aborted, failed)."""
        for rid in request_ids:
            self._open.pop(rid, None)
            self._unscheduled.discard(rid)

    def _close(self, request_id: str, finished_s: float) -> StageTimes:
        stamps = self._open.pop(request_id)
        return StageTimes(
            request_id,
            self.instance_id,
            self.role,
            stamps.received_s,
            stamps.scheduled_s,
            stamps.first_token_s,
            finished_s,
        )
