"""Continuous (iteration-level) batching, vLLM-style: FCFS, each step all prefills or all
decodes."""
from __future__ import annotations

from policies.batching.base import BaseScheduler
from policies.types import StepPlan


class ContinuousBatchingScheduler(BaseScheduler):
    # It plans from the queues, the batch and the pool alone
    repeated_steps = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"scheduler.max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_model_len={self.max_model_len} without chunked prefill (a whole prompt "
                f"must fit one step); use scheduler=chunked_prefill or raise it")

    def schedule(self, now: float) -> StepPlan:
        plan = self._new_plan(now)
        self._admit_prefills(plan)
        if plan.seqs:
            return self._finish_plan(plan)
        budget, preempted = self._schedule_running(plan, self.max_num_batched_tokens,
                                                   chunked=False)
        if not preempted:
            self._swap_in(plan, budget, chunked=False)
        return self._finish_plan(plan)

    def _admit_prefills(self, plan: StepPlan) -> None:
        """A prefill step's admissions: waiting requests, none while one is swapped out (those
        came first)."""
        if not self.queues.swapped:
            self._admit_waiting(plan, self.max_num_batched_tokens, chunked=False)
