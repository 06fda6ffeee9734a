"""Clients that give up: the deadlines (`Request.deadline`, arrival + timeout_s) of one step
loop's requests, earliest first. Both backends ask at every step boundary which have passed and
abort those requests through their scheduler (policies.protocols.AbortingScheduler); the
simulator also ends a run of repeated steps at the step during which the earliest passes,
as steps one by one would see it.
"""
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
        self._order = itertools.count()   # ties in arrival order (requests do not compare)
        # Whether requests yet to arrive may carry deadlines (the run's workload has some): a
        # request that arrives during a run of repeated steps may give up before it ends.
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
        """Abort (`scheduler.abort`) every unfinished request whose deadline is at or before
        `now`; returns them, in deadline order."""
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
    """A run's abandoned requests (from the requests or their abandonment_counts), when any
    request has a deadline (else {}): how many, their fraction of the run, how many never had a
    first token, and the output tokens computed for them and thrown away (the summary's
    output_throughput counts finished requests' alone)."""
    counts = requests if isinstance(requests, Counter) else abandonment_counts(requests)
    if not counts["with_deadline"]:
        return {}
    return {"abandoned": counts["abandoned"],
            "abandoned_fraction": counts["abandoned"] / counts["requests"],
            "abandoned_before_first_token": counts["abandoned_before_first_token"],
            "abandoned_output_tokens": counts["abandoned_output_tokens"]}


def check_deadlines(requests: list[Request], schedulers: list, where: str | None) -> bool:
    """Whether any of `requests` has a timeout_s. Those need schedulers that can abort them
    (AbortingScheduler) and a cluster whose replicas each keep their requests to the end
    (`where`: what moves them otherwise, e.g. disaggregation's KV hand-offs; None: nothing).
    Raises one ValueError line."""
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
