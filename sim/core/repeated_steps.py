"""Repeated steps: a decode batch the scheduler would plan again unchanged runs as one event and
comes out as if every step had run on its own. Only what opts in meets them: a scheduler whose
class promises them (RepeatedStepsScheduler), a KV manager that tells the batch's block growth
(RepeatedStepsKVCache) and an executor that costs steps from the plan (RepeatedStepsExecutor).
docs/simulator.md (Repeated steps) explains the design.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import compress
from typing import ClassVar, Protocol, runtime_checkable

from policies.checks import has_capability
from policies.types import Request, Sequence, StepPlan, StepResult
from runtime.step import StepLoop


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


class RepeatedSteps:
    """A decode batch planned `max_repeats` steps in a row, until a decode finishes or the pool
    runs short. The sequences' counters stay where the run began until it completes
    (`num_steps_before`: steps run since then, when some finished inside it)."""

    __slots__ = ("scheduler", "max_repeats", "past_arrivals", "until", "num_steps_before",
                 "steps_to_last_output", "_growth")

    def __init__(self, scheduler: RepeatedStepsScheduler, max_repeats: int,
                 steps_to_last_output: list[int], past_arrivals: bool, until: float):
        self.scheduler = scheduler
        self.max_repeats = max_repeats
        self.past_arrivals = past_arrivals   # arrivals would only wait: the steps run past them
        self.until = until                   # the step during which it passes is the last
        self.num_steps_before = 0
        self.steps_to_last_output = steps_to_last_output
        self._growth = None   # made by the first rows

    @classmethod
    def plan(cls, scheduler: RepeatedStepsScheduler, plan: StepPlan, past_arrivals: bool,
             until: float) -> RepeatedSteps | None:
        """The run of the decode batch `plan`, or None for fewer than two steps: it stops at the
        first decode's last output and where the pool cannot hold the decodes' growth."""
        seqs = plan.seqs
        steps_to_last = [seq.request.output_len - seq.num_output_tokens for seq in seqs]
        kv_cache = scheduler.kv_cache
        growth = []   # kept for the run's rows: the same counters
        max_repeats = _num_steps_the_pool_holds(kv_cache, seqs, 0, min(steps_to_last),
                                                kv_cache.num_blocks_for_repeated_steps(), growth)
        if max_repeats <= 1:
            return None
        run = cls(scheduler, max_repeats, steps_to_last, past_arrivals, until)
        if growth:
            run._growth = growth[0]
        return run

    def new_blocks_per_step(self, plan: StepPlan, num_steps: int) -> list[int]:
        """The blocks the plan's decodes take at each of their next `num_steps` steps, the first
        entry counting every block taken since the counters stood."""
        growth = self._growth
        if growth is None:
            growth = self._growth = self.scheduler.kv_cache.decode_growth(plan.seqs)
        return growth.new_blocks_per_step(num_steps, self.num_steps_before)

    def complete(self, plan: StepPlan, num_steps: int, now: float) -> list[Request]:
        """`update` of the plan run `num_steps` times, the last ending at `now`, for a scheduler
        that promises `repeated_steps_past_finishes`. Returns the finished requests."""
        seqs = plan.seqs
        num_steps_since = self.num_steps_before + num_steps   # since the counters stood
        self._advance(seqs, num_steps_since, now)
        if num_steps < self.max_repeats:
            return []   # cut short: max_repeats is at most the steps to the first finish
        finishing = list(compress(seqs, map(num_steps_since.__ge__, self.steps_to_last_output)))
        finish = self.scheduler.finish_sequence
        return [seq.request for seq in finishing if finish(seq, now)]

    def stand_before_last_step(self, plan: StepPlan, num_steps: int,
                               end_times: list[float]) -> None:
        """Move the plan's decodes to where the last of its `num_steps` steps found them (the
        run's steps ended at `end_times`), so that the scheduler's own `update` of that step
        completes the run."""
        num_before = self.num_steps_before + num_steps - 1
        if num_before:
            Sequence.advance_decodes(plan.seqs, num_before, end_times[-2])
            _check_held(self.scheduler.kv_cache.append_slots(plan.seqs), plan.seqs)

    def continue_past_finishes(self, plan: StepPlan, now: float) -> list[Request] | None:
        """After the plan's max_repeats steps: if some decodes finished and the next steps would
        plan the rest alone, finish them, make `plan` the rest's and return the finished
        requests; else None, nothing changed."""
        scheduler = self.scheduler
        kv_cache = scheduler.kv_cache
        if not scheduler.may_repeat_past_finishes() or not kv_cache.frees_in_any_order():
            return None
        seqs = plan.seqs
        num_steps = self.num_steps_before + self.max_repeats   # since the counters stand
        steps_to_last = self.steps_to_last_output
        num_finishing = steps_to_last.count(num_steps)
        if not num_finishing or num_finishing == len(seqs):
            return None   # the pool ended the steps, or the whole batch finished
        # Usually one or two finish: found by index (memmoves in C, not a pass per list).
        indices = [steps_to_last.index(num_steps)]
        while len(indices) < num_finishing:
            indices.append(steps_to_last.index(num_steps, indices[-1] + 1))
        finishing = [seqs[index] for index in indices]
        rest, rest_to_last = seqs.copy(), steps_to_last.copy()
        for index in reversed(indices):
            del rest[index], rest_to_last[index]
        # The finishing ones take their growth before they free it: at most a block every
        # block_size steps each, counted exactly where that bound is too many.
        free_blocks = kv_cache.num_blocks_for_repeated_steps()
        num_more_steps = min(rest_to_last) - num_steps
        most_taken = num_finishing * -(-(num_steps - 1) // kv_cache.block_size)
        max_repeats = _num_steps_the_pool_holds(kv_cache, rest, num_steps, num_more_steps,
                                                free_blocks - most_taken)
        if max_repeats < num_more_steps and most_taken:
            max_repeats = _num_steps_the_pool_holds(
                kv_cache, rest, num_steps, num_more_steps,
                free_blocks - sum(kv_cache.decode_growth(finishing).new_blocks_per_step(
                    num_steps)))
        if not max_repeats:
            return None
        # The rest's decode context, num_steps tokens on from where its counters stand.
        context = (plan.decode_context_tokens + self.max_repeats * len(seqs)
                   - sum([seq.num_tokens for seq in finishing]) - num_finishing * num_steps)
        if self._growth is not None:   # (they leave it before their counters move)
            self._growth.leave(finishing)
        self._advance(finishing, num_steps, now)
        finish = scheduler.finish_sequence
        finished = [seq.request for seq in finishing if finish(seq, now)]
        plan.seqs = rest
        plan.num_new_tokens = [1] * len(rest)
        plan.num_decode_seqs = len(rest)
        plan.decode_context_tokens = context
        scheduler.resum_plan(plan)
        self.steps_to_last_output = rest_to_last
        self.max_repeats = max_repeats
        self.num_steps_before = num_steps
        return finished

    def _advance(self, seqs: list[Sequence], num_steps: int, now: float) -> None:
        """Each decode gained a token at each of `num_steps` steps, the last ending at `now`, and
        takes the slots up to its last computed token in one pass of the KV manager."""
        Sequence.advance_decodes(seqs, num_steps, now)
        if num_steps > 1:   # (after one step, the slots taken when it was planned suffice)
            _check_held(self.scheduler.kv_cache.take_computed_slots(seqs), seqs)


def _check_held(num_held: int, seqs: list[Sequence]) -> None:
    if num_held < len(seqs):
        raise RuntimeError("the KV pool could not hold the repeated steps its scheduler planned")


def _num_steps_the_pool_holds(kv_cache: RepeatedStepsKVCache, seqs: list[Sequence],
                              first_step: int, num_steps: int, free_blocks: int,
                              made_growth: list | None = None) -> int:
    """How many of the `num_steps` steps from `first_step` can take the decodes' growth from
    `free_blocks`; the growth, where made, is appended to `made_growth`."""
    if len(seqs) * -(-(first_step + num_steps - 1) // kv_cache.block_size) <= free_blocks:
        return num_steps   # even a block every block_size steps for each fits
    growth = kv_cache.decode_growth(seqs)
    if made_growth is not None:
        made_growth.append(growth)
    taken = 0
    for step, num_blocks in enumerate(growth.new_blocks_per_step(num_steps, first_step)):
        taken += num_blocks
        if taken > free_blocks:
            return step
    return num_steps


class RepeatedStepsLoop(StepLoop):
    """The simulator's StepLoop: `begin(now, horizon)` runs a repeatable decode batch as one event
    until the batch changes or a step ends at or after `horizon` (the next event the scheduler
    must see), with rows, latencies and clock as if each step had run on its own."""

    __slots__ = ("repeats", "run", "num_last_steps", "step_end_times", "finished_in_run")

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

    def begin(self, now: float, horizon: float | None = None, *, queued_arrivals: bool = True,
              may_idle: bool = False, past_finishes: bool = False) -> StepResult | None:
        """StepLoop.begin, a repeatable decode batch run until a step ends at or past `horizon`
        (`queued_arrivals` false: arrivals skip the waiting queue, as KV transfers do)."""
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
                return self._run(run, plan, now, end,
                                 min(end, horizon) if past_finishes else now)
        return self._execute(plan, now)

    def _run(self, run: RepeatedSteps, plan: StepPlan, now: float, horizon: float,
             finishes_before: float) -> StepResult:
        """Run the steps until max_repeats or one ends at or past `horizon`, recording rows and
        latencies with end times added as the clock would; before `finishes_before` the run goes
        on past finishes with the rest. Returns the whole run's result."""
        scheduler, recorder = self.scheduler, self.recorder
        durations: list[float] = []
        end_times: list[float] = []
        add_duration, add_end_time = durations.append, end_times.append   # (once a step)
        end = now
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
                                           run.num_steps_before,
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
            return StepLoop.complete(self, now)   # (cheaper than super() once a step)
        plan, scheduler = self.plan, self.scheduler
        if scheduler.repeated_steps_past_finishes:
            finished = run.complete(plan, self.num_last_steps, now)
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
