"""KV retention's part of the scheduler: kept blocks are released, oldest first, for a running
request or a returned session's turn, and a turn whose blocks are kept may pass a head that does
not fit."""
from __future__ import annotations

from collections.abc import Callable

from policies.batching.admission import Admission
from policies.protocols import KVRetentionPolicy
from policies.types import Request, StepPlan


class KeptTurns:
    """`released_for_running`: kept blocks were released for a running request in the plan
    being made (the pool grew after the queue's head was refused); `replanning`: planning again
    after releasing kept blocks."""

    __slots__ = ("retention", "admission", "released_for_running", "replanning")

    def __init__(self, retention: KVRetentionPolicy, admission: Admission):
        self.retention = retention
        self.admission = admission
        self.released_for_running = False
        self.replanning = False

    def new_step(self, now: float) -> None:
        self.retention.expire(now)
        self.released_for_running = False

    def admit_turns(self, plan: StepPlan, token_budget: int, now: float, *, chunked: bool,
                    may_admit: Callable[[Request], bool],
                    take_waiting: Callable[[Request], None]) -> int:
        """Admit, in arrival order, the waiting turns whose sessions' blocks are kept, past a
        head that did not fit: each costs only its new tokens, and waiting would hold the kept
        blocks idle. Returns the budget left."""
        retention, admission = self.retention, self.admission
        waiting = admission.queues.waiting
        for request in [request for request in waiting if retention.holds_for(request)]:
            admission.short_of_blocks = False
            budget_left = admission.admit(request, plan, token_budget, now, chunked, may_admit,
                                          take_waiting)
            # A session whose turn is here goes before those still waiting on their tools.
            while (budget_left is None and admission.short_of_blocks
                   and retention.release_oldest(now, idle_only=True)):
                admission.short_of_blocks = False
                budget_left = admission.admit(request, plan, token_budget, now, chunked,
                                              may_admit, take_waiting)
            if budget_left is not None:
                token_budget = budget_left
                if token_budget <= 0:
                    break
        return token_budget

    def release_for_running(self, now: float) -> bool:
        """Before a running request is preempted for memory, release the longest-kept session's
        blocks instead (a preemption throws computed work away for sure); False: none kept."""
        if self.retention.release_oldest(now):
            self.released_for_running = True
            return True
        return False

    def plan_releasing(self, schedule: Callable[[float], StepPlan],
                       now: float) -> StepPlan | None:
        """For an empty plan with requests unfinished: release the oldest kept blocks, a session
        at a time, until `schedule` plans something (that plan) or nothing is kept (None)."""
        self.replanning = True
        try:
            while self.retention.release_oldest(now):
                plan = schedule(now)
                if not plan.is_empty:
                    return plan
        finally:
            self.replanning = False
        return None
