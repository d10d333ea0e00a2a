"""One request a gateway replica serves, as its outputs come in (plain data, no Ray)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdcluster.actors.front.accounting import Charge
from pdcluster.actors.front.bridge import Sink
from pdcluster.actors.messages import StageTimes
from pdcluster.engine.outputs import EngineCoreOutput
from pdcluster.engine.request import Request
from pdcluster.routing.policy import Plan


@dataclass
class Clock:
    """When a request started and reached its client (monotonic for latencies, wall clock
    for its trace, like `StageTimes`)."""

    started_s: float = field(default_factory=time.monotonic)
    started_wall_s: float = field(default_factory=time.time)
    first_token_s: float | None = None
    first_token_wall_s: float | None = None
    num_tokens: int = 0  # output tokens that reached the client

    def on_tokens(self, num_tokens: int, now: float) -> None:
        if num_tokens and self.first_token_s is None:
            self.first_token_s = now
            self.first_token_wall_s = time.time()
        self.num_tokens += num_tokens

    def latency(self, now: float) -> tuple[float, float | None] | None:
        """(TTFT, TPOT) in seconds at the end `now`; None when no token came."""
        if self.first_token_s is None:
            return None
        tpot = None
        if self.num_tokens > 1:
            tpot = (now - self.first_token_s) / (self.num_tokens - 1)
        return self.first_token_s - self.started_s, tpot


@dataclass
class Flight:
    """One request this replica serves, over all its attempts (one per plan)."""

    request: Request  # this attempt's: its id is the one instances know
    sink: Sink
    client_id: str  # the request id the caller knows
    origin: Request = field(init=False)  # the first attempt's: the client's request
    plan: Plan | None = None
    charge: Charge | None = None  # this attempt's load accounting, until released
    sources: set[str] = field(default_factory=set)  # instances whose outputs count now
    early: list[EngineCoreOutput] = field(default_factory=list)  # D's, before P's token
    # What reached the client: a move resumes after these tokens and this text.
    sent_token_ids: list[int] = field(default_factory=list)
    sent_text: str = ""
    attempts: int = 0  # plans so far: the first, then one per move
    clock: Clock = field(default_factory=Clock)
    stage_times: list[StageTimes] = field(default_factory=list)  # as instances let it go

    def __post_init__(self) -> None:
        self.origin = self.request

    @property
    def prefilling(self) -> bool:
        """Its P has not produced the first token yet."""
        return self.charge is not None and self.charge.prefill_on is not None


def error_output(request_id: str, message: str, unavailable: bool = False) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id, [], finish_reason="error", error=message, unavailable=unavailable
    )
