"""The promises the simulator's repeated steps rest on (a run skips the calls they are about),
and how a subclass that overrides what a promise is about withdraws it.

- `repeated_steps`: `schedule` and every hook it reaches plan from the queues, the batch and the
  pool alone (not the clock, not a count of steps); a class that defines `schedule` states it.
- `repeated_steps_past_arrivals`: `next_waiting` takes the queue's head, so arrivals queue
  behind a head kept out.
- `repeated_steps_past_finishes`: `update` does per step only what a decode's next token needs,
  so decodes may finish inside a run.
- `repeated_steps_pause_for_prefills`: `schedule` admits waiting requests first, reading no
  running sequence, and plans every decode only when it admits none, so a run may pause over
  prefill steps (`admit_while_paused`) and go on with their decodes (`plan_paused_decodes`).

The queries the simulator asks a `BaseScheduler` before a run are here beside them.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from policies.batching.base import BaseScheduler
    from policies.types import StepPlan

# The hooks with a promise of their own: overriding one withdraws only that promise.
_PROMISE_OF_HOOK = {"next_waiting": "repeated_steps_past_arrivals",
                    "update": "repeated_steps_past_finishes"}


def _overrides_a_planning_hook(cls: type) -> bool:
    """Whether `cls`'s own body defines `schedule` or overrides any other inherited method or
    property (but a constructor and the hooks above), any of which may plan by what a run skips."""
    for name, value in vars(cls).items():
        if (name.startswith("__") or name in _PROMISE_OF_HOOK
                or not (callable(value) or isinstance(value, (staticmethod, classmethod,
                                                              property)))):
            continue
        if name == "schedule" or any(name in vars(base) for base in cls.__mro__[1:]):
            return True
    return False


def withdraw_unstated_promises(cls: type) -> None:
    """Set False each promise whose hook `cls` overrides without restating the promise."""
    own = vars(cls)
    for hook, promise in _PROMISE_OF_HOOK.items():
        if hook in own and promise not in own:
            setattr(cls, promise, False)
    if "repeated_steps" not in own and _overrides_a_planning_hook(cls):
        cls.repeated_steps = False
    if "repeated_steps_pause_for_prefills" not in own and (
            _overrides_a_planning_hook(cls) or any(hook in own for hook in _PROMISE_OF_HOOK)):
        cls.repeated_steps_pause_for_prefills = False


def repeated_steps_bounds(scheduler: BaseScheduler, plan: StepPlan) -> tuple[bool, float] | None:
    """BaseScheduler.repeated_steps_bounds: None unless the next steps would plan this decode
    batch again; else whether they may run past arrivals and when kept blocks next expire."""
    # Speculation decides per step and learns from each, so it never repeats.
    if (not plan.num_decode_seqs or scheduler.drafting is not None
            or not scheduler._retention_expires or not plans_the_batch_again(scheduler, plan)):
        return None
    if scheduler.kv_retention is None:
        # A blocked FCFS head keeps every later arrival waiting behind it.
        return bool(scheduler.queues.waiting), math.inf
    # Kept blocks may let a session's next turn go ahead of the head (KeptTurns.admit_turns).
    return False, scheduler.kv_retention.next_expiry()


def plans_the_batch_again(scheduler: BaseScheduler, plan: StepPlan) -> bool:
    """Whether, with no arrival, `schedule` would plan this decode batch again next step, each
    decode a token on (docs/simulator.md#repeated-steps says why each case breaks it)."""
    queues = scheduler.queues
    num_decoding = queues.num_running_seqs - len(scheduler.handoff.receiving)
    return not (queues.swapped or plan.num_prefill_seqs or plan.blocks_to_copy
                or plan.blocks_to_swap_out or plan.blocks_to_swap_in
                or plan.preempted_recompute or plan.blocks_to_offload or plan.blocks_to_load
                or (plan.lora is not None and plan.lora.to_load)
                or plan.num_decode_seqs != num_decoding
                or (scheduler.kept_turns is not None
                    and scheduler.kept_turns.released_for_running)
                or (queues.waiting and not scheduler.repeated_steps_past_arrivals))


def may_repeat_past_finishes(scheduler: BaseScheduler) -> bool:
    """BaseScheduler.may_repeat_past_finishes: whether decodes that finish may leave at their
    step while the rest run on."""
    queues = scheduler.queues
    return (scheduler.repeated_steps_past_finishes
            and not (queues.waiting or queues.swapped or scheduler.handoff.receiving))


def may_pause_for_prefills(scheduler: BaseScheduler) -> bool:
    """BaseScheduler.may_pause_for_prefills: whether a run of its decodes may pause over prefill
    steps now (nothing but waiting requests and the decodes themselves to plan)."""
    return (scheduler.repeated_steps_pause_for_prefills and scheduler.drafting is None
            and scheduler.kv_retention is None and scheduler.lora is None
            and not scheduler.queues.swapped and not scheduler.handoff.receiving)
