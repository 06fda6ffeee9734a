"""Clients that give up: one step loop's request deadlines, earliest first, aborted at each step
boundary through the scheduler; the simulator's repeated steps end at the earliest."""
from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter

from policies.checks import has_capability
from policies.protocols import AbortingScheduler
from policies.types import Request


class Deadlines:
    """The deadlines of the requests added, in a heap; finished ones leave it lazily."""

    __slots__ = ("_heap", "_order", "expected")

    def __init__(self):
        self._heap: list[tuple[float, int, Request]] = []
        self._order = itertools.count()   # requests do not compare
        # A request arriving during repeated steps may give up before they end.
        self.expected = False

    def add(self, request: Request) -> None:
        """Track `request`'s deadline (nothing when it has none)."""
        deadline = request.deadline
        if deadline is not None:
            heapq.heappush(self._heap, (deadline, next(self._order), request))

    def earliest(self) -> float:
        """The earliest deadline of an unfinished request added; inf when none has one."""
        heap = self._heap
        while heap and heap[0][2].is_finished:
            heapq.heappop(heap)
        return heap[0][0] if heap else math.inf

    def abandon_due(self, scheduler, now: float) -> list[Request]:
        """Abort and return, in deadline order, every unfinished request due by `now`."""
        heap = self._heap
        abandoned = []
        while heap and heap[0][0] <= now:
            request = heapq.heappop(heap)[2]
            if not request.is_finished:
                scheduler.abort(request, now)
                abandoned.append(request)
        return abandoned


def abandonment_counts(requests: list[Request]) -> Counter:
    """The counts abandonment_summary needs of `requests`, summable over chunks of a run."""
    abandoned = [request for request in requests if request.abandoned_time is not None]
    return Counter(requests=len(requests),
                   with_deadline=sum(request.timeout_s is not None for request in requests),
                   abandoned=len(abandoned),
                   abandoned_before_first_token=sum(request.first_token_time is None
                                                    for request in abandoned),
                   abandoned_output_tokens=sum(request.num_output_tokens
                                               for request in abandoned))


def abandonment_summary(requests: list[Request] | Counter) -> dict:
    """A run's abandoned requests and the output tokens thrown away on them, which the summary's
    output_throughput leaves out; {} when no request has a deadline."""
    counts = requests if isinstance(requests, Counter) else abandonment_counts(requests)
    if not counts["with_deadline"]:
        return {}
    return {"abandoned": counts["abandoned"],
            "abandoned_fraction": counts["abandoned"] / counts["requests"],
            "abandoned_before_first_token": counts["abandoned_before_first_token"],
            "abandoned_output_tokens": counts["abandoned_output_tokens"]}


def check_deadlines(requests: list[Request], schedulers: list, where: str | None) -> bool:
    """Whether any request has a timeout_s; raises one line unless every scheduler can abort and
    nothing (`where`) moves requests between replicas."""
    timed = next((request for request in requests if request.timeout_s is not None), None)
    if timed is None:
        return False
    if where is not None:
        raise ValueError(f"request {timed.request_id} has timeout_s={timed.timeout_s:g}: "
                         f"deadlines (workload.timeout_s, a trace's timeout_s column) are not "
                         f"modelled with {where}")
    for scheduler in schedulers:
        if not has_capability(scheduler, AbortingScheduler, "scheduler"):
            raise ValueError(f"request {timed.request_id} has timeout_s={timed.timeout_s:g} but "
                             f"scheduler {type(scheduler).__name__} has no abort(request, now) "
                             f"(policies.protocols.AbortingScheduler) to drop it when it passes")
    return True
