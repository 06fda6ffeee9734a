"""The simpy processes: one loop per replica, and the arrivals that a router hands to them.

A replica's loop is the step loop of runtime/step.py and nothing else: begin a step, let its
duration pass on the simulated clock, complete it. One simpy event per step, never per token, and
one per run of repeated decode steps, which end at the next arrival (`NextArrival`) or deadline.
Between steps it aborts the requests whose clients gave up (`Request.timeout_s`). A closed-loop
workload's arrivals (sim/core/session_arrivals.py) hear of finishes, rejections and abandoned
requests through `Replica.on_finished`.
"""
from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, Callable

import simpy
from simpy.events import NORMAL

from policies.protocols import Executor, LoRAManager, Router, Scheduler
from policies.types import Request
from runtime.metrics import MetricsCollector, StepRecorder
from sim.core.repeated_steps import RepeatedStepsLoop

if TYPE_CHECKING:
    from sim.core.energy.meter import EnergyMeter


class SimEnvironment(simpy.Environment):
    """simpy's environment, able to wake a process at an exact time: where repeated steps end,
    their durations added one by one, as separate steps would have left the clock (one delay
    added to the start can miss that time by an ulp)."""

    def timeout_at(self, time: float) -> simpy.Event:
        if time < self.now:
            raise ValueError(f"timeout_at({time!r}) lies before now ({self.now!r})")
        event = simpy.Event(self)
        event._ok, event._value = True, None   # as simpy's Timeout is born triggered
        heapq.heappush(self._queue, (time, NORMAL, next(self._eid), event))
        return event


class NextArrival:
    """When the next request arrives (inf after the last): nothing else reaches a replica from
    outside, so its repeated decode steps may run up to it. 0 until the arrivals begin."""

    __slots__ = ("time",)

    def __init__(self):
        self.time = 0.0


class Replica:
    def __init__(self, env: simpy.Environment, replica_id: int, scheduler: Scheduler,
                 executor: Executor, metrics: MetricsCollector,
                 on_requests_done: Callable[[list[Request]], None] | None = None,
                 next_arrival: NextArrival | None = None, predictor=None,
                 pool: str = "main", role: str = "mixed", energy: EnergyMeter | None = None):
        self.env = env
        self.replica_id = replica_id
        self.pool, self.role = pool, role
        self.scheduler = scheduler
        self.executor = executor
        self.metrics = metrics
        # Its scheduler's LoRA manager (set by the builder; None: no adapters), for a router.
        self.lora: LoRAManager | None = None
        self.recorder = StepRecorder(metrics, replica_id, energy)
        self.steps = RepeatedStepsLoop(scheduler, executor, self.recorder, predictor)
        self.on_requests_done = on_requests_done
        # Without it, every step is its own event; with it, env must be a SimEnvironment. A
        # decode replica's (sim/core/cluster.py) is the earliest a KV transfer could land.
        self.next_arrival = next_arrival
        # Disaggregation (sim/core/cluster.py): called with the replica after each step; KV
        # transfers holding this replica's blocks (out of a prefill replica, into a decode one),
        # while which an empty plan waits for them instead of stalling; when the step in flight
        # ends (inf while idle) and how long the last one took.
        self.on_step_done: Callable[[Replica], None] | None = None
        self.num_pending_transfers = 0
        # A closed-loop workload (sim/core/session_arrivals.py): called with the requests that
        # finished or were rejected, so that their sessions' next turns can be scheduled.
        self.on_finished: Callable[[list[Request]], None] | None = None
        self.busy_until = math.inf
        self.last_step_duration = 0.0
        self._idle: simpy.Event | None = None
        self._queued_during_step: list[float] = []   # when requests joined its waiting queue
        self.process = self.start()

    def start(self) -> simpy.Process | None:
        """Start the replica's step loop (a lockstep rank's group runs its steps instead)."""
        return self.env.process(self.run())

    @property
    def num_outstanding(self) -> int:
        return self.scheduler.num_outstanding

    @property
    def kv_cache(self):
        """The replica's KV manager (a router reads its prefix cache)."""
        return self.scheduler.kv_cache

    def submit(self, request: Request) -> None:
        request.replica_id = self.replica_id
        self.scheduler.add_request(request, self.env.now)
        if request.rejected_reason is not None:
            self.ended([request])
            return
        self.steps.deadlines.add(request)
        self._queued_during_step.append(self.env.now)
        self.wake()

    def ended(self, requests: list[Request]) -> None:
        """Tell who listens that `requests` finished, were rejected or were abandoned."""
        if self.on_requests_done:
            self.on_requests_done(requests)
        if self.on_finished is not None:
            self.on_finished(requests)

    def wake(self) -> None:
        """Let an idle replica plan again: a request joined it, or a KV transfer moved blocks."""
        if self._idle is not None and not self._idle.triggered:
            self._idle.succeed()

    def receive(self, request: Request) -> None:
        """A request's KV has arrived (disaggregation): it decodes here from the next step."""
        request.replica_id = self.replica_id
        self.scheduler.finish_transfer(request, self.env.now)
        self.wake()

    def run(self):
        env, scheduler, steps, metrics = self.env, self.scheduler, self.steps, self.metrics
        has_unfinished, begin, complete = scheduler.has_unfinished, steps.begin, steps.complete
        next_arrival = self.next_arrival
        queued = self._queued_during_step
        while True:
            while not has_unfinished():   # a wake by a transfer may bring nothing
                self._idle = env.event()
                yield self._idle
                self._idle = None
            now = env.now
            abandoned = steps.abandon_due(now)
            if abandoned:
                self.ended(abandoned)
                if not has_unfinished():
                    continue
            queued.clear()
            first_row = metrics.num_steps
            # A KV transfer (disaggregation) skips the waiting queue: into a decode replica, or
            # out of a prefill replica, whose blocks it frees.
            num_pending_transfers = self.num_pending_transfers
            on_step_done = self.on_step_done
            # Past finishes unless a cluster reacts to each step (`on_step_done`) or a finish
            # sends a session's next turn (`on_finished`).
            result = begin(now, next_arrival.time if next_arrival else None,
                           queued_arrivals=not (self.role == "decode" or num_pending_transfers),
                           may_idle=num_pending_transfers > 0,
                           past_finishes=on_step_done is None and self.on_finished is None)
            if result is None:   # nothing can run until a KV transfer frees or brings blocks
                self._idle = env.event()
                yield self._idle
                self._idle = None
                continue
            end_times = steps.step_end_times   # of repeated steps; None for one step
            if end_times:
                self.busy_until = end_times[-1]
                yield env.timeout_at(self.busy_until)
            else:
                self.busy_until = now + result.duration
                yield env.timeout(result.duration)
            self.busy_until = math.inf
            self.last_step_duration = result.duration
            finished = complete(env.now)
            if end_times and queued:
                # Requests that arrived while the run's blocked queue kept them waiting.
                self.recorder.count_arrivals(first_row, len(end_times), queued)
            if finished:
                self.ended(finished)
            if on_step_done is not None:
                on_step_done(self)


def arrivals(env: simpy.Environment, requests: list[Request], router: Router,
             replicas: list[Replica], next_arrival: NextArrival | None = None,
             predictor=None, frontend_latency_s: float = 0.0):
    """Hand each request to the replica the router picks, `frontend_latency_s` after its
    arrival time (the serving front end's latency, cluster.frontend_latency_s); keep
    `next_arrival` at the time the next one will reach a replica. With a length `predictor` (a
    LengthPredictor, policies/prediction), each request's `predicted_output_len` is its
    prediction, made at arrival before routing."""
    next_arrival = next_arrival or NextArrival()
    predict = predictor.predict if predictor is not None else None
    for request in requests:
        # arrival_time stays the client's send time, so TTFT and E2E include the latency.
        delay = request.arrival_time + frontend_latency_s - env.now
        if delay > 0:
            next_arrival.time = env.now + delay   # the time simpy will wake this process at
            yield env.timeout(delay)
        if predict is not None:
            request.predicted_output_len = predict(request)
        replica_id = router.route(request, replicas)
        replicas[replica_id].submit(request)
    next_arrival.time = math.inf
