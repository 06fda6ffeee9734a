"""Chunked prefill (Sarathi-Serve, vLLM V1): decodes and prefill chunks share one token budget per
step, so decodes never stall behind a long prompt, at the price of prefills taking several steps."""
from __future__ import annotations

from policies.batching.base import BaseScheduler
from policies.types import StepPlan


class ChunkedPrefillScheduler(BaseScheduler):
    # It plans from the queues, the batch and the pool alone
    repeated_steps = True

    def schedule(self, now: float) -> StepPlan:
        plan = self._new_plan(now)
        budget, preempted = self._schedule_running(plan, self.max_num_batched_tokens,
                                                   chunked=True)
        if not preempted:
            budget = self._swap_in(plan, budget, chunked=True)
            if not self.swapped:
                self._admit_waiting(plan, budget, chunked=True)
        return self._finish_plan(plan)
