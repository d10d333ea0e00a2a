"""The scheduler's waiting queues, one class per scheduling policy. No Ray here.

`FCFSQueue` keeps arrival order and puts a preempted request back at its front.
`PriorityQueue` orders by `priority_key`: lower `priority` first, then earlier arrival at
this instance (`queued_time`); a preempted request goes back under its own key.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from pdcluster.engine.config import SchedulingPolicy
from pdcluster.engine.request import Request


def priority_key(request: Request) -> tuple[int, float]:
    """Smaller is served sooner and preempted later."""
    return request.priority, request.queued_time


class RequestQueue(ABC):
    """Requests in the order the scheduler admits them."""

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put back a request taken from this queue (passed over, or preempted)."""

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """In admission order."""

    def goes_before(self, other: RequestQueue) -> bool:
        """Whether this queue's head is admitted before `other`'s (both not empty): under
        fcfs never, so requests passed over earlier (`other`) keep their turn."""
        return False

    def prepend_requests(self, requests: list[Request]) -> None:
        """Put back requests taken from this queue in the order they were taken."""
        for request in reversed(requests):
            self.prepend_request(request)

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSQueue(deque, RequestQueue):
    """Arrival order; what is put back goes to the front."""

    def add_request(self, request: Request) -> None:
        self.append(request)

    def prepend_request(self, request: Request) -> None:
        self.appendleft(request)

    def peek_request(self) -> Request:
        return self[0]

    def pop_request(self) -> Request:
        return self.popleft()

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        kept = [r for r in self if id(r) not in gone]
        self.clear()
        self.extend(kept)


class PriorityQueue(RequestQueue):
    """A heap on `priority_key`; a counter breaks exact ties in insertion order."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(request), next(self._counter), request))

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def peek_request(self) -> Request:
        return self._heap[0][-1]

    def goes_before(self, other: RequestQueue) -> bool:
        return priority_key(self.peek_request()) < priority_key(other.peek_request())

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove_requests(self, requests: Iterable[Request]) -> None:
        gone = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[-1]) not in gone]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[-1] for e in sorted(self._heap, key=lambda e: e[:3]))


def create_request_queue(policy: SchedulingPolicy) -> RequestQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
