"""The StepPlan aggregates a step's duration depends on: what the profiler measures over and the
profiled cost model predicts from."""
from __future__ import annotations

from policies.types import StepPlan

# Names and order of the feature vector; a profile stores the names it was fitted with.
STEP_FEATURES: tuple[str, ...] = (
    "num_prefill_tokens",          # tokens of prefill chunks (linear layers, compute-bound)
    "num_prefill_seqs",            # prefill chunks (per-sequence overhead, LM head rows)
    "sum_squared_prefill_chunks",  # Σ chunk² (causal attention within a chunk)
    "prefill_attention_work",      # Σ chunk × context after it (attention over cached context)
    "num_decode_seqs",             # decoding sequences (one token each)
    "batched",                     # 1 when the step runs more than one sequence: a lone one is
                                   # cheaper than a line through batches predicts (GEMV kernels)
    "decode_context_tokens",       # Σ context of decodes: KV tokens read
    "num_blocks_copied",           # copy-on-write copies
    "num_blocks_swapped",          # swap-outs + swap-ins
    "num_draft_tokens",            # speculative drafts verified (more batched tokens, queries)
    "draft_context_work",          # Σ k × context over speculating decodes: the k verified
                                   # queries' and a draft model's k steps' attention
    "speculating",                 # 1 when the step verifies drafts (verification's fixed work)
    "draft_model_steps",           # longest draft - 1: a draft model's sequential single-token
                                   # steps (its first draft comes from its pass over the step)
    "draft_catch_up_tokens",       # tokens a draft model runs again in its pass over the step,
                                   # where it lags the target (Sequence.draft_lag)
)


def draft_context_work(plan: StepPlan) -> int:
    """Σ over the speculating decodes of k × their context (the cached tokens and the one
    the step decodes)."""
    spec_lens = plan.spec_lens
    if not spec_lens:
        return 0
    return sum(spec_lens[seq.seq_id] * (seq.num_computed_tokens + 1) for seq in plan.seqs
               if seq.seq_id in spec_lens)


def step_features(plan: StepPlan) -> tuple[float, ...]:
    """The plan's feature vector, in STEP_FEATURES order."""
    return (
        float(plan.num_prefill_tokens),
        float(plan.num_prefill_seqs),
        float(plan.sum_squared_prefill_chunks),
        float(plan.prefill_attention_work),
        float(plan.num_decode_seqs),
        1.0 if plan.num_prefill_seqs + plan.num_decode_seqs > 1 else 0.0,
        float(plan.decode_context_tokens),
        float(len(plan.blocks_to_copy)),
        float(len(plan.blocks_to_swap_out) + len(plan.blocks_to_swap_in)),
        float(plan.num_draft_tokens),
        float(draft_context_work(plan)),
        1.0 if plan.num_draft_tokens else 0.0,
        float(max(plan.max_draft_len - 1, 0)),
        float(plan.draft_catch_up_tokens),
    )
