"""Shortest job first on the predicted remaining output, with aging so long requests never starve:
`max_wait` (a request waiting `max_wait_s` goes first; FCFS under overload) or `score` (predicted
minus `aging_tokens_per_s` x seconds waited, which orders as predicted + w x arrival at any time,
so a heap keeps admission O(log n))."""
from __future__ import annotations

import heapq
import itertools

from policies.batching.continuous import ContinuousBatchingScheduler
from policies.types import Request, StepPlan
from policies.validators import positive_number

AGING_RULES = ("max_wait", "score")


class ShortestJobFirstScheduler(ContinuousBatchingScheduler):
    # It reorders the queue: no repeated steps while requests wait
    repeated_steps_past_arrivals = False
    repeated_steps = True   # its hooks rank by the request and its prediction alone

    def __init__(self, *args, max_wait_s: float = 30.0, aging: str = "max_wait",
                 aging_tokens_per_s: float = 10.0, **kwargs):
        super().__init__(*args, **kwargs)
        if aging not in AGING_RULES:
            raise ValueError(f"scheduler.aging must be one of {', '.join(AGING_RULES)}, "
                             f"got {aging!r}")
        self.aging = aging
        self.max_wait_s = positive_number("scheduler.max_wait_s", max_wait_s)
        self.aging_tokens_per_s = positive_number("scheduler.aging_tokens_per_s",
                                                  aging_tokens_per_s)
        # aging="score": stale heap entries (left the queue, or ranked again) are skipped lazily.
        self._ranked: list[tuple[float, float, int, int, Request]] = []
        self._rank_of: dict[Request, float] = {}
        self._tiebreak = itertools.count()

    def add_request(self, request: Request, now: float) -> None:
        if request.predicted_output_len is None:
            raise ValueError("scheduler=sjf orders by predicted output length: set a predictor "
                             "(predictor=oracle, noisy or bucket)")
        super().add_request(request, now)
        if self.aging == "score" and request.rejected_reason is None:
            self._rank(request)

    def next_waiting(self, now: float) -> Request:
        if self.aging == "score":
            ranked, rank_of = self._ranked, self._rank_of
            while rank_of.get(ranked[0][-1]) != ranked[0][0]:
                heapq.heappop(ranked)   # admitted since, or ranked again lower
            return ranked[0][-1]
        waiting = self.waiting
        oldest = min(waiting, key=_arrival_order)
        if now - oldest.arrival_time >= self.max_wait_s:
            return oldest
        return min(waiting, key=_predicted_remaining)

    def aged_rank(self, request: Request) -> tuple[float, float, int]:
        """The aged score plus w * now, which orders requests as the score does at any time."""
        remaining, arrival, request_id = _predicted_remaining(request)
        return remaining + self.aging_tokens_per_s * arrival, arrival, request_id

    def _rank(self, request: Request) -> None:
        rank, arrival, request_id = self.aged_rank(request)
        self._rank_of[request] = rank
        heapq.heappush(self._ranked, (rank, arrival, request_id, next(self._tiebreak), request))

    def _take_waiting(self, request: Request) -> None:
        super()._take_waiting(request)
        if self.aging == "score":
            del self._rank_of[request]

    def _preempt(self, request: Request, plan: StepPlan) -> None:
        super()._preempt(request, plan)
        if self.aging == "score" and self.waiting and self.waiting[0] is request:
            self._rank(request)   # a recompute: back in the queue with fewer tokens to go


def _arrival_order(request: Request) -> tuple[float, int]:
    return request.arrival_time, request.request_id


def _predicted_remaining(request: Request) -> tuple[int, float, int]:
    """Predicted tokens still to generate (a recomputed request has some already), then arrival."""
    remaining = request.predicted_output_len - request.num_output_tokens_per_sample
    return max(remaining, 0), request.arrival_time, request.request_id
