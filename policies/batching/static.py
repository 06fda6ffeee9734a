"""Static (request-level) batching, as HF generate serves: no request joins until the whole batch
is done, so short requests wait for the longest one."""
from __future__ import annotations

from policies.batching.continuous import ContinuousBatchingScheduler
from policies.types import Request, StepPlan


class StaticBatchingScheduler(ContinuousBatchingScheduler):
    # It plans from the queues, the pool and the batch's members alone
    repeated_steps = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batch: set[int] = set()  # request ids of the current batch
        self._forming = False

    def schedule(self, now: float) -> StepPlan:
        self._forming = not self.batch
        plan = super().schedule(now)
        if self._forming:
            self.batch = {seq.request.request_id for seq in plan.seqs}
            self._forming = False
        return plan

    def _may_admit(self, request: Request) -> bool:
        return self._forming or request.request_id in self.batch

    def _on_request_finished(self, request: Request) -> None:
        self.batch.discard(request.request_id)
