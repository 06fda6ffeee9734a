"""The step loop that the simulator's replicas and the engine's `LLM.generate` both run. Simulated
time passes between the two halves of a step, so a step is begun, then completed:

    steps = StepLoop(scheduler, executor, recorder)
    while scheduler.has_unfinished():
        result = steps.begin(now)        # schedule, stall check, execute, record the step's row
        ...                              # result.duration passes
        finished = steps.complete(now)   # update, record the inter-token latencies

The simulator waits `result.duration` in between; the engine completes at its wall clock.
"""
from __future__ import annotations

from policies.checks import has_capability
from policies.prediction import refine
from policies.protocols import Executor, OnlineLengthPredictor, Scheduler
from policies.types import Request, StepPlan, StepResult
from runtime.deadlines import Deadlines
from runtime.metrics import StepRecorder

# Consecutive steps in which no sequence gains a token and no request finishes before the run
# stops: far more than any real prompt's chunked prefill needs, few enough to stop in seconds.
MAX_STEPS_WITHOUT_PROGRESS = 10_000


class NoProgress(RuntimeError):
    """The policy cannot make progress (it plans nothing, or its steps gain no token): the run
    stops, and the command line prints this one line."""


class StepLoop:
    """One replica's steps, one at a time."""

    __slots__ = ("scheduler", "executor", "recorder", "plan", "result", "refining_predictor",
                 "steps_without_progress", "stalled_since", "deadlines")

    def __init__(self, scheduler: Scheduler, executor: Executor, recorder: StepRecorder,
                 predictor=None):
        self.scheduler = scheduler
        self.executor = executor
        self.recorder = recorder
        # A length predictor whose `update` refines its guesses: asked after every step about
        # the requests that made progress.
        self.refining_predictor = (
            predictor if predictor is not None
            and has_capability(predictor, OnlineLengthPredictor, "predictor") else None)
        self.plan: StepPlan | None = None     # the step in flight, between begin and complete
        self.result: StepResult | None = None
        self.steps_without_progress = 0   # consecutive steps that gained no token
        self.stalled_since = 0.0          # the clock when the first of them completed
        # Its requests' deadlines (Request.timeout_s): whoever queues a request adds it.
        self.deadlines = Deadlines()

    def begin(self, now: float, *, may_idle: bool = False) -> StepResult | None:
        """Plan the next step at `now`, execute it and record its row. An empty plan with requests
        outstanding raises NoProgress, unless `may_idle` (a KV transfer will change the pool)."""
        plan = self._schedule(now, may_idle)
        if plan is None:
            return None
        return self._execute(plan, now)

    def _execute(self, plan: StepPlan, now: float) -> StepResult:
        result = self.executor.execute(plan)
        self.recorder.record_step(now, plan, result, self.scheduler)
        self.plan, self.result = plan, result
        return result

    def abandon_due(self, now: float) -> list[Request]:
        """Abort the requests whose deadline passed by `now` (a step boundary); returns them."""
        return self.deadlines.abandon_due(self.scheduler, now)

    def begin_unrecorded(self, now: float) -> StepResult:
        """Plan and execute one step at `now` without recording it (a lockstep group records the
        group's duration)."""
        plan = self._schedule(now, False)
        self.plan, self.result = plan, self.executor.execute(plan)
        return self.result

    def record(self, now: float, duration: float) -> None:
        """Record the step begun by `begin_unrecorded` as lasting `duration`."""
        self.result.duration = duration
        self.recorder.record_step(now, self.plan, self.result, self.scheduler)

    def _schedule(self, now: float, may_idle: bool) -> StepPlan | None:
        scheduler = self.scheduler
        plan = scheduler.schedule(now)
        if not plan.is_empty:
            return plan
        if may_idle:
            return None
        waiting, running, swapped = scheduler.queue_lengths()
        raise NoProgress(
            f"replica {self.recorder.replica_id}: the scheduler planned nothing with "
            f"{waiting} waiting, {running} running and {swapped} swapped requests and "
            f"{scheduler.kv_cache.num_free_blocks()} free KV blocks; the policy cannot make "
            f"progress (a request larger than the pool, or max_num_seqs too small?)")

    def complete(self, now: float) -> list[Request]:
        """Let the scheduler account for the step begun last and record its inter-token
        latencies. Returns the requests that finished."""
        plan = self.plan
        seqs = plan.seqs
        # What update changes, read before and after it: the loop measures, the scheduler counts.
        times_before = [seq.last_token_time for seq in seqs]
        outputs_before = [seq.num_output_tokens for seq in seqs]
        finished = self.scheduler.update(plan, self.result, now)
        self.recorder.record_itls(seqs, outputs_before, times_before, now)
        # (A decode always gains a token: only steps without one compare the counts.)
        if finished or plan.num_decode_seqs or any(
                seq.num_output_tokens != before for seq, before in zip(seqs, outputs_before)):
            self.steps_without_progress = 0
        else:
            self._count_step_without_progress(plan, now)
        if self.refining_predictor is not None:
            self._refine_predictions(seqs)
        self.plan = self.result = None
        return finished

    def _count_step_without_progress(self, plan: StepPlan, now: float) -> None:
        """Count a step that gave no token and finished no request; raise NoProgress after
        MAX_STEPS_WITHOUT_PROGRESS in a row."""
        if not self.steps_without_progress:
            self.stalled_since = now
        self.steps_without_progress += 1
        if self.steps_without_progress < MAX_STEPS_WITHOUT_PROGRESS:
            return
        scheduler = self.scheduler
        waiting, running, swapped = scheduler.queue_lengths()
        clock = (f"simulated time stood still at {now:.6g} s" if now == self.stalled_since else
                 f"simulated time moved {now - self.stalled_since:.6g} s")
        raise NoProgress(
            f"scheduler {type(scheduler).__name__} made no progress for "
            f"{self.steps_without_progress} steps on replica {self.recorder.replica_id}: its "
            f"last step preempted {len(plan.preempted_recompute) + len(plan.preempted_swap)}, "
            f"swapped {len(plan.blocks_to_swap_out)} blocks out and "
            f"{len(plan.blocks_to_swap_in)} in and computed {plan.num_batched_tokens} tokens, "
            f"none of them a sequence's next token, and no request finished ({clock}; "
            f"{waiting} waiting, {running} running, {swapped} swapped)")

    def _refine_predictions(self, seqs) -> None:
        requests = {seq.request.request_id: seq.request for seq in seqs}
        for request in requests.values():
            if not request.is_finished:
                refine(self.refining_predictor, request, request.num_output_tokens_per_sample)

