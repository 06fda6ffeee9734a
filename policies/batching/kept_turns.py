"""BaseScheduler's part of KV retention (policies/memory/retention.py, `kv_retention=pin`): the
blocks a policy keeps for idle sessions are worth less than a running request's progress or a
returned session's turn, and are released for them, oldest first; a waiting turn whose
session's blocks are kept goes ahead of a queue head that does not fit."""
from __future__ import annotations

from policies.types import StepPlan


class KeptTurns:
    """BaseScheduler's `_admit_kept_turns`, `_release_kept_blocks` and
    `_plan_releasing_kept_blocks`, on its queues and its `kv_retention`."""

    def _admit_kept_turns(self, plan: StepPlan, token_budget: int, *, chunked: bool) -> int:
        """Admit, in arrival order, the waiting turns whose sessions' blocks the retention
        policy keeps, past a head that did not fit: their context is on the device already, so
        each costs only its new tokens, which the head (needing its whole prompt) could not use;
        making them wait would hold the kept blocks idle behind it. Returns the budget left."""
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
        """Before a running request is preempted for memory: release the retention policy's
        longest-kept session's blocks instead (kept on the chance of a next turn, where a
        preemption throws computed work away for sure); False when nothing is kept."""
        if self.kv_retention is not None and self.kv_retention.release_oldest(self._now):
            self._released_for_running = True
            return True
        return False

    def _plan_releasing_kept_blocks(self) -> StepPlan | None:
        """An empty plan with requests unfinished: release the retention policy's oldest kept
        blocks, one session at a time, until a plan is not empty (that plan, finished), or
        nothing is kept (None)."""
        self._replanning = True
        try:
            while self.kv_retention.release_oldest(self._now):
                plan = self.schedule(self._now)
                if not plan.is_empty:
                    return plan
        finally:
            self._replanning = False
        return None
