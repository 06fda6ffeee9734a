"""BaseScheduler's part of KV retention: blocks kept for idle sessions are worth less than a
running request's progress or a returned turn, so they are released for them, oldest first."""
from __future__ import annotations

from policies.types import StepPlan


class KeptTurns:
    """BaseScheduler's `_admit_kept_turns`, `_release_kept_blocks` and
    `_plan_releasing_kept_blocks`, on its queues and its `kv_retention`."""

    def _admit_kept_turns(self, plan: StepPlan, token_budget: int, *, chunked: bool) -> int:
        """Admit the waiting turns whose blocks are kept, past a head that did not fit: they need
        only their new tokens, and waiting would hold the kept blocks idle. Returns the budget left."""
        retention = self.kv_retention
        for request in [request for request in self.waiting if retention.holds_for(request)]:
            self._short_of_blocks = False
            budget_left = self._admit(request, plan, token_budget, chunked=chunked)
            # A session whose turn is here goes before those still waiting on their tools
            # (whose pins would not help a turn refused its seat or budget).
            while (budget_left is None and self._short_of_blocks
                   and retention.release_oldest(self._now, idle_only=True)):
                self._short_of_blocks = False
                budget_left = self._admit(request, plan, token_budget, chunked=chunked)
            if budget_left is not None:
                token_budget = budget_left
                if token_budget <= 0:
                    break
        return token_budget

    def _release_kept_blocks(self) -> bool:
        """Release the longest-kept session's blocks instead of preempting (kept blocks are only a
        chance of reuse, a preemption surely loses work); False when nothing is kept."""
        if self.kv_retention is not None and self.kv_retention.release_oldest(self._now):
            self._released_for_running = True
            return True
        return False

    def _plan_releasing_kept_blocks(self) -> StepPlan | None:
        """For an empty plan with requests unfinished: release kept blocks a session at a time
        until a plan is not empty; None when nothing is kept."""
        self._replanning = True
        try:
            while self.kv_retention.release_oldest(self._now):
                plan = self.schedule(self._now)
                if not plan.is_empty:
                    return plan
        finally:
            self._replanning = False
        return None
