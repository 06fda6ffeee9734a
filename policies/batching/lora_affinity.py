"""LoRA-adapter affinity (S-LoRA / dLoRA-style): admits requests whose adapter is in the batch,
then loaded, then any that fits, so a step loads as few adapters as it can; a request waiting
`max_wait_s` goes first so nothing starves."""
from __future__ import annotations

from policies.batching.continuous import ContinuousBatchingScheduler
from policies.types import Request, StepPlan
from policies.validators import positive_number


class LoRAAffinityScheduler(ContinuousBatchingScheduler):
    # (policies/decode_run.py) A request kept out stays out while the batch, the loaded adapters
    # and the queue stay as they are, until the head ages past max_wait_s; an arrival may go
    # ahead of it, so a run of repeated steps ends at the next arrival and at that age.
    admits_in_arrival_order = True
    plain_schedule = True   # its _finish_plan ends runs where its choice could change

    def __init__(self, *args, max_wait_s: float = 60.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_wait_s = positive_number("scheduler.max_wait_s", max_wait_s)

    def next_waiting(self, now: float) -> Request:
        waiting = self.waiting
        head = waiting[0]
        lora = self.lora
        if lora is None or now - head.arrival_time >= self.max_wait_s:
            return head   # (the oldest, but for recomputed requests sent back to the front)
        in_batch = lora.batch_loras
        loaded = None
        fitting = None
        for request in waiting:
            lora_id = request.lora_id
            if lora_id is None or lora_id in in_batch:
                return request
            if loaded is None and lora.is_loaded(lora_id) and lora.fits(lora_id):
                loaded = request
            elif fitting is None and lora.fits(lora_id):
                fitting = request
        return loaded or fitting or head

    def _finish_plan(self, plan: StepPlan) -> StepPlan:
        plan = super()._finish_plan(plan)
        run = plan.decode_run
        if run is not None and self.waiting:
            run.past_arrivals = False
            aged_at = self.waiting[0].arrival_time + self.max_wait_s
            if aged_at > self._now:
                run.until = min(run.until, aged_at)
        return plan
