"""A run of repeated steps (sim/core/repeated_steps.py): the decodes' counters where it began,
the steps each has to its last output, the block growth the pool does not hold yet, and the
decodes that joined it late; the steps' loop drives it."""
from __future__ import annotations

from itertools import compress
from typing import TYPE_CHECKING

from policies.types import Request, Sequence, StepPlan

if TYPE_CHECKING:
    from sim.core.repeated_steps import RepeatedStepsScheduler


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
            check_held(self.scheduler.kv_cache.append_slots(plan.seqs), plan.seqs)

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
                free_blocks - finishing_growth.blocks_between(held, num_steps - 1), finishing)
        if not max_repeats:
            return None
        finished = self._leave(plan, num_steps, finishing, rest, rest_to_last, now)
        self.max_repeats = max_repeats
        return finished

    def leave_finished(self, plan: StepPlan, num_part_steps: int, now: float) -> list[Request]:
        """After `num_part_steps` steps of the plan, the last ending at `now`: finish the decodes
        whose last output that was and make `plan` the rest's next step (some are left: a pause
        keeps them)."""
        num_steps = self.num_steps_before + num_part_steps
        num_finishing = self.steps_to_last_output.count(num_steps)   # (none before max_repeats)
        if not num_finishing:
            plan.decode_context_tokens += num_part_steps * len(plan.seqs)
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
            check_held(self.scheduler.kv_cache.take_computed_slots(seqs), seqs)

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
        taken = -growth.blocks_between(0, held) if held else 0
        for step, num_blocks in enumerate(growth.new_blocks_per_step(num_steps, first_step)):
            taken += num_blocks
            if taken > free_blocks:
                return step
        return num_steps


def _num_block_steps(num_left: int, first: int, last: int, block_size: int) -> int:
    """At how many of the steps first + 1 to `last` a decode counted with `num_left` slots left
    takes a block (steps num_left + 1, num_left + 1 + block_size, ...)."""
    return (last - 1 - num_left) // block_size - (first - 1 - num_left) // block_size


def check_held(num_held: int, seqs: list[Sequence]) -> None:
    """Raise where the pool held fewer of `seqs` than the run planned for."""
    if num_held < len(seqs):
        raise RuntimeError("the KV pool could not hold the repeated steps its scheduler planned")
