"""Shortest job first: continuous batching that admits the waiting request with the shortest
predicted remaining output (`Request.predicted_output_len`, from the run's length predictor), as
learning-to-rank schedulers do; a request that has waited `max_wait_s` goes first, oldest first,
so long ones never starve.
"""
from __future__ import annotations

from policies.batching.continuous import ContinuousBatchingScheduler
from policies.types import Request
from policies.validators import positive_number


class ShortestJobFirstScheduler(ContinuousBatchingScheduler):
    # (policies/decode_run.py) it reorders the queue: no repeated steps while requests wait
    admits_in_arrival_order = False

    def __init__(self, *args, max_wait_s: float = 30.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_wait_s = positive_number("scheduler.max_wait_s", max_wait_s)

    def add_request(self, request: Request, now: float) -> None:
        if request.predicted_output_len is None:
            raise ValueError("scheduler=sjf orders by predicted output length: set a predictor "
                             "(predictor=oracle, noisy or bucket)")
        super().add_request(request, now)

    def next_waiting(self, now: float) -> Request:
        waiting = self.waiting
        oldest = min(waiting, key=_arrival_order)
        if now - oldest.arrival_time >= self.max_wait_s:
            return oldest
        return min(waiting, key=_predicted_remaining)


def _arrival_order(request: Request) -> tuple[float, int]:
    return request.arrival_time, request.request_id


def _predicted_remaining(request: Request) -> tuple[int, float, int]:
    """Predicted tokens still to generate (a recomputed request has some already), then arrival."""
    remaining = request.predicted_output_len - request.num_output_tokens_per_sample
    return max(remaining, 0), request.arrival_time, request.request_id
