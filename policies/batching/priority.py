"""Preemptive priority: a lower `Request.priority` (vLLM's convention) is admitted first and
preempts less important running requests rather than wait; a subclass ranks its own way (`rank`)."""
from __future__ import annotations

from policies.batching.continuous import ContinuousBatchingScheduler
from policies.types import Request, StepPlan
from policies.validators import boolean


class PriorityScheduler(ContinuousBatchingScheduler):
    # It reorders the queue: no repeated steps while requests wait
    repeated_steps_past_arrivals = False
    repeated_steps = True   # ranks and preempts only while requests wait: no run then

    def __init__(self, *args, preempt_to_admit: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        # False: priority orders admission only.
        self.preempt_to_admit = boolean("scheduler.preempt_to_admit", preempt_to_admit)

    def rank(self, request: Request) -> int:
        """How important a request is now: lower goes first."""
        return request.priority

    def next_waiting(self, now: float) -> Request:
        return min(self.waiting, key=lambda request: (self.rank(request), request.arrival_time,
                                                      request.request_id))

    def _victim_candidates(self, candidates: list[Request]) -> list[Request]:
        return self._highest(candidates, self.rank)   # the least important

    def _admit_prefills(self, plan: StepPlan) -> None:
        """Admit the most important first, preempting below the head while it waits; nothing
        passes a swapped request as important as the head, since it came first."""
        budget = self.max_num_batched_tokens
        while self.waiting:
            head = self.next_waiting(self._now)
            head_rank = self.rank(head)
            if self.swapped and min(map(self.rank, self.swapped)) <= head_rank:
                return
            budget = self._admit_waiting(plan, budget, chunked=False)
            if head not in self.waiting:
                continue   # admitted: the next head may fit too, or preempt in turn
            need = sum(seq.num_tokens - seq.num_computed_tokens
                       for seq in head.unfinished_sequences())
            victims = [request for request in self.running if self.rank(request) > head_rank]
            if need > budget or not victims or not self.preempt_to_admit:
                return   # this step's budget is spent, or nobody ranks below the head
            self._preempt(self.preemption.select_victim(self._victim_candidates(victims)), plan)
