"""Speculative decoding's part of the scheduler: how many drafts each decode proposes and gets
slots for, and what the step's accepted drafts tell the speculation policy."""
from __future__ import annotations

from collections.abc import Callable

from policies.protocols import KVCacheManager, SpeculationPolicy
from policies.types import Request, Sequence, StepPlan, StepResult


class SpeculativeDecodes:
    """Decodes with drafts (`StepPlan.spec_lens`), with a SpeculationPolicy that drafts."""

    __slots__ = ("speculation", "kv_cache", "max_model_len")

    def __init__(self, speculation: SpeculationPolicy, kv_cache: KVCacheManager,
                 max_model_len: int):
        self.speculation = speculation
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len

    def draft_lens(self, decodes: list[Sequence], token_budget: int) -> list[int]:
        """k for each decode: the policy's k for this batch, lowered (down to 0) so that every
        decode still gets its own token within the budget, and so that no draft passes the
        request's output length or max_model_len."""
        if not decodes:
            return []
        k = self.speculation.num_speculative_tokens(len(decodes))
        max_k = self.speculation.max_num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= max_k:
            raise ValueError(f"{type(self.speculation).__name__}.num_speculative_tokens returned "
                             f"{k!r}; it must be an integer in [0, {max_k}]")
        k = min(k, (token_budget - len(decodes)) // len(decodes))
        max_model_len = self.max_model_len
        return [max(0, min(k, seq.request.output_len - seq.num_output_tokens - 1,
                           max_model_len - seq.num_tokens)) for seq in decodes]

    def schedule_decodes(self, plan: StepPlan, decodes: list[Sequence], token_budget: int,
                         preempt_for: Callable[[Request, StepPlan, list[Sequence]], Request]
                         ) -> tuple[int, bool]:
        """Schedule each running decode with slots for its k drafts, dropping drafts that do not
        fit before anyone is preempted. Returns the tokens scheduled and whether anything was
        preempted."""
        preempted_any = False
        draft_lens = self.draft_lens(decodes, token_budget)
        spec_lens: dict[int, int] = {}
        kv_cache = self.kv_cache
        index = 0
        while index < len(decodes):
            seq = decodes[index]
            k = draft_lens[index]
            if k and kv_cache.allocate_slots(seq, seq.num_tokens + k):
                spec_lens[seq.seq_id] = k
            elif not kv_cache.allocate_slots(seq, seq.num_tokens):
                if spec_lens:
                    # Drafts give their slots back before anyone is preempted, so no victim
                    # leaves holding draft slots.
                    for other in decodes[:index]:
                        if other.seq_id in spec_lens:
                            kv_cache.trim_slots(other, other.num_tokens)
                    spec_lens.clear()
                    draft_lens = [0] * len(decodes)
                    continue
                preempted_any = True
                victim = preempt_for(seq.request, plan, decodes[:index])
                index -= sum(1 for other in decodes[:index] if other.request is victim)
                kept = [i for i, other in enumerate(decodes) if other.request is not victim]
                decodes[:] = [decodes[i] for i in kept]
                draft_lens = [draft_lens[i] for i in kept]
                for victim_seq in victim.sequences:
                    spec_lens.pop(victim_seq.seq_id, None)
                continue
            index += 1
        plan.add_decodes(decodes)
        plan.add_drafts(spec_lens)
        return len(decodes) + sum(spec_lens.values()), preempted_any

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        """Tell the speculation policy what each decode proposed and had accepted, and set each
        sequence's `draft_lag` and `starts_run` for its next step."""
        spec_lens = plan.spec_lens
        accepted_by_seq = {}
        if spec_lens:
            if result.num_accepted is not None:
                accepted_by_seq = {seq_id: result.num_accepted[seq_id] for seq_id in spec_lens}
            else:  # an engine that reports tokens only: all but the last one were drafts
                accepted_by_seq = {seq_id: min(len(result.sampled_token_ids[seq_id]) - 1, k)
                                   for seq_id, k in spec_lens.items()}
        for seq in plan.seqs:
            k = spec_lens.get(seq.seq_id, 0)
            accepted = accepted_by_seq.get(seq.seq_id, 0)
            seq.draft_lag = 1 if k and accepted == k else 0
            if k:
                seq.starts_run = accepted < k
        self.speculation.observe(list(spec_lens.values()), list(accepted_by_seq.values()))
