"""The simpy processes: one loop per replica, arrivals, and the cluster that routes between them.

A replica's loop is DESIGN.md's step contract and nothing else:
plan = scheduler.schedule(now); result = executor.execute(plan); advance the clock by the step's
duration; scheduler.update(plan, result, now). One simpy event per step, never per token.
"""
from __future__ import annotations

from typing import Callable

import simpy

from policies.protocols import Executor, Router, Scheduler
from policies.types import Request
from sim.core.metrics import MetricsCollector


class Replica:
    def __init__(self, env: simpy.Environment, replica_id: int, scheduler: Scheduler,
                 executor: Executor, metrics: MetricsCollector,
                 on_requests_done: Callable[[int], None] | None = None):
        self.env = env
        self.replica_id = replica_id
        self.scheduler = scheduler
        self.executor = executor
        self.metrics = metrics
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
        env, scheduler, executor = self.env, self.scheduler, self.executor
        kv_cache = scheduler.kv_cache
        record_step = self.metrics.record_step
        while True:
            if not scheduler.has_unfinished():
                self._idle = env.event()
                yield self._idle
                self._idle = None
            start = env.now
            plan = scheduler.schedule(start)
            if plan.is_empty:
                waiting, running, swapped = scheduler.queue_lengths()
                raise RuntimeError(
                    f"replica {self.replica_id}: the scheduler planned nothing with {waiting} "
                    f"waiting, {running} running and {swapped} swapped requests and "
                    f"{kv_cache.num_free_blocks()} free KV blocks; the policy cannot make "
                    f"progress (a request larger than the pool, or max_num_seqs too small?)")
            result = executor.execute(plan)
            # Memory and queues as they stand during the step, before finished requests leave.
            waiting, running, swapped = scheduler.queue_lengths()
            record_step(self.replica_id, start, plan, result.duration,
                        kv_blocks_used=kv_cache.num_used_blocks(),
                        kv_slots_allocated=kv_cache.num_slots_allocated(),
                        kv_tokens_stored=kv_cache.num_tokens_stored(),
                        num_waiting=waiting, num_running=running, num_swapped=swapped,
                        num_accepted_tokens=(sum(result.num_accepted.values())
                                             if result.num_accepted else 0))
            yield env.timeout(result.duration)
            finished = scheduler.update(plan, result, env.now)
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
