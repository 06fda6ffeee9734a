"""Continuous (iteration-level) batching, vLLM-style: FCFS, each step all prefills or all
decodes."""
from __future__ import annotations

from policies.batching.base import BaseScheduler
from policies.batching.promises import may_pause_for_prefills
from policies.types import Sequence, StepPlan


class ContinuousBatchingScheduler(BaseScheduler):
    # It plans from the queues, the batch and the pool alone, admissions first
    repeated_steps = True
    repeated_steps_pause_for_prefills = True

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

    # ---- a paused run of repeated steps (policies/batching/promises.py) ----

    may_pause_for_prefills = may_pause_for_prefills

    def admit_while_paused(self, now: float) -> StepPlan | None:
        """The prefill step `schedule` would plan now, or None (nothing changed) if it admits none:
        then it would plan the decodes."""
        if not self.queues.waiting:
            return None
        plan = self._new_plan(now)
        self._admit_prefills(plan)
        return self._finish_plan(plan) if plan.seqs else None

    def plan_paused_decodes(self, seqs: list[Sequence], context_tokens: int,
                            now: float) -> StepPlan:
        """The decode step `schedule` would plan now for `seqs` (every running sequence, in its
        order), whose counters a paused run left behind: their summed context given."""
        plan = self._new_plan(now)
        plan.add_decodes(seqs, drafted=False, context_tokens=context_tokens)
        return self._finish_plan(plan)
