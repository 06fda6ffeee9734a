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
from policies.types import Request, Sequence, SequenceStatus, StepPlan, StepResult
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


class RepeatedSteps:
    """A decode batch planned `max_repeats` steps in a row, until a decode finishes or the pool
    runs short. The sequences' counters stay where the run began until it completes
    (`num_steps_before`: steps run since then, when some finished inside it or it paused); a
    decode that joined later (`joined`: the step it joined at) has its counters where it joined.
    A paused run's pool holds the decodes' growth through step `held_through` in bulk."""

    __slots__ = ("scheduler", "max_repeats", "past_arrivals", "until", "num_steps_before",
                 "steps_to_last_output", "_growth", "held_through", "num_held_blocks", "joined")

    def __init__(self, scheduler: RepeatedStepsScheduler, max_repeats: int,
                 steps_to_last_output: list[int], past_arrivals: bool, until: float):
        self.scheduler = scheduler
        self.max_repeats = max_repeats
        self.past_arrivals = past_arrivals   # arrivals would only wait: the steps run past them
        self.until = until                   # the step during which it passes is the last
        self.num_steps_before = 0
        self.steps_to_last_output = steps_to_last_output
        self._growth = None   # made by the first rows
        self.held_through = 0
        self.num_held_blocks = 0
        self.joined: dict[Sequence, int] = {}

    @classmethod
    def plan(cls, scheduler: RepeatedStepsScheduler, plan: StepPlan, past_arrivals: bool,
             until: float) -> RepeatedSteps | None:
        """The run of the decode batch `plan`, or None for fewer than two steps: it stops at the
        first decode's last output and where the pool cannot hold the decodes' growth."""
        seqs = plan.seqs
        steps_to_last = [seq.request.output_len - seq.num_output_tokens for seq in seqs]
        kv_cache = scheduler.kv_cache
        run = cls(scheduler, 0, steps_to_last, past_arrivals, until)
        run.max_repeats = run._num_steps_the_pool_holds(
            seqs, 0, min(steps_to_last), kv_cache.num_blocks_for_repeated_steps(), keep=True)
        return run if run.max_repeats > 1 else None

    def growth(self, seqs: list[Sequence]):
        """The run's decode growth, `seqs` its decodes (made once, on first need)."""
        if self._growth is None:
            self._growth = self._growth_of(seqs, list(self.joined))
        return self._growth

    def _growth_of(self, seqs: list[Sequence], late: list[Sequence]):
        """The growth of `seqs`, of which `late` joined the run late: counted where their
        blocks fall in the run's steps."""
        growth = self.scheduler.kv_cache.decode_growth(seqs)
        if late:
            growth.leave(late)
            for seq in late:
                growth.join([seq], self.joined[seq])
        return growth

    def new_blocks_per_step(self, plan: StepPlan, num_steps: int) -> list[int]:
        """The blocks the plan's decodes take at each of their next `num_steps` steps, the first
        entry counting every block taken since the counters stood and the pool does not hold."""
        growth = self.growth(plan.seqs)
        blocks = growth.new_blocks_per_step(num_steps, self.num_steps_before)
        if self.held_through:
            blocks[0] = growth.blocks_between(self.held_through, self.num_steps_before)
        return blocks

    def complete(self, plan: StepPlan, num_steps: int, now: float) -> list[Request]:
        """`update` of the plan run `num_steps` times, the last ending at `now`, for a scheduler
        that promises `repeated_steps_past_finishes`. Returns the finished requests."""
        seqs = plan.seqs
        num_steps_since = self.num_steps_before + num_steps   # since the counters stood
        if self.held_through:
            self._release_held(self.num_held_blocks,
                               len(seqs) * self.held_through - sum(self.joined.values()))
        self._advance(seqs, num_steps_since, now, self.joined)
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
        num_steps = self.num_steps_before + self.max_repeats   # since the counters stand
        num_finishing = self.steps_to_last_output.count(num_steps)
        if not num_finishing or num_finishing == len(plan.seqs):
            return None   # the pool ended the steps, or the whole batch finished
        finishing, rest, rest_to_last = self._split(plan.seqs, num_steps, num_finishing)
        # The finishing ones take their growth before they free it: at most a block every
        # block_size steps each, counted exactly where that bound is too many.
        held, joined = self.held_through, self.joined
        free_blocks = kv_cache.num_blocks_for_repeated_steps()
        num_more_steps = min(rest_to_last) - num_steps
        most_taken = num_finishing * -(-(num_steps - 1 - held) // kv_cache.block_size)
        max_repeats = self._num_steps_the_pool_holds(rest, num_steps, num_more_steps,
                                                     free_blocks - most_taken, finishing)
        if max_repeats < num_more_steps and most_taken:
            finishing_growth = self._growth_of(
                finishing, [seq for seq in finishing if seq in joined])
            max_repeats = self._num_steps_the_pool_holds(
                rest, num_steps, num_more_steps,
                free_blocks - finishing_growth.blocks_through(num_steps - 1)
                + (finishing_growth.blocks_through(held) if held else 0), finishing)
        if not max_repeats:
            return None
        finished = self._leave(plan, num_steps, finishing, rest, rest_to_last, now)
        self.max_repeats = max_repeats
        return finished

    def leave_finished(self, plan: StepPlan, now: float) -> list[Request]:
        """After the plan's max_repeats steps, the last ending at `now`: finish the decodes whose
        last output that was and make `plan` the rest's (some are left: a pause keeps them)."""
        num_steps = self.num_steps_before + self.max_repeats
        num_finishing = self.steps_to_last_output.count(num_steps)
        if not num_finishing:
            plan.decode_context_tokens += self.max_repeats * len(plan.seqs)
            self.num_steps_before = num_steps
            return []
        return self._leave(plan, num_steps, *self._split(plan.seqs, num_steps, num_finishing),
                           now)

    def _split(self, seqs: list[Sequence], num_steps: int,
               num_finishing: int) -> tuple[list[Sequence], list[Sequence], list[int]]:
        """The decodes whose last output is step `num_steps`' (since the counters stood), the
        rest and the rest's steps to their last outputs."""
        steps_to_last = self.steps_to_last_output
        # Usually one or two finish: found by index (memmoves in C, not a pass per list).
        indices = [steps_to_last.index(num_steps)]
        while len(indices) < num_finishing:
            indices.append(steps_to_last.index(num_steps, indices[-1] + 1))
        finishing = [seqs[index] for index in indices]
        rest, rest_to_last = seqs.copy(), steps_to_last.copy()
        for index in reversed(indices):
            del rest[index], rest_to_last[index]
        return finishing, rest, rest_to_last

    def _leave(self, plan: StepPlan, num_steps: int, finishing: list[Sequence],
               rest: list[Sequence], rest_to_last: list[int], now: float) -> list[Request]:
        """Finish `finishing` after the part's max_repeats steps (`num_steps` since the counters
        stood, the last ending at `now`) and make `plan` the rest's next step; returns the
        finished requests."""
        scheduler, held, joined = self.scheduler, self.held_through, self.joined
        late_finishing = [seq for seq in finishing if seq in joined] if joined else []
        # The rest's decode context, num_steps tokens on from where its counters stand.
        late_steps = sum([joined[seq] for seq in late_finishing])
        context = (plan.decode_context_tokens + self.max_repeats * len(plan.seqs)
                   - sum([seq.num_tokens for seq in finishing]) - len(finishing) * num_steps
                   + late_steps)
        slots_left = self._slots_left(finishing)
        if self._growth is not None:   # (they leave it before their counters move)
            self._growth.remove(slots_left)
        if held:   # their share of the held growth goes back for them to take
            block_size = scheduler.kv_cache.block_size
            self._release_held(
                sum([_num_block_steps(num_left, joined.get(seq, 0), held, block_size)
                     for seq, num_left in zip(finishing, slots_left)]),
                len(finishing) * held - late_steps)
        self._advance(finishing, num_steps, now, late_finishing)
        for seq in late_finishing:
            del joined[seq]
        finish = scheduler.finish_sequence
        finished = [seq.request for seq in finishing if finish(seq, now)]
        plan.seqs = rest
        plan.num_new_tokens = [1] * len(rest)
        plan.num_decode_seqs = len(rest)
        plan.decode_context_tokens = context
        scheduler.resum_plan(plan)
        self.steps_to_last_output = rest_to_last
        self.num_steps_before = num_steps
        return finished

    # ---- pausing over prefill steps (RepeatedStepsLoop) ----

    def hold_growth(self, seqs: list[Sequence], through: int) -> None:
        """Have the pool hold the decodes' growth through step `through` (a paused run's)."""
        held = self.held_through
        if through <= held:
            return
        growth = self.growth(seqs)
        num_blocks = growth.blocks_between(held, through)
        self.scheduler.kv_cache.hold_decode_growth(num_blocks, len(seqs) * (through - held))
        self.num_held_blocks += num_blocks
        self.held_through = through

    def join(self, seqs: list[Sequence], old: list[Sequence]) -> None:
        """Decodes that join the run at its next step (its `num_steps_before`), `old` its
        decodes before them."""
        step = self.num_steps_before
        self.growth(old).join(seqs, step)
        self.steps_to_last_output += [seq.request.output_len - seq.num_output_tokens + step
                                      for seq in seqs]
        for seq in seqs:
            self.joined[seq] = step

    def _slots_left(self, seqs: list[Sequence]) -> list[int]:
        """Each decode's slots left where the run's growth counts it."""
        joined, block_size = self.joined, self.scheduler.kv_cache.block_size
        return [(joined.get(seq, 0) - seq.num_tokens) % block_size for seq in seqs]

    def _release_held(self, num_blocks: int, num_tokens: int) -> None:
        self.scheduler.kv_cache.release_decode_growth(num_blocks, num_tokens)
        self.num_held_blocks -= num_blocks

    def _advance(self, seqs: list[Sequence], num_steps: int, now: float,
                 late: list[Sequence] | dict) -> None:
        """Each decode gained a token at each of `num_steps` steps (those of `seqs` that joined
        late, `late`, at each since), the last ending at `now`, and takes the slots up to its
        last computed token in one pass of the KV manager."""
        Sequence.advance_decodes(seqs, num_steps, now)
        if late:
            joined = self.joined
            for seq in late:
                step = joined[seq]
                seq.num_computed_tokens -= step
                seq.num_tokens -= step
                seq.num_output_tokens -= step
        if num_steps > 1:   # (after one step, the slots taken when it was planned suffice)
            _check_held(self.scheduler.kv_cache.take_computed_slots(seqs), seqs)

    def _num_steps_the_pool_holds(self, seqs: list[Sequence], first_step: int, num_steps: int,
                                  free_blocks: int, leaving: list[Sequence] = (),
                                  keep: bool = False) -> int:
        """How many of the `num_steps` steps from `first_step` can take the growth of decodes
        `seqs` (the run's less `leaving`) that the pool does not hold from `free_blocks`;
        `keep`: the growth, where made, is the run's (the same counters)."""
        held = self.held_through
        block_size = self.scheduler.kv_cache.block_size
        if len(seqs) * -(-(first_step + num_steps - 1 - held) // block_size) <= free_blocks:
            return num_steps   # even a block every block_size steps for each fits
        growth = self._growth_of(seqs, [seq for seq in self.joined if seq not in leaving])
        if keep:
            self._growth = growth
        taken = -growth.blocks_through(held) if held else 0
        for step, num_blocks in enumerate(growth.new_blocks_per_step(num_steps, first_step)):
            taken += num_blocks
            if taken > free_blocks:
                return step
        return num_steps


def _num_block_steps(num_left: int, first: int, last: int, block_size: int) -> int:
    """At how many of the steps first + 1 to `last` a decode counted with `num_left` slots left
    takes a block (steps num_left + 1, num_left + 1 + block_size, ...)."""
    return (last - 1 - num_left) // block_size - (first - 1 - num_left) // block_size


def _check_held(num_held: int, seqs: list[Sequence]) -> None:
    if num_held < len(seqs):
        raise RuntimeError("the KV pool could not hold the repeated steps its scheduler planned")

class RepeatedStepsLoop(StepLoop):
    """The simulator's StepLoop: `begin(now, horizon)` runs a repeatable decode batch as one event
    until the batch changes or a step ends at or after `horizon` (the next event the scheduler
    must see), with rows, latencies and clock as if each step had run on its own. A run cut by an
    arrival, or by finishes with others left, pauses where the scheduler allows
    (PausingScheduler): the prefill steps it admits run while the pool holds the run's growth,
    and the run goes on with their decodes, its own counters untouched."""

    __slots__ = ("repeats", "run", "num_last_steps", "step_end_times", "finished_in_run",
                 "pauses", "paused", "paused_plan", "paused_at", "paused_context", "joining",
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
        self.paused_context = 0     # its decodes' context at its next step
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
                    and (num_steps < run.max_repeats or run.steps_to_last_output.count(
                        run.num_steps_before + num_steps) < len(plan.seqs))):
                if num_steps < run.max_repeats:   # cut by an arrival
                    plan.decode_context_tokens += num_steps * len(plan.seqs)
                    run.num_steps_before += num_steps
                    finished = []
                else:   # ended by finishes: the rest wait
                    finished = run.leave_finished(plan, now)
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
        self.paused_context = plan.decode_context_tokens
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
                seqs, self.paused_context + sum([seq.num_tokens for seq in joining]), now)
            bounds = scheduler.repeated_steps_bounds(plan)
        if plan is None or bounds is None:
            self._unpause()
            return None
        run.hold_growth(old, step)
        if joining:
            _check_held(kv_cache.append_slots(joining), joining)
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
