"""The step loop that the simulator's replicas and the engine's `LLM.generate` both run. Simulated
time passes between the two halves of a step, so a step is begun, then completed:

    steps = StepLoop(scheduler, executor, recorder)
    while scheduler.has_unfinished():
        result = steps.begin(now)        # schedule, stall check, execute, record the step's row
        ...                              # result.duration passes
        finished = steps.complete(now)   # update, record the inter-token latencies

The simulator yields `env.timeout(result.duration)` in between; the engine's step already took
its time, and it completes the step at its wall clock.
"""
from __future__ import annotations

from policies.protocols import Executor, Scheduler
from policies.types import Request, StepPlan, StepResult
from sim.core.metrics import StepRecorder


class StepLoop:
    """One replica's steps, one at a time."""

    __slots__ = ("scheduler", "executor", "recorder", "plan", "result")

    def __init__(self, scheduler: Scheduler, executor: Executor, recorder: StepRecorder):
        self.scheduler = scheduler
        self.executor = executor
        self.recorder = recorder
        self.plan: StepPlan | None = None     # the step in flight, between begin and complete
        self.result: StepResult | None = None

    def begin(self, now: float) -> StepResult:
        """Plan the next step at `now`, execute it and record its row. Raises RuntimeError when
        the scheduler plans nothing while it has requests: no later step could differ."""
        scheduler = self.scheduler
        plan = scheduler.schedule(now)
        if plan.is_empty:
            waiting, running, swapped = scheduler.queue_lengths()
            raise RuntimeError(
                f"replica {self.recorder.replica_id}: the scheduler planned nothing with "
                f"{waiting} waiting, {running} running and {swapped} swapped requests and "
                f"{scheduler.kv_cache.num_free_blocks()} free KV blocks; the policy cannot make "
                f"progress (a request larger than the pool, or max_num_seqs too small?)")
        result = self.executor.execute(plan)
        self.recorder.record_step(now, plan, result, scheduler)
        self.plan, self.result = plan, result
        return result

    def complete(self, now: float) -> list[Request]:
        """Let the scheduler account for the step begun last, at `now`, and record the
        inter-token latencies it produced. Returns the requests that finished."""
        plan = self.plan
        seqs = plan.seqs
        # What update changes, read before and after it: the loop measures, the scheduler counts.
        outputs_before = [seq.num_output_tokens for seq in seqs]
        times_before = [seq.last_token_time for seq in seqs]
        finished = self.scheduler.update(plan, self.result, now)
        self.recorder.record_itls(seqs, outputs_before, times_before, now)
        self.plan = self.result = None
        return finished
