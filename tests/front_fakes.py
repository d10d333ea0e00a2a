"""Fake instance actors for the Front's unit tests (tests/test_front_*.py): handles whose
`.method.remote(...)` calls are recorded, and pulls answered by the test. No Ray."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from pdcluster.actors.messages import KVEvents, LoadReport, PullReply
from pdcluster.engine.outputs import EngineCoreOutput

IDLE = LoadReport(0, 0, 0, 16, 16)


class FakeRef:
    """An object ref the test answers (from any thread), as Ray's core worker would."""

    def __init__(self, object_id: str, args: tuple) -> None:
        self.object_id = object_id
        self.args = args
        self._callback: Callable[[Any], None] | None = None
        self._value: Any = None
        self._answered = False
        self._lock = threading.Lock()

    def hex(self) -> str:
        return self.object_id

    def _on_completed(self, callback: Callable[[Any], None]) -> None:
        with self._lock:
            self._callback = callback
            if not self._answered:
                return
        callback(self._value)

    def answer(self, value: Any) -> None:
        with self._lock:
            self._value, self._answered = value, True
            callback = self._callback
        if callback is not None:
            callback(value)


class _Method:
    def __init__(self, handle: FakeHandle, name: str) -> None:
        self._handle, self._name = handle, name

    def remote(self, *args: Any) -> Any:
        return self._handle.called(self._name, args)


class FakeHandle:
    """An instance actor: records every call; `pull` returns a `FakeRef` to answer."""

    def __init__(self, instance_id: str) -> None:
        self.instance_id = instance_id
        self.calls: list[tuple[str, tuple]] = []
        self.pulls: list[FakeRef] = []
        self._pulled = threading.Condition()

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def called(self, name: str, args: tuple) -> Any:
        self.calls.append((name, args))
        if name != "pull":
            return None
        with self._pulled:
            ref = FakeRef(f"{self.instance_id}-pull-{len(self.pulls)}", args)
            self.pulls.append(ref)
            self._pulled.notify_all()
            return ref

    def next_pull(self, index: int, timeout_s: float = 5.0) -> FakeRef:
        """The `index`-th pull (0 first), once the replica made it."""
        with self._pulled:
            assert self._pulled.wait_for(lambda: len(self.pulls) > index, timeout_s)
            return self.pulls[index]

    def names(self, name: str) -> list[tuple]:
        return [args for n, args in self.calls if n == name]


def reply(
    epoch: str = "e1",
    cursor: int = 0,
    outputs: list[EngineCoreOutput] | None = None,
    accepting: bool = True,
    load: LoadReport = IDLE,
    stored: list[int] | None = None,
) -> PullReply:
    return PullReply(outputs or [], load, KVEvents(epoch, cursor, stored or []), accepting)
