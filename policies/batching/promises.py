"""The promises the simulator's repeated steps rest on (a run skips the calls they are about),
and how a subclass that overrides what a promise is about withdraws it.

- `repeated_steps`: `schedule` and every hook it reaches plan from the queues, the batch and the
  pool alone (not the clock, not a count of steps); a class that defines `schedule` states it.
- `repeated_steps_past_arrivals`: `next_waiting` takes the queue's head, so arrivals queue
  behind a head kept out.
- `repeated_steps_past_finishes`: `update` does per step only what a decode's next token needs,
  so decodes may finish inside a run.
"""
from __future__ import annotations

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
