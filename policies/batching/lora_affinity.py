"""LoRA-adapter affinity (S-LoRA / dLoRA-style): admits requests whose adapter is in the batch,
then loaded, then any that fits, so a step loads as few adapters as it can; a request waiting
`max_wait_s` goes first so nothing starves."""
from __future__ import annotations

from policies.batching.continuous import ContinuousBatchingScheduler
from policies.types import Request, StepPlan
from policies.validators import positive_number


class LoRAAffinityScheduler(ContinuousBatchingScheduler):
    # A request kept out stays out while the batch, the loaded adapters and the queue stay as
    # they are, until the head ages past max_wait_s (repeated_steps_bounds ends runs there).
    repeated_steps_past_arrivals = True
    repeated_steps = True

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

    def repeated_steps_bounds(self, plan: StepPlan) -> tuple[bool, float] | None:
        """An arrival may go ahead of a waiting head, which itself goes first at max_wait_s."""
        bounds = super().repeated_steps_bounds(plan)
        if bounds is None or not self.waiting:
            return bounds
        until = bounds[1]
        aged_at = self.waiting[0].arrival_time + self.max_wait_s
        if aged_at > self._now:
            until = min(until, aged_at)
        return False, until
