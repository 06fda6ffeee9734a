"""The simpy processes: one loop per replica, and the arrivals that a router hands to them.

A replica's loop is the step loop of sim/core/step.py and nothing else: begin a step, let its
duration pass on the simulated clock, complete it. One simpy event per step, never per token.
"""
from __future__ import annotations

from typing import Callable

import simpy

from policies.protocols import Executor, Router, Scheduler
from policies.types import Request
from sim.core.metrics import MetricsCollector, StepRecorder
from sim.core.step import StepLoop


class Replica:
    def __init__(self, env: simpy.Environment, replica_id: int, scheduler: Scheduler,
                 executor: Executor, metrics: MetricsCollector,
                 on_requests_done: Callable[[int], None] | None = None):
        self.env = env
        self.replica_id = replica_id
        self.scheduler = scheduler
        self.executor = executor
        self.metrics = metrics
        self.recorder = StepRecorder(metrics, replica_id)
        self.steps = StepLoop(scheduler, executor, self.recorder)
        self.on_requests_done = on_requests_done
        self._idle: simpy.Event | None = None
        self.process = env.process(self.run())

    @property
    def num_outstanding(self) -> int:
        return self.scheduler.num_outstanding

    def submit(self, request: Request) -> None:
        request.replica_id = self.replica_id
        self.scheduler.add_request(request, self.env.now)
        if request.rejected_reason is not None:
            if self.on_requests_done:
                self.on_requests_done(1)
        elif self._idle is not None and not self._idle.triggered:
            self._idle.succeed()

    def run(self):
        env, scheduler, steps = self.env, self.scheduler, self.steps
        while True:
            if not scheduler.has_unfinished():
                self._idle = env.event()
                yield self._idle
                self._idle = None
            result = steps.begin(env.now)
            yield env.timeout(result.duration)
            finished = steps.complete(env.now)
            if finished and self.on_requests_done:
                self.on_requests_done(len(finished))


def arrivals(env: simpy.Environment, requests: list[Request], router: Router,
             replicas: list[Replica]):
    """Hand each request to the replica the router picks, at its arrival time."""
    for request in requests:
        delay = request.arrival_time - env.now
        if delay > 0:
            yield env.timeout(delay)
        replica_id = router.route(request, replicas)
        replicas[replica_id].submit(request)
