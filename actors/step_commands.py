"""What an instance's event loop tells its step thread, through the thread's inbox. The step
thread alone touches the engine; each command is handled between two steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdcluster.engine.request import Request


@dataclass(frozen=True)
class AddRequest:
    request: Request
    received_s: float  # `submit` (or `encode`) reached the instance, time.time()
    ec_handle: list[Any] | None = None  # refs of an E's encode call for this request's images


@dataclass(frozen=True)
class AbortRequests:
    request_ids: list[str]  # their streams are closed already


@dataclass(frozen=True)
class Wake:
    """Nothing to do but look again: an ack, a resume, encoder outputs that landed, or
    shutdown ends the step thread's wait."""


WAKE = Wake()

StepCommand = AddRequest | AbortRequests | Wake
