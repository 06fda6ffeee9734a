"""The arrivals of a closed-loop workload: each finished or rejected request is handed to the
SessionSource, whose next turn is scheduled in turn.

Repeated steps run up to the next arrival, which a closed loop does not know in advance, so
`time` is the earliest any request could arrive: the next scheduled one or now plus the least gap
after a request in flight; a closed-loop run thus comes out as it would step by step.
"""
from __future__ import annotations

import heapq
import math

from policies.types import Request
from sim.core.replica import SimEnvironment
from sim.core.workload import SessionSource


class ClosedLoopArrivals:
    """Schedules a SessionSource's requests on `env`; `requests` lists those that arrived."""

    __slots__ = ("env", "source", "router", "replicas", "predict", "frontend_latency_s",
                 "requests", "_pending", "_gaps_in_flight", "_due", "_draining")

    def __init__(self, env: SimEnvironment, source: SessionSource, predictor=None,
                 frontend_latency_s: float = 0.0):
        self.env = env
        self.source = source
        self.router = None
        self.replicas: list = []
        self.predict = predictor.predict if predictor is not None else None
        self.frontend_latency_s = frontend_latency_s
        self.requests: list[Request] = []
        self._pending: list[float] = []   # heap: when scheduled requests reach a replica
        # Requests in flight that can cause another; those ended since leave lazily.
        self._gaps_in_flight: list[tuple[float, int, Request]] = []
        self._due: list[Request] = []     # requests due now, submitted in order
        self._draining = False

    def start(self, router, replicas: list) -> None:
        """Route to `replicas`, listen to their finishes and schedule the first turns."""
        self.router, self.replicas = router, replicas
        for replica in replicas:
            replica.on_finished = self.on_finished
        self._schedule(self.source.first_arrivals())

    @property
    def time(self) -> float:
        """The earliest time a request could reach a replica (inf: none ever will)."""
        gaps = self._gaps_in_flight
        while gaps and gaps[0][2].is_finished:
            heapq.heappop(gaps)
        earliest = self._pending[0] if self._pending else math.inf
        if gaps:
            earliest = min(earliest, self.env.now + gaps[0][0] + self.frontend_latency_s)
        return earliest

    def on_finished(self, requests: list[Request]) -> None:
        """Requests finished or rejected now (a replica's hook): schedule what they cause."""
        now = self.env.now
        for request in requests:
            end = request.finish_time if request.finish_time is not None else now
            self._schedule(self.source.on_finished(request, end))

    def _schedule(self, requests: list[Request]) -> None:
        env = self.env
        for request in requests:
            reach_time = request.arrival_time + self.frontend_latency_s
            if reach_time <= env.now:
                self._due.append(request)
            else:
                heapq.heappush(self._pending, reach_time)
                env.timeout_at(reach_time).callbacks.append(
                    lambda _event, request=request: self._arrive(request))
        if self._due and not self._draining:
            self._submit_due()

    def _arrive(self, request: Request) -> None:
        heapq.heappop(self._pending)   # (events fire in time order: the heap's earliest)
        self._due.append(request)
        if not self._draining:
            self._submit_due()

    def _submit_due(self) -> None:
        """Submit the due requests in order; those a rejection makes due join the list rather
        than recurse."""
        self._draining = True
        due = self._due
        index = 0
        while index < len(due):
            self._submit(due[index])
            index += 1
        due.clear()
        self._draining = False

    def _submit(self, request: Request) -> None:
        request.request_id = len(self.requests)
        self.requests.append(request)
        gap = self.source.gap_after(request)
        if gap != math.inf:
            heapq.heappush(self._gaps_in_flight, (gap, request.request_id, request))
        if self.predict is not None:
            request.predicted_output_len = self.predict(request)
        replica_id = self.router.route(request, self.replicas)
        self.replicas[replica_id].submit(request)
