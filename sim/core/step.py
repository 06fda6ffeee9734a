"""The step loop that the simulator's replicas and the engine's `LLM.generate` both run. Simulated
time passes between the two halves of a step, so a step is begun, then completed:

    steps = StepLoop(scheduler, executor, recorder)
    while scheduler.has_unfinished():
        result = steps.begin(now)        # schedule, stall check, execute, record the step's row
        ...                              # result.duration passes
        finished = steps.complete(now)   # update, record the inter-token latencies

The simulator yields `env.timeout(result.duration)` in between (for repeated steps, it wakes at
`step_end_times[-1]`); the engine's step already took its time, and it completes the step at its
wall clock.

Repeated decode steps (simulator only): when the scheduler says the same decode batch would be
planned several steps in a row (`StepPlan.max_repeats`) and the executor can cost them from the
plan alone, `begin(now, horizon)` runs them as one: step by step until the batch changes or a
step ends at or after `horizon`, the next arrival, which the scheduler must see at the following
step boundary. Rows, latencies and the clock come out as if each step had run on its own.

Chained steps (simulator only, `past_finishes`: nothing outside the replica reacts to its steps
before the horizon): a step, or run of repeated steps, that ends before the horizon is completed
there at once and the next one begun, so one event spans them all; within a run, where the batch
changes because sequences finish, the scheduler may let the rest run on (`continue_repeats`).
"""
from __future__ import annotations

import math

from policies.prediction import KeepPrediction, refine
from policies.protocols import Executor, Scheduler
from policies.types import Request, StepPlan, StepResult
from sim.core.metrics import StepRecorder


class StepLoop:
    """One replica's steps, one at a time."""

    __slots__ = ("scheduler", "executor", "recorder", "plan", "result", "step_end_times",
                 "refining_predictor", "finished_early")

    def __init__(self, scheduler: Scheduler, executor: Executor, recorder: StepRecorder,
                 predictor=None):
        self.scheduler = scheduler
        self.executor = executor
        self.recorder = recorder
        # A length predictor whose `update` refines its guesses: asked after every step about
        # the requests that made progress.
        self.refining_predictor = predictor if refines(predictor) else None
        self.plan: StepPlan | None = None     # the step in flight, between begin and complete
        self.result: StepResult | None = None
        # Where the steps in flight end, when begin ran more than one step (repeated, chained).
        self.step_end_times: list[float] | None = None
        # Requests that finished in the steps in flight before the last one (chained, segments).
        self.finished_early: list[Request] = []

    def begin(self, now: float, horizon: float | None = None, *, queued_arrivals: bool = True,
              may_idle: bool = False, past_finishes: bool = False) -> StepResult | None:
        """Plan the next step at `now`, execute it and record its row. With a `horizon` (the
        time of the next event outside the replica), a repeatable decode batch runs until a step
        ends at or past it; with `queued_arrivals` false (what arrives skips the waiting queue:
        KV transfers to a decode replica) even when the queue's head is blocked. With
        `past_finishes` (nothing outside the replica reacts to its steps before the horizon),
        steps chain: each that ends before the horizon is completed there and the next begun,
        and repeated steps run on past finishes; the result then spans them all
        (`step_durations`, `step_end_times`), and `complete` completes the last. Raises
        RuntimeError when the scheduler plans nothing while it has requests: no later step could
        differ; unless `may_idle` (a KV transfer will change the pool), which returns None."""
        result = self._begin_step(now, horizon, queued_arrivals, may_idle, past_finishes)
        if (result is None or not past_finishes or horizon is None
                or self.refining_predictor is not None):   # (a predictor all replicas share)
            return result
        end_times = self.step_end_times or [now + result.duration]
        if end_times[-1] >= horizon:
            return result
        durations = list(result.step_durations or (result.duration,))
        scheduler = self.scheduler
        while end_times[-1] < horizon:
            end = end_times[-1]
            self.finished_early += self._complete_step(end)
            if not scheduler.has_unfinished():
                break   # (it idles from there: nothing in flight)
            result = self._begin_step(end, horizon, queued_arrivals, False, past_finishes)
            if result.step_durations:
                durations += result.step_durations
                end_times += self.step_end_times
            else:
                durations.append(result.duration)
                end_times.append(end + result.duration)
        self.step_end_times = end_times
        return StepResult(duration=end_times[-1] - now, step_durations=durations)

    def _begin_step(self, now: float, horizon: float | None, queued_arrivals: bool,
                    may_idle: bool, past_finishes: bool) -> StepResult | None:
        """begin, one step or run of repeated steps."""
        scheduler = self.scheduler
        plan = scheduler.schedule(now)
        if plan.is_empty:
            if may_idle:
                return None
            waiting, running, swapped = scheduler.queue_lengths()
            raise RuntimeError(
                f"replica {self.recorder.replica_id}: the scheduler planned nothing with "
                f"{waiting} waiting, {running} running and {swapped} swapped requests and "
                f"{scheduler.kv_cache.num_free_blocks()} free KV blocks; the policy cannot make "
                f"progress (a request larger than the pool, or max_num_seqs too small?)")
        # A refining predictor is asked after every step: its guesses may move a later one.
        if (horizon is not None and plan.max_repeats > 1 and self.refining_predictor is None
                and getattr(self.executor, "repeats_steps", False)):
            past_arrivals = plan.repeats_past_arrivals and queued_arrivals
            return self._run_repeated(plan, now, math.inf if past_arrivals else horizon,
                                      horizon if past_finishes else now)
        result = self.executor.execute(plan)
        self.recorder.record_step(now, plan, result, scheduler)
        self.plan, self.result = plan, result
        self.step_end_times = None
        return result

    def _run_repeated(self, plan: StepPlan, now: float, horizon: float,
                      finishes_before: float) -> StepResult:
        """Run the plan's repeated steps until max_repeats or one ends at or past `horizon`,
        recording their rows and latencies; the end times add up as the simulated clock would
        add each step's duration. Where they end, before `finishes_before`, at sequences'
        last tokens, the scheduler may finish those and make the plan the rest's next steps
        (`continue_repeats`): the run goes on with that batch, a segment of its own, and so
        on. Returns the whole run's result; the last segment's is kept for `complete`."""
        scheduler, recorder = self.scheduler, self.recorder
        continue_repeats = getattr(scheduler, "continue_repeats", None)
        durations: list[float] = []
        end_times: list[float] = []
        end = now
        times_before = [seq.last_token_time for seq in plan.seqs]
        while True:
            segment_start, first = end, len(durations)
            step_times = self.executor.repeated_step_times(plan, plan.max_repeats)
            for duration in step_times:
                durations.append(duration)
                end += duration
                end_times.append(end)
                if end >= horizon:
                    step_times.close()   # draw no more noise than the steps that ran
                    break
            segment_durations = durations[first:]
            recorder.record_repeated_steps(segment_start, plan, segment_durations, scheduler)
            recorder.record_repeated_itls(times_before, end_times[first:])
            if (end >= finishes_before or len(segment_durations) < plan.max_repeats
                    or continue_repeats is None):
                break
            finished = continue_repeats(plan, end)   # (plan becomes the rest's next steps)
            if finished is None:
                break
            self.finished_early += finished
            times_before = [end] * len(plan.seqs)
        self.step_end_times = end_times
        self.plan = plan
        self.result = StepResult(duration=end - segment_start, step_durations=segment_durations)
        return StepResult(duration=end - now, step_durations=durations)

    def complete(self, now: float) -> list[Request]:
        """Let the scheduler account for the step begun last, at `now`, and record the
        inter-token latencies it produced. Returns the requests that finished (in the steps
        begin chained before it too)."""
        finished = self._complete_step(now) if self.plan is not None else []
        if self.finished_early:
            finished = self.finished_early + finished
            self.finished_early = []
        self.step_end_times = None
        return finished

    def _complete_step(self, now: float) -> list[Request]:
        """complete, the last step or run of repeated steps begun."""
        plan, result = self.plan, self.result
        seqs = plan.seqs
        if result.step_durations is None:
            # What update changes, read before and after it: the loop measures, the scheduler
            # counts.
            times_before = [seq.last_token_time for seq in seqs]
            outputs_before = [seq.num_output_tokens for seq in seqs]
            finished = self.scheduler.update(plan, result, now)
            self.recorder.record_itls(seqs, outputs_before, times_before, now)
        else:   # (repeated steps recorded their latencies as they ran)
            finished = self.scheduler.update(plan, result, now)
        if self.refining_predictor is not None:
            self._refine_predictions(seqs)
        self.plan = self.result = None
        return finished

    def _refine_predictions(self, seqs) -> None:
        requests = {seq.request.request_id: seq.request for seq in seqs}
        for request in requests.values():
            if not request.is_finished:
                refine(self.refining_predictor, request, request.num_output_tokens_per_sample)


def refines(predictor) -> bool:
    """Whether a length predictor has an `update` of its own (the built-ins keep their guess)."""
    update = getattr(type(predictor), "update", None)
    return predictor is not None and update is not None and update is not KeepPrediction.update
