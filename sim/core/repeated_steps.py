"""Repeated steps: a decode batch the scheduler would plan again unchanged runs as one event and
comes out as if every step had run on its own. Only what opts in meets them: a scheduler whose
class promises them (RepeatedStepsScheduler), a KV manager that tells the batch's block growth
(RepeatedStepsKVCache) and an executor that costs steps from the plan (RepeatedStepsExecutor).
The run's own bookkeeping is sim/core/repeated_run.py; docs/simulator.md (Repeated steps)
explains the design.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import ClassVar, Protocol, runtime_checkable

from policies.checks import has_capability
from policies.types import Request, Sequence, SequenceStatus, StepPlan, StepResult
from runtime.step import StepLoop
from sim.core.repeated_run import RepeatedSteps, check_held


@runtime_checkable
class RepeatedStepsScheduler(Protocol):
    """What repeated steps ask of the scheduler that planned the batch."""

    kv_cache: RepeatedStepsKVCache
    # The class's promises: its `schedule` plans from the queues, the batch and the pool alone;
    # its `update` does per step only what a decode's next token needs.
    repeated_steps: ClassVar[bool]
    repeated_steps_past_finishes: ClassVar[bool]

    def repeated_steps_bounds(self, plan: StepPlan) -> tuple[bool, float] | None:
        """None unless the next steps would plan this decode batch again; else whether they may run
        past arrivals and when the pool changes by itself (inf: never)."""
    def may_repeat_past_finishes(self) -> bool:
        """Whether, after some decodes finish, the next steps would plan the rest alone."""
    def finish_sequence(self, seq: Sequence, now: float) -> bool:
        """Mark a sequence finished at `now` and free its blocks; True if its request is done."""
    def resum_plan(self, plan: StepPlan) -> None:
        """The plan lost its finished decodes: sum again what the scheduler summed into it beyond
        the decode counts (the LoRA fields)."""


@runtime_checkable
class RepeatedStepsKVCache(Protocol):
    """A KV manager whose decodes' growth over repeated steps can be told in advance."""

    def num_blocks_for_repeated_steps(self) -> int:
        """Blocks decodes may take during repeated steps in another order than step by step
        without changing any later step (0: none)."""
    def decode_growth(self, seqs: list[Sequence]):
        """The blocks the decoding `seqs` (holding the slots of the step just planned) take at
        each step of a run (policies/memory/decode_growth.py)."""
    def frees_in_any_order(self) -> bool:
        """Whether decodes finishing inside a run may free their blocks before the rest's growth is
        taken without changing anything later."""
    def take_computed_slots(self, seqs: list[Sequence]) -> int:
        """Each decode's slots up to its last computed token, where step by step would have left
        them: the index of the first the pool cannot hold, or len(seqs)."""


@runtime_checkable
class PausingScheduler(Protocol):
    """What pausing a run over prefill steps asks of a scheduler that promises
    `repeated_steps_pause_for_prefills` (policies/batching/promises.py)."""

    def may_pause_for_prefills(self) -> bool:
        """Whether a run may pause now (nothing but waiting requests and its decodes to plan)."""
    def admit_while_paused(self, now: float) -> StepPlan | None:
        """The prefill step `schedule` would plan now, or None (nothing changed)."""
    def plan_paused_decodes(self, seqs: list[Sequence], context_tokens: int,
                            now: float) -> StepPlan:
        """The decode step `schedule` would plan now for every running sequence, `seqs`."""


@runtime_checkable
class PausingKVCache(Protocol):
    """A KV manager whose pool can hold a paused run's growth in bulk."""

    def can_hold_decode_growth(self) -> bool:
        """Whether it can now (not where its later steps depend on which block is whose)."""
    def hold_decode_growth(self, num_blocks: int, num_tokens: int) -> None:
        """Take free blocks and count stored tokens for decodes' growth before their tables."""
    def release_decode_growth(self, num_blocks: int, num_tokens: int) -> None:
        """Give held growth back for the decodes to take into their tables."""


@runtime_checkable
class RepeatedStepsExecutor(Protocol):
    """An executor that costs repeated steps from their plan alone (the simulator's)."""

    runs_repeated_steps: bool   # False: this one runs every step on its own after all

    def repeated_step_times(self, plan: StepPlan, num_steps: int) -> Iterator[float]:
        """The durations of `num_steps` steps of the decode batch `plan`, step j reading j more
        context tokens per decode; closed early, it draws no more noise."""


@runtime_checkable
class RepeatedStepsCostModel(Protocol):
    """A cost model that costs repeated steps from the plan's aggregate features."""

    costs_repeated_steps: bool   # False: this instance reads the sequences

    def repeated_step_times(self, plan: StepPlan, num_steps: int) -> Iterator[float]:
        """step_time of the decode batch `plan` and of the same batch in each of the next
        `num_steps - 1` steps, every decode's context a token longer each step."""


def step_times_one_by_one(cost_model, plan: StepPlan, num_steps: int) -> Iterator[float]:
    """`repeated_step_times` from `step_time`, the plan's decode context moved each step."""
    context = plan.decode_context_tokens
    try:
        for step in range(num_steps):
            plan.decode_context_tokens = context + step * plan.num_decode_seqs
            yield cost_model.step_time(plan)
    finally:
        plan.decode_context_tokens = context


def promises_repeated_steps(scheduler) -> bool:
    """Whether the scheduler's class states the promise (checked whole where it does)."""
    return (getattr(type(scheduler), "repeated_steps", False) is True
            and has_capability(scheduler, RepeatedStepsScheduler, "scheduler")
            and has_capability(scheduler.kv_cache, RepeatedStepsKVCache, "kv_cache"))


class RepeatedStepsLoop(StepLoop):
    """The simulator's StepLoop: `begin(now, horizon)` runs a repeatable decode batch as one event
    until the batch changes or a step ends at or after `horizon` (the next event the scheduler
    must see), with rows, latencies and clock as if each step had run on its own. A run cut by an
    arrival, or by finishes with others left, pauses where the scheduler allows
    (PausingScheduler): the prefill steps it admits run while the pool holds the run's growth,
    and the run goes on with their decodes, its own counters untouched."""

    __slots__ = ("repeats", "run", "num_last_steps", "step_end_times", "finished_in_run",
                 "pauses", "paused", "paused_plan", "paused_at", "joining",
                 "may_pause")

    def __init__(self, scheduler, executor, recorder, predictor=None):
        super().__init__(scheduler, executor, recorder, predictor)
        # (A refining predictor is asked after every step: its guesses may move a later one.)
        self.repeats = (has_capability(executor, RepeatedStepsExecutor, "executor")
                        and executor.runs_repeated_steps and self.refining_predictor is None
                        and promises_repeated_steps(scheduler))
        self.run: RepeatedSteps | None = None   # in flight, between begin and complete
        self.num_last_steps = 0                 # of its last part, which `update` completes
        self.step_end_times: list[float] | None = None
        self.finished_in_run: list[Request] = []   # finished inside it
        self.pauses = (self.repeats and scheduler.repeated_steps_past_finishes
                       and getattr(type(scheduler), "repeated_steps_pause_for_prefills", False)
                       is True and has_capability(scheduler, PausingScheduler, "scheduler")
                       and has_capability(scheduler.kv_cache, PausingKVCache, "kv_cache"))
        self.paused: RepeatedSteps | None = None   # a run waiting over prefill steps
        self.paused_plan: StepPlan | None = None
        self.paused_at = 0.0        # when its last step ended
        self.joining: list[Sequence] = []   # the decodes its prefill steps made
        self.may_pause = False      # the run in flight may pause where it ends

    def begin(self, now: float, horizon: float | None = None, *, queued_arrivals: bool = True,
              may_idle: bool = False, past_finishes: bool = False) -> StepResult | None:
        """StepLoop.begin, a repeatable decode batch run until a step ends at or past `horizon`
        (`queued_arrivals` false: arrivals skip the waiting queue, as KV transfers do)."""
        if self.paused is not None:
            plan = self.scheduler.admit_while_paused(now)
            if plan is not None:
                return self._execute(plan, now)
            result = self._resume(now, horizon, queued_arrivals, past_finishes)
            if result is not None:
                return result
        plan = self._schedule(now, may_idle)
        if plan is None:
            return None
        if horizon is not None and self.repeats:
            bounds = self.scheduler.repeated_steps_bounds(plan)
            run = None if bounds is None else RepeatedSteps.plan(self.scheduler, plan, *bounds)
            if run is not None:
                past_arrivals = (run.past_arrivals and queued_arrivals
                                 and not self.deadlines.expected)
                end = min(math.inf if past_arrivals else horizon, run.until,
                          self.deadlines.earliest())
                self.may_pause = (self.pauses and queued_arrivals and past_finishes
                                  and run.until == math.inf and not self.deadlines.expected)
                return self._run(run, plan, now, end,
                                 min(end, horizon) if past_finishes else now)
        return self._execute(plan, now)

    def _run(self, run: RepeatedSteps, plan: StepPlan, now: float, horizon: float,
             finishes_before: float, times_before: list[float] | None = None) -> StepResult:
        """Run the steps until max_repeats or one ends at or past `horizon`, recording rows and
        latencies with end times added as the clock would; before `finishes_before` the run goes
        on past finishes with the rest. Returns the whole run's result."""
        scheduler, recorder = self.scheduler, self.recorder
        durations: list[float] = []
        end_times: list[float] = []
        add_duration, add_end_time = durations.append, end_times.append   # (once a step)
        end = now
        if times_before is None:
            times_before = [seq.last_token_time for seq in plan.seqs]
        while True:
            part_start, first = end, len(durations)
            step_times = self.executor.repeated_step_times(plan, run.max_repeats)
            for duration in step_times:
                add_duration(duration)
                end += duration
                add_end_time(end)
                if end >= horizon:
                    step_times.close()   # draw no more noise than the steps that ran
                    break
            part_durations = durations[first:] if first else durations
            recorder.record_repeated_steps(part_start, plan, part_durations, scheduler,
                                           run.num_steps_before - run.held_through,
                                           run.new_blocks_per_step(plan, len(part_durations)))
            recorder.record_repeated_itls(times_before, end_times[first:] if first else end_times)
            if end >= finishes_before or len(part_durations) < run.max_repeats:
                break
            finished = run.continue_past_finishes(plan, end)   # (plan: the rest's next steps)
            if finished is None:
                break
            self.finished_in_run += finished
            times_before = [end] * len(plan.seqs)
        self.run, self.num_last_steps, self.step_end_times = run, len(part_durations), end_times
        self.plan = plan
        self.result = StepResult(duration=end - part_start)
        return StepResult(duration=end - now)

    def complete(self, now: float) -> list[Request]:
        """StepLoop.complete; a run's latencies were recorded as it ran."""
        run = self.run
        if run is None:
            if self.paused is None:
                return StepLoop.complete(self, now)   # (cheaper than super() once a step)
            plan = self.plan   # a prefill step of a pause: its decodes join the run
            finished = StepLoop.complete(self, now)
            self.joining += [seq for seq in plan.seqs if seq.status is SequenceStatus.RUNNING]
            return finished
        plan, scheduler = self.plan, self.scheduler
        if scheduler.repeated_steps_past_finishes:
            num_steps = self.num_last_steps
            if (self.may_pause and scheduler.may_pause_for_prefills()
                    and scheduler.kv_cache.can_hold_decode_growth()
                    and run.steps_to_last_output.count(run.num_steps_before + num_steps)
                    < len(plan.seqs)):   # (some decodes are left to wait)
                finished = run.leave_finished(plan, num_steps, now)
                self._pause(run, plan, now)
            else:
                finished = run.complete(plan, num_steps, now)
        else:   # (an update that does more: it sees the run's last step)
            run.stand_before_last_step(plan, self.num_last_steps, self.step_end_times)
            finished = scheduler.update(plan, self.result, now)
        if self.finished_in_run:
            finished = self.finished_in_run + finished
            self.finished_in_run = []
        self.run = self.step_end_times = None
        self.steps_without_progress = 0   # (repeated steps are decodes)
        self.plan = self.result = None
        return finished

    def abandon_due(self, now: float) -> list[Request]:
        """StepLoop.abandon_due; a paused run completes first (an abort frees its decodes)."""
        if self.paused is not None and self.deadlines.expected:
            self._unpause()
        return StepLoop.abandon_due(self, now)

    def _pause(self, run: RepeatedSteps, plan: StepPlan, now: float) -> None:
        """Keep the run, its step ending at `now` its `num_steps_before`th and `plan` its next
        step's decodes, for the prefill steps that may come first: the pool holds the growth
        its decodes took."""
        run.hold_growth(plan.seqs, run.num_steps_before - 1)
        self.paused, self.paused_plan, self.paused_at = run, plan, now
        self.joining = []

    def _unpause(self) -> None:
        """Complete the paused run where it stopped (its prefill steps' decodes are on their
        own already)."""
        run, plan = self.paused, self.paused_plan
        self.paused = self.paused_plan = None
        self.joining = []
        run.complete(plan, 0, self.paused_at)

    def _resume(self, now: float, horizon: float | None, queued_arrivals: bool,
                past_finishes: bool) -> StepResult | None:
        """The paused run goes on at `now`, its prefill steps' decodes joined, where `schedule`
        would plan exactly those decodes with none preempted; else it completes (None)."""
        run, old_plan, joining = self.paused, self.paused_plan, self.joining
        scheduler = self.scheduler
        kv_cache = scheduler.kv_cache
        old = old_plan.seqs
        seqs = old + joining if joining else old.copy()
        step = run.num_steps_before
        growth = run.growth(old)
        # The old decodes' blocks at this step, and at most one for each joining decode.
        num_blocks = growth.blocks_between(step - 1, step)
        plan = None
        if (horizon is not None and scheduler.queues.num_running_seqs == len(seqs)
                and len(seqs) <= scheduler.max_num_batched_tokens
                and not self.deadlines.expected and scheduler.may_pause_for_prefills()
                and kv_cache.can_hold_decode_growth()
                and kv_cache.num_blocks_for_repeated_steps() >= num_blocks + len(joining)
                and all(seq.num_tokens - seq.num_computed_tokens == 1 for seq in joining)):
            plan = scheduler.plan_paused_decodes(
                seqs, old_plan.decode_context_tokens + sum([seq.num_tokens for seq in joining]),
                now)
            bounds = scheduler.repeated_steps_bounds(plan)
        if plan is None or bounds is None:
            self._unpause()
            return None
        run.hold_growth(old, step)
        if joining:
            check_held(kv_cache.append_slots(joining), joining)
            run.join(joining, old)
        run.past_arrivals, run.until = bounds
        run.max_repeats = run._num_steps_the_pool_holds(
            seqs, step, min(run.steps_to_last_output) - step,
            kv_cache.num_blocks_for_repeated_steps())
        times_before = [self.paused_at] * len(old) + [seq.last_token_time for seq in joining]
        self.paused = self.paused_plan = None
        self.joining = []
        past_arrivals = run.past_arrivals and queued_arrivals
        end = min(math.inf if past_arrivals else horizon, run.until, self.deadlines.earliest())
        self.may_pause = (self.pauses and queued_arrivals and past_finishes
                          and run.until == math.inf and not self.deadlines.expected)
        return self._run(run, plan, now, end, min(end, horizon) if past_finishes else now,
                         times_before)
