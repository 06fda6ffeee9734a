"""Seconds a speculating step spends proposing its drafts, shared by the roofline and the GPU cost
model; policies.speculation.drafters says how each drafter is charged."""
from __future__ import annotations

from collections.abc import Callable

from policies.types import StepPlan


class DraftCost:
    """`seconds(plan)`: a lookup per speculating sequence, Medusa's heads in one launch, or
    max_draft_len decode steps of a draft model; 0 without a drafter (catch-up not counted)."""

    def __init__(self, kind: str | None, ngram_overhead_s_per_seq: float,
                 draft_step_overhead_s: float, medusa_s_per_seq: float, medusa_weights_s: float,
                 draft_step_time: Callable[[StepPlan], float] | None):
        self.kind = kind
        self.ngram_overhead_s_per_seq = ngram_overhead_s_per_seq
        self.draft_step_overhead_s = draft_step_overhead_s
        self.medusa_s_per_seq, self.medusa_weights_s = medusa_s_per_seq, medusa_weights_s
        self.draft_step_time = draft_step_time

    def seconds(self, plan: StepPlan) -> float:
        num_speculating = len(plan.spec_lens)
        if self.kind == "lookup":
            return num_speculating * self.ngram_overhead_s_per_seq
        if self.kind == "heads":
            return (self.draft_step_overhead_s
                    + max(num_speculating * self.medusa_s_per_seq, self.medusa_weights_s))
        if self.draft_step_time is None:
            return 0.0
        mean_context = plan.decode_context_tokens / max(plan.num_decode_seqs, 1)
        draft_step = StepPlan(num_decode_seqs=num_speculating,
                              decode_context_tokens=round(num_speculating * mean_context))
        return plan.max_draft_len * self.draft_step_time(draft_step)
