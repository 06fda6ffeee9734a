"""Earliest deadline first: admits the waiting request whose TTFT deadline comes first.

With `reject_hopeless`, a never-admitted request whose deadline has passed is rejected at the next
step boundary rather than spend the server on it and make the requests behind it late too.
"""
from __future__ import annotations

import math

from policies.batching.continuous import ContinuousBatchingScheduler
from policies.types import Request, StepPlan, StepResult
from policies.validators import boolean, positive_number

REJECTED_REASON = "slo: TTFT deadline passed before admission"


class EarliestDeadlineFirstScheduler(ContinuousBatchingScheduler):
    # It reorders the queue, and its update rejects at each step
    repeated_steps_past_arrivals = False
    repeated_steps_past_finishes = False
    repeated_steps = True   # deadlines are fixed at arrival

    def __init__(self, *args, slo_ttft_ms: float | None = None, reject_hopeless: bool = False,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.slo_ttft_ms = (None if slo_ttft_ms is None else
                            positive_number("scheduler.slo_ttft_ms", slo_ttft_ms))
        self.reject_hopeless = boolean("scheduler.reject_hopeless", reject_hopeless)

    def deadline(self, request: Request) -> float:
        """When the request's first token is due (s); inf without any TTFT SLO."""
        slo_ms = request.slo_ttft_ms if request.slo_ttft_ms is not None else self.slo_ttft_ms
        return math.inf if slo_ms is None else request.arrival_time + slo_ms / 1000

    def _urgency(self, request: Request) -> tuple[float, float, int]:
        return self.deadline(request), request.arrival_time, request.request_id

    def next_waiting(self, now: float) -> Request:
        return min(self.waiting, key=self._urgency)

    def _victim_candidates(self, candidates: list[Request]) -> list[Request]:
        return self._highest(candidates, self.deadline)   # the latest deadlines

    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[Request]:
        finished = super().update(plan, result, now)
        if self.reject_hopeless and self.waiting:
            finished.extend(self._reject_hopeless(now))
        return finished

    def _reject_hopeless(self, now: float) -> list[Request]:
        """Reject the never-admitted waiting requests whose deadline is past at `now`."""
        hopeless = [request for request in self.waiting
                    if request.first_scheduled_time is None and self.deadline(request) < now]
        if hopeless:
            rejected = set(hopeless)
            kept = [request for request in self.waiting if request not in rejected]
            self.waiting.clear()
            self.waiting.extend(kept)
            for request in hopeless:
                request.rejected_reason = REJECTED_REASON
        return hopeless
