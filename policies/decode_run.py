"""Repeated decode steps: a decode batch that the scheduler would plan again unchanged for several
steps runs in the simulator as one event, a `DecodeRun`, and comes out as if every step had run
on its own (every step row, latency and request time). Only what opts in meets it:

- a scheduler attaches a DecodeRun to its plan (`StepPlan.decode_run`, as BaseScheduler does)
  and hands a result of several steps (`StepResult.step_durations`) to `DecodeRun.apply`;
- its KV manager tells the batch's block growth (`RepeatingKVCache`);
- the executor costs the steps from the plan alone (`RepeatingExecutor`; SimExecutor does with
  a `RepeatedStepCostModel`).

The engine runs every step for real and never repeats one.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import compress
from typing import Protocol, runtime_checkable

from policies.types import Request, Sequence, StepPlan

# ---- the protocols of what takes part -----------------------------------------------------------


@runtime_checkable
class RepeatingKVCache(Protocol):
    """A KV manager whose decodes' growth over repeated steps can be told in advance."""

    def num_blocks_for_repeated_steps(self) -> int:
        """Blocks decodes may take during repeated steps in another order than step by step
        without changing any later step (0: none)."""
    def decode_growth(self, seqs: list[Sequence]) -> DecodeGrowth:
        """The blocks the decoding `seqs`, holding the slots of the step just planned, take at
        each step of a run (a token further each)."""
    def frees_in_any_order(self) -> bool:
        """Whether decodes finishing inside a run may free their blocks before the rest's growth
        is taken, changing nothing later (False with a prefix cache: it evicts in freeing
        order)."""


@runtime_checkable
class RepeatingExecutor(Protocol):
    """An executor that costs a run's steps from its plan alone (the simulator's)."""

    repeats_steps: bool   # False: this one runs every step on its own after all

    def repeated_step_times(self, plan: StepPlan, num_steps: int) -> Iterator[float]:
        """The durations of `num_steps` steps of the decode batch `plan`, one at a time, step j
        reading j more context tokens per decode; closed early, it draws no more noise."""


@runtime_checkable
class RepeatedStepCostModel(Protocol):
    """A cost model that costs a run's steps from the plan's aggregate features."""

    reads_only_aggregates: bool   # False: this instance reads the sequences (no repeats)

    def repeated_step_times(self, plan: StepPlan, num_steps: int) -> Iterator[float]:
        """step_time of the decode batch `plan` and of the same batch in each of the next
        `num_steps - 1` steps, every decode's context a token longer each step."""


class RepeatingScheduler(Protocol):
    """What a DecodeRun asks of the scheduler that planned it."""

    kv_cache: RepeatingKVCache

    def runs_past_finishes(self) -> bool:
        """Whether the next steps after some decodes of a run finish would plan the rest alone:
        nothing waits, is swapped out or arriving, and `update` does nothing per step beyond
        what DecodeRun applies."""
    def finish_sequence(self, seq: Sequence, now: float) -> bool:
        """Mark a sequence finished at `now` and free its blocks; True if its request is done."""
    def rest_of_run(self, plan: StepPlan) -> None:
        """Some decodes of the run `plan` finished and the plan holds the rest: sum again what
        the scheduler summed into it beyond the decode counts (the LoRA fields)."""


def step_times_one_by_one(cost_model, plan: StepPlan, num_steps: int) -> Iterator[float]:
    """`repeated_step_times` from a cost model's `step_time`, the plan's decode context moved
    each step (for a cost model without a faster way)."""
    context = plan.decode_context_tokens
    try:
        for step in range(num_steps):
            plan.decode_context_tokens = context + step * plan.num_decode_seqs
            yield cost_model.step_time(plan)
    finally:
        plan.decode_context_tokens = context


# ---- block growth -------------------------------------------------------------------------------


def slots_left(seqs: list[Sequence], block_size: int) -> list[int]:
    """The slots left in the last blocks of decodes that hold exactly the blocks their tokens
    fill."""
    return [-seq.num_tokens % block_size for seq in seqs]


def new_blocks_per_step(slots_left: bytes | list[int], block_size: int, num_steps: int,
                        first_step: int = 0) -> list[int]:
    """The blocks that decodes with these slots left in their last blocks take at each of this
    step and the next `num_steps - 1` steps (a token further each): one with s left takes a
    block at steps s + 1, s + 1 + block_size, ... From a later `first_step`: at steps first_step
    to first_step + num_steps - 1, the first entry counting every block taken by then (at steps
    1 to first_step)."""
    return DecodeGrowth(slots_left, block_size).new_blocks_per_step(num_steps, first_step)


class DecodeGrowth:
    """The blocks a batch of paged decodes takes as it runs repeated steps, a token further each:
    at step t >= 1 of the run (step 0, the one planned, holds its slots), `cycle[(t - 1) %
    block_size]` of them take one, those with that many slots left in their last blocks. Counted
    by slots left, which take at most block_size values (from bytes, each count is one C pass).
    Kept for a whole run: decodes that finish leave it (`leave`) without a pass over the
    rest."""

    __slots__ = ("block_size", "cycle")

    def __init__(self, slots_left: bytes | list[int], block_size: int):
        self.block_size = block_size
        if isinstance(slots_left, bytes):
            self.cycle = [slots_left.count(num_left) for num_left in range(block_size)]
        else:
            self.cycle = [0] * block_size
            for num_left in slots_left:
                self.cycle[num_left] += 1

    @classmethod
    def of(cls, seqs: list[Sequence], block_size: int) -> DecodeGrowth:
        """The growth of decodes that hold exactly the blocks their tokens fill."""
        # Counted in one pass over the batch: faster than building bytes to count, up to
        # hundreds of decodes.
        cycle = [0] * block_size
        for seq in seqs:
            cycle[-seq.num_tokens % block_size] += 1
        growth = cls.__new__(cls)
        growth.block_size, growth.cycle = block_size, cycle
        return growth

    def remove(self, slots_left: list[int]) -> None:
        """Decodes with these slots left leave the batch."""
        cycle = self.cycle
        for num_left in slots_left:
            cycle[num_left] -= 1

    def leave(self, seqs: list[Sequence]) -> None:
        """These decodes (counters where the run began) leave the batch."""
        self.remove(slots_left(seqs, self.block_size))

    def new_blocks_per_step(self, num_steps: int, first_step: int = 0) -> list[int]:
        """`new_blocks_per_step` of the batch: its blocks at steps first_step to first_step +
        num_steps - 1, the first entry counting every block taken by then."""
        if not num_steps:
            return []
        cycle, block_size = self.cycle, self.block_size
        if first_step:
            num_cycles, num_past = divmod(first_step, block_size)
            first = (sum(cycle) * num_cycles if num_cycles else 0) + sum(cycle[:num_past])
        else:
            first = 0
        if num_steps == 1:
            return [first]
        start = first_step % block_size   # cycle index of step first_step + 1
        if start + num_steps - 1 <= block_size:
            return [first, *cycle[start:start + num_steps - 1]]
        per_step = [first]
        for step in range(first_step + 1, first_step + num_steps):
            per_step.append(cycle[(step - 1) % block_size])
        return per_step


class NoDecodeGrowth:
    """The growth of decodes that never take a block (a contiguous reservation holds them)."""

    __slots__ = ()

    def leave(self, seqs: list[Sequence]) -> None:
        pass

    def new_blocks_per_step(self, num_steps: int, first_step: int = 0) -> list[int]:
        return [0] * num_steps


# ---- the run ------------------------------------------------------------------------------------


class DecodeRun:
    """A decode batch planned `max_repeats` steps in a row, each decode a token further on each
    step, until a decode finishes or the pool runs short. `past_arrivals`: requests arriving
    meanwhile would only wait (the queue's head is blocked), so the steps need not stop at the
    next arrival. The run's sequences keep their counters where the run began until `apply`;
    after some of them finish inside the run (`continue_past_finishes`), the plan becomes the
    rest's next segment and `num_steps_before` counts the steps run since the counters stood.
    `steps_to_last_output` (each sequence's, from there) and the batch's block growth serve
    every segment without a pass over the batch."""

    __slots__ = ("scheduler", "max_repeats", "past_arrivals", "num_steps_before",
                 "steps_to_last_output", "until", "_growth")

    def __init__(self, scheduler: RepeatingScheduler, max_repeats: int,
                 steps_to_last_output: list[int], past_arrivals: bool):
        self.scheduler = scheduler
        self.max_repeats = max_repeats
        self.past_arrivals = past_arrivals
        self.num_steps_before = 0
        self.steps_to_last_output = steps_to_last_output
        # A time the scheduler's pool changes by itself (a kv_retention pin expiring): the step
        # during which it passes is the run's last, whatever the arrivals.
        self.until = math.inf
        self._growth: DecodeGrowth | NoDecodeGrowth | None = None   # made by the first rows

    @classmethod
    def plan(cls, scheduler: RepeatingScheduler, plan: StepPlan,
             past_arrivals: bool) -> DecodeRun | None:
        """The run of the decode batch `plan` (every running sequence decodes; the scheduler
        checked that the next steps would plan it again), or None for fewer than two steps: a
        decode finishes at the step of its last output, and the pool must hold the blocks the
        decodes grow into until then."""
        seqs = plan.seqs
        steps_to_last = [seq.request.output_len - seq.num_output_tokens for seq in seqs]
        kv_cache = scheduler.kv_cache
        growth = []   # (the growth it makes, kept for the run's rows: the same counters)
        max_repeats = _num_steps_the_pool_holds(kv_cache, seqs, 0, min(steps_to_last),
                                                kv_cache.num_blocks_for_repeated_steps(), growth)
        if max_repeats <= 1:
            return None
        run = cls(scheduler, max_repeats, steps_to_last, past_arrivals)
        if growth:
            run._growth = growth[0]
        return run

    def new_blocks_per_step(self, plan: StepPlan, num_steps: int) -> list[int]:
        """The blocks the decodes of this segment take at each of its first `num_steps` steps,
        the first entry counting every block taken since the counters stood."""
        growth = self._growth
        if growth is None:
            growth = self._growth = self.scheduler.kv_cache.decode_growth(plan.seqs)
        return growth.new_blocks_per_step(num_steps, self.num_steps_before)

    def apply(self, plan: StepPlan, num_steps: int, now: float) -> list[Request]:
        """`update` for the segment `plan` run `num_steps` times (at most max_repeats), the last
        step ending at `now`: each decode gained a token a step and takes the blocks it grew
        into now. Returns the requests that finished."""
        if num_steps > self.max_repeats:
            raise ValueError(f"the executor ran a plan {num_steps} times; its scheduler allowed "
                             f"{self.max_repeats}")
        seqs = plan.seqs
        num_steps_since = self.num_steps_before + num_steps   # since the counters stood
        self._advance(seqs, num_steps_since, now)
        if num_steps < self.max_repeats:
            return []   # cut short: max_repeats is at most the steps to the first finish
        # (in C: those whose last output was the last step's)
        finishing = list(compress(seqs, map(num_steps_since.__ge__, self.steps_to_last_output)))
        finish = self.scheduler.finish_sequence
        return [seq.request for seq in finishing if finish(seq, now)]

    def continue_past_finishes(self, plan: StepPlan, now: float) -> list[Request] | None:
        """After the segment `plan` ran its max_repeats steps, the last ending at `now` (the
        simulator, where nothing from outside reaches the replica before then): if some of its
        sequences reached their output length there and the next steps would plan the same
        batch without them (the scheduler `runs_past_finishes`, the pool holds the rest's
        growth), finish them as `update` would at `now`, make `plan` the rest's next segment and
        return the requests that finished; else None, nothing changed."""
        scheduler = self.scheduler
        kv_cache = scheduler.kv_cache
        if not scheduler.runs_past_finishes() or not kv_cache.frees_in_any_order():
            return None
        seqs = plan.seqs
        num_steps = self.num_steps_before + self.max_repeats   # since the counters stand
        steps_to_last = self.steps_to_last_output
        num_finishing = steps_to_last.count(num_steps)   # (in C)
        if not num_finishing or num_finishing == len(seqs):
            return None   # the pool ended the steps, or the whole batch finished
        # Usually one or two finish: found by index and taken out of copies (memmoves in C, not
        # a pass over the batch per list).
        indices = [steps_to_last.index(num_steps)]
        while len(indices) < num_finishing:
            indices.append(steps_to_last.index(num_steps, indices[-1] + 1))
        finishing = [seqs[index] for index in indices]
        rest, rest_to_last = seqs.copy(), steps_to_last.copy()
        for index in reversed(indices):
            del rest[index], rest_to_last[index]
        # The finishing ones take their growth before they free it all: not counted as free
        # (at most a block every block_size steps each; exactly where that is too many).
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
        # The same batch less the finished, a decode each, as the scheduler plans it: each
        # decode's context num_steps tokens on from where its counters stand.
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
        scheduler.rest_of_run(plan)
        self.steps_to_last_output = rest_to_last
        self.max_repeats = max_repeats
        self.num_steps_before = num_steps
        return finished

    def _advance(self, seqs: list[Sequence], num_steps: int, now: float) -> None:
        """Each of the decoding `seqs` gained a token at each of `num_steps` steps, the last
        ending at `now`; the blocks it grew into are taken now."""
        # Sequence.advance(num_steps, num_steps, now) written out: a call per sequence here, the
        # repeated steps' hot loop, costs a few per cent of a run.
        num_more_tokens = num_steps - 1
        for seq in seqs:
            num_computed = seq.num_tokens + num_more_tokens
            seq.num_computed_tokens = num_computed
            seq.num_tokens = num_computed + 1
            seq.num_output_tokens += num_steps
            seq.last_token_time = now
        # Slots up to there, taken in one pass of the KV manager (after one step, the slots
        # taken when it was planned suffice).
        if (num_more_tokens and self.scheduler.kv_cache.append_slots(seqs, computed=True)
                < len(seqs)):
            raise RuntimeError("the KV pool could not hold the repeated steps its scheduler "
                               "planned")


def _num_steps_the_pool_holds(kv_cache: RepeatingKVCache, seqs: list[Sequence], first_step: int,
                              num_steps: int, free_blocks: int,
                              made_growth: list[DecodeGrowth] | None = None) -> int:
    """How many of the `num_steps` repeated steps from step `first_step` of a run (where the
    decoding `seqs`' counters stand at its start) can take the blocks the decodes grow into,
    by then and at each, from `free_blocks` (0 to num_steps). The decodes' growth, where it
    was made, is appended to `made_growth`."""
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
