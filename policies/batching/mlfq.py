"""Skip-join multi-level feedback queue, after FastServe (Wu et al., 2023): a request's level is
its importance under preemptive priority scheduling. Level i grants `base_quantum × 2^i` output
tokens; a request joins at the first level whose quantum covers its prefill (a long prompt skips
the levels it would overrun at once) and drops a level each time it uses up its quantum, so short
jobs finish ahead of long ones without knowing any output length.
"""
from __future__ import annotations

from policies.batching.priority import PriorityScheduler
from policies.types import Request
from policies.validators import positive_int


class MLFQScheduler(PriorityScheduler):
    # Rank reads a request's tokens, which matter only while requests
    # wait, and no run is planned then (repeated_steps_past_arrivals is False)
    repeated_steps = True

    def __init__(self, *args, num_levels: int = 6, base_quantum: int = 8,
                 prefill_tokens_per_quantum_token: int = 64, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_levels = positive_int("scheduler.num_levels", num_levels)
        self.base_quantum = positive_int("scheduler.base_quantum", base_quantum)
        # How many prompt tokens cost about one output token's step: what skip-join weighs a
        # prefill against the quanta with.
        self.prefill_tokens_per_quantum_token = positive_int(
            "scheduler.prefill_tokens_per_quantum_token", prefill_tokens_per_quantum_token)

    def rank(self, request: Request) -> int:
        """The request's level now: where its prompt let it join, one lower for each quantum it
        has used up since."""
        quantum = self.base_quantum
        level = 0
        prefill_cost = request.prompt_len / self.prefill_tokens_per_quantum_token
        while quantum < prefill_cost and level < self.num_levels - 1:   # skip-join
            quantum *= 2
            level += 1
        served = request.num_output_tokens_per_sample
        while served >= quantum and level < self.num_levels - 1:
            served -= quantum
            quantum *= 2
            level += 1
        return level
