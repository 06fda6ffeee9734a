"""Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024):
admission goes to the tenant with the least weighted service so far (prompt tokens 1, output
tokens 2, as the summary's `jain_fairness`), so a heavy tenant cannot take the server from a light
one. A returning tenant's counter is lifted to the active minimum so idle time is not banked.

Counters change only in `update` (which sees the simulator's repeated steps as one call that added
their tokens to each sequence) and at admission, and admission reads them only while something
waits, when the steps do not repeat: repeated steps stay exact.
"""
from __future__ import annotations

from collections.abc import Mapping

from policies.batching.continuous import ContinuousBatchingScheduler
from policies.types import Request, StepPlan, StepResult
from policies.validators import positive_number

INPUT_WEIGHT = 1
OUTPUT_WEIGHT = 2


class VirtualTokenCounterScheduler(ContinuousBatchingScheduler):
    # Its order moves with service, and its update charges each step
    repeated_steps_past_arrivals = False
    repeated_steps_past_finishes = False
    repeated_steps = True

    def __init__(self, *args, tenant_weights: Mapping | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if tenant_weights is None:
            tenant_weights = {}
        if not isinstance(tenant_weights, Mapping):
            raise ValueError(f"scheduler.tenant_weights must be a mapping {{tenant: weight}}, "
                             f"got {tenant_weights!r}")
        self.tenant_weights = {tenant: positive_number(
            f"scheduler.tenant_weights.{tenant}", weight)
            for tenant, weight in tenant_weights.items()}
        self.counters: dict[str, float] = {}        # tenant -> weighted service so far
        self._num_active: dict[str, int] = {}       # tenant -> its waiting, running, swapped
        self._last_left = 0.0                       # the counter of the last tenant to go idle
        self._outputs_counted: dict[Request, int] = {}   # admitted request -> outputs counted

    def add_request(self, request: Request, now: float) -> None:
        super().add_request(request, now)
        if request.rejected_reason is not None:
            return
        tenant = request.tenant
        if not self._num_active.get(tenant):
            active = [self.counters[t] for t, count in self._num_active.items() if count]
            floor = min(active) if active else self._last_left
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)
        self._num_active[tenant] = self._num_active.get(tenant, 0) + 1

    def next_waiting(self, now: float) -> Request:
        """The first waiting request of the waiting tenant with the smallest counter."""
        counters = self.counters
        best = None
        best_counter = 0.0
        seen = set()
        for request in self.waiting:
            tenant = request.tenant
            if tenant in seen:
                continue
            seen.add(tenant)
            counter = counters[tenant]
            if best is None or counter < best_counter:
                best, best_counter = request, counter
        return best

    def _take_waiting(self, request: Request) -> None:
        super()._take_waiting(request)
        if request.first_scheduled_time is None:   # its prompt, once (not its recomputes)
            self._charge(request.tenant, INPUT_WEIGHT * request.prompt_len)
        self._outputs_counted.setdefault(request, request.num_output_tokens)

    def _victim_candidates(self, candidates: list[Request]) -> list[Request]:
        return self._highest(candidates, lambda request: self.counters[request.tenant])

    def update(self, plan: StepPlan, result: StepResult, now: float) -> list[Request]:
        finished = super().update(plan, result, now)
        counted = self._outputs_counted
        for seq in plan.seqs:
            request = seq.request
            before = counted[request]
            total = request.num_output_tokens   # all its samples (a request of n > 1 repeats)
            if total != before:
                counted[request] = total
                self._charge(request.tenant, OUTPUT_WEIGHT * (total - before))
        for request in finished:
            del counted[request]
            self._num_active[request.tenant] -= 1
            if not self._num_active[request.tenant]:
                self._last_left = self.counters[request.tenant]
        return finished

    def _charge(self, tenant: str, service: int) -> None:
        self.counters[tenant] += service / self.tenant_weights.get(tenant, 1.0)
