"""Skip-join multi-level feedback queue (FastServe, Wu et al. 2023): level i grants
`base_quantum × 2^i` tokens and a request drops a level per quantum used, so short jobs finish
first without knowing any output length."""
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
        # Skip-join weighs a prefill against the quanta at this many prompt tokens per output token.
        self.prefill_tokens_per_quantum_token = positive_int(
            "scheduler.prefill_tokens_per_quantum_token", prefill_tokens_per_quantum_token)

    def rank(self, request: Request) -> int:
        """The level its prompt let it join at, one lower per quantum used up since."""
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
