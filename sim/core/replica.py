"""The simpy side of a replica: `Replica`, what a router and the run see of it, and
`ReplicaDriver`, the one process that steps replicas. A driver runs the step loop over its lanes
and has its `DriverTiming` run each step: `OwnTime` here (with repeated steps), `Lockstep`
(lockstep.py) or `ThroughStages` (pipelined_replica.py).
"""
from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, Callable, Generator, Protocol

import simpy
from simpy.events import NORMAL

from policies.protocols import Executor, LoRAManager, Router, Scheduler
from policies.types import Request
from runtime.metrics import MetricsCollector, StepRecorder
from runtime.step import StepLoop
from sim.core.repeated_steps import RepeatedStepsLoop

if TYPE_CHECKING:
    from sim.core.energy.meter import EnergyMeter


class SimEnvironment(simpy.Environment):
    """simpy's environment, able to wake a process at an exact time (where repeated steps end: one
    delay added to the start can miss it by an ulp)."""

    def timeout_at(self, time: float) -> simpy.Event:
        if time < self.now:
            raise ValueError(f"timeout_at({time!r}) lies before now ({self.now!r})")
        event = simpy.Event(self)
        event._ok, event._value = True, None   # as simpy's Timeout is born triggered
        heapq.heappush(self._queue, (time, NORMAL, next(self._eid), event))
        return event

    def skip_to(self, time: float) -> bool:
        """Move the clock to `time` if no event is due by then, what waiting on `timeout_at(time)`
        would do without the event; False, nothing changed, where one is."""
        queue = self._queue
        if queue and queue[0][0] <= time:
            return False
        self._now = time
        return True


class NextArrival:
    """When the next request arrives (inf after the last), the horizon of repeated decode steps:
    nothing else reaches a replica from outside. 0 until the arrivals begin."""

    __slots__ = ("time",)

    def __init__(self):
        self.time = 0.0


class Lane:
    """One step loop of a replica (a pipelined replica has one per virtual engine) and the driver
    that steps it; `queued_arrivals` is kept only where its timing runs repeated steps."""

    __slots__ = ("replica", "index", "scheduler", "steps", "driver", "queued_arrivals")

    def __init__(self, replica: Replica, index: int, steps: StepLoop):
        self.replica, self.index = replica, index
        self.scheduler, self.steps = steps.scheduler, steps
        self.driver: ReplicaDriver | None = None
        self.queued_arrivals: list[float] | None = None   # when requests joined its queue


class Replica:
    """A replica of the cluster: its step loops (one per scheduler), where a request joins, and
    who hears that requests ended. Its drivers step it."""

    def __init__(self, env: SimEnvironment, replica_id: int, schedulers: list[Scheduler],
                 executor: Executor, metrics: MetricsCollector,
                 on_requests_done: Callable[[list[Request]], None] | None = None,
                 next_arrival: NextArrival | None = None, predictor=None,
                 pool: str = "main", role: str = "mixed",
                 energy: EnergyMeter | None = None,
                 lora_managers: list[LoRAManager] | None = None):
        if not isinstance(env, SimEnvironment):
            raise TypeError(f"Replica: env must be sim.core.replica.SimEnvironment, which can wake "
                            f"a process at an exact time; got {type(env).__name__}")
        self.env = env
        self.replica_id = replica_id
        self.pool, self.role = pool, role
        self.schedulers = schedulers
        self.scheduler = schedulers[0]   # (the policy a run's messages name)
        self.executor = executor
        self.metrics = metrics
        self.lora_managers = lora_managers   # one per lane (None: no adapters)
        self.recorder = StepRecorder(metrics, replica_id, energy)
        self.lanes = [Lane(self, index, RepeatedStepsLoop(scheduler, executor, self.recorder, predictor))
                      for index, scheduler in enumerate(schedulers)]
        self.on_requests_done = on_requests_done
        # A closed-loop workload's hook (sim/core/session_arrivals.py): its sessions' next turns.
        self.on_finished: Callable[[list[Request]], None] | None = None
        # The horizon of repeated steps; a cluster's (sim/core/cluster.py) with disaggregation.
        self.next_arrival = next_arrival
        # Disaggregation: a hook after each step, the KV transfers holding this replica's
        # blocks, and when its step in flight ends.
        self.on_step_done: Callable[[Replica], None] | None = None
        self.num_pending_transfers = 0
        self.busy_until = math.inf
        self.last_step_duration = 0.0

    def next_lane(self) -> Lane:
        """The lane a new request joins: the fewest unfinished requests, then the first (vLLM
        V0's rule for virtual engines)."""
        lanes = self.lanes
        if len(lanes) == 1:
            return lanes[0]
        return min(lanes, key=lambda lane: lane.scheduler.num_outstanding)

    @property
    def num_outstanding(self) -> int:
        if len(self.schedulers) == 1:
            return self.scheduler.num_outstanding
        return sum(scheduler.num_outstanding for scheduler in self.schedulers)

    @property
    def kv_cache(self):
        """The KV manager a new request would use (a router reads its prefix cache)."""
        return self.next_lane().scheduler.kv_cache

    @property
    def lora(self) -> LoRAManager | None:
        """The LoRA manager a new request would use (None: no adapters)."""
        if not self.lora_managers:
            return None
        return self.lora_managers[self.next_lane().index]

    def submit(self, request: Request) -> None:
        request.replica_id = self.replica_id
        lanes = self.lanes
        lane = lanes[0] if len(lanes) == 1 else self.next_lane()
        lane.scheduler.add_request(request, self.env.now)
        if request.rejected_reason is not None:
            self.ended([request])
            return
        lane.steps.deadlines.add(request)
        if lane.queued_arrivals is not None:
            lane.queued_arrivals.append(self.env.now)
        lane.driver.wake()

    def ended(self, requests: list[Request]) -> None:
        """Tell who listens that `requests` finished, were rejected or were abandoned."""
        if self.on_requests_done:
            self.on_requests_done(requests)
        if self.on_finished is not None:
            self.on_finished(requests)

    def wake(self) -> None:
        """Let an idle replica plan again: a KV transfer moved blocks."""
        for lane in self.lanes:
            lane.driver.wake()


class DriverTiming(Protocol):
    """How a driver's step takes its time on the simulated clock."""

    # Called for what to wait for before a step (a pipeline's first stage); None: nothing.
    gate: Callable[[], simpy.Event] | None

    def cancel(self) -> None:
        """Give back what `gate` took: the step will not run."""

    def step(self, driver: ReplicaDriver, now: float) -> Generator:
        """Begin, wait and complete one step of the driver's lanes with work, handing each
        lane's finished requests to `driver.finish`; returns False where nothing could run."""


class ReplicaDriver:
    """The one simpy process that steps `lanes` with `timing` (the module docstring)."""

    def __init__(self, env: simpy.Environment, lanes: list[Lane], timing: DriverTiming):
        self.env, self.lanes, self.timing = env, lanes, timing
        for lane in lanes:
            lane.driver = self
        self.has_work = (lanes[0].scheduler.has_unfinished if len(lanes) == 1
                         else self._any_has_work)
        self._idle: simpy.Event | None = None
        self.process = env.process(self.run())

    def _any_has_work(self) -> bool:
        return any(lane.scheduler.has_unfinished() for lane in self.lanes)

    def wake(self) -> None:
        """Let the driver step again: a request joined, or a KV transfer moved blocks."""
        if self._idle is not None and not self._idle.triggered:
            self._idle.succeed()

    def finish(self, replica: Replica, finished: list[Request]) -> None:
        """After a step of the replica's: report its finished requests, then the step
        (disaggregation)."""
        if finished:
            replica.ended(finished)
        if replica.on_step_done is not None:
            replica.on_step_done(replica)

    def run(self):
        env, lanes, timing = self.env, self.lanes, self.timing
        has_work, gate, step = self.has_work, timing.gate, timing.step
        abandons = [(lane.steps.abandon_due, lane.replica) for lane in lanes]
        while True:
            while not has_work():   # a wake by a transfer may bring nothing
                self._idle = env.event()
                yield self._idle
                self._idle = None
            if gate is not None:
                yield gate()
            now = env.now
            abandoned_any = False
            for abandon_due, replica in abandons:
                abandoned = abandon_due(now)
                if abandoned:
                    replica.ended(abandoned)
                    abandoned_any = True
            if abandoned_any and not has_work():
                timing.cancel()
                continue
            if not (yield from step(self, now)):
                # Nothing can run until a KV transfer frees or brings blocks.
                self._idle = env.event()
                yield self._idle
                self._idle = None


class OwnTime:
    """A replica stepping alone: each step lasts its own duration, and a run of repeated steps
    is one event up to the replica's horizon (`Replica.next_arrival`)."""

    gate = None

    def __init__(self, lane: Lane):
        self.replica, self.steps, self.env = lane.replica, lane.steps, lane.replica.env
        self.metrics = lane.replica.metrics
        self.queued = lane.queued_arrivals = []

    def cancel(self) -> None:
        pass

    def step(self, driver: ReplicaDriver, now: float):
        replica, steps, queued, env = self.replica, self.steps, self.queued, self.env
        queued.clear()
        first_row = self.metrics.num_steps
        # A KV transfer (disaggregation) skips the waiting queue: into a decode replica, or out
        # of a prefill replica, whose blocks it frees.
        num_pending_transfers = replica.num_pending_transfers
        next_arrival = replica.next_arrival
        # Past finishes unless a cluster reacts to each step or a finish sends a session's turn.
        result = steps.begin(now, next_arrival.time if next_arrival else None,
                             queued_arrivals=not (replica.role == "decode"
                                                  or num_pending_transfers),
                             may_idle=num_pending_transfers > 0,
                             past_finishes=(replica.on_step_done is None
                                            and replica.on_finished is None))
        if result is None:
            return False
        end_times = steps.step_end_times   # of repeated steps; None for one step
        busy_until = replica.busy_until = end_times[-1] if end_times else now + result.duration
        if not env.skip_to(busy_until):
            yield env.timeout_at(busy_until)
        replica.busy_until = math.inf
        replica.last_step_duration = result.duration
        finished = steps.complete(env.now)
        if end_times and queued:
            # Requests that arrived while the run's blocked queue kept them waiting.
            replica.recorder.count_arrivals(first_row, len(end_times), queued)
        driver.finish(replica, finished)
        return True


def drive_alone(replica: Replica) -> ReplicaDriver:
    """Start a replica that steps by itself (one scheduler): a driver over its lane, `OwnTime`."""
    return ReplicaDriver(replica.env, replica.lanes, OwnTime(replica.lanes[0]))


def arrivals(env: simpy.Environment, requests: list[Request], router: Router,
             replicas: list[Replica], next_arrival: NextArrival | None = None,
             predictor=None, frontend_latency_s: float = 0.0):
    """Hand each request, its length predicted, to the router's replica `frontend_latency_s` after
    its arrival, keeping `next_arrival` at the next one's."""
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
