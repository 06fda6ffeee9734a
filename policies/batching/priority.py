"""Preemptive priority: continuous batching in which a more important request (a lower
`Request.priority`, vLLM's convention) is admitted first and, when memory or max_num_seqs is
short, preempts the least important running requests (with the configured preemption mode)
rather than wait; a decode short of memory preempts the least important request too. Requests of
one priority keep arrival order.
"""
from __future__ import annotations

from policies.batching.continuous import ContinuousBatchingScheduler
from policies.types import Request, StepPlan


class PriorityScheduler(ContinuousBatchingScheduler):
    def next_waiting(self, now: float) -> Request:
        return min(self.waiting, key=_importance)

    def _victim_candidates(self, candidates: list[Request]) -> list[Request]:
        least_important = max(request.priority for request in candidates)
        return [request for request in candidates if request.priority == least_important]

    def _admit_prefills(self, plan: StepPlan) -> None:
        """Admit waiting requests, most important first; while the most important one still
        waits, preempt the least important running request below it and try again. A swapped
        request as important as the head came first: nothing is admitted before it is back."""
        budget = self.max_num_batched_tokens
        while self.waiting:
            head = self.next_waiting(self._now)
            if self.swapped and min(r.priority for r in self.swapped) <= head.priority:
                return
            budget = self._admit_waiting(plan, budget, chunked=False)
            if head not in self.waiting:
                continue   # admitted: the next head may fit too, or preempt in turn
            need = sum(seq.num_tokens - seq.num_computed_tokens
                       for seq in head.unfinished_sequences())
            victims = [request for request in self.running if request.priority > head.priority]
            if need > budget or not victims:
                return   # this step's budget is spent, or nobody ranks below the head
            self._preempt(self.preemption.select_victim(self._victim_candidates(victims)), plan)


def _importance(request: Request) -> tuple[int, float, int]:
    return request.priority, request.arrival_time, request.request_id
