"""The features of a step that its duration depends on: what the profiler measures over, what the
profiled cost model predicts from. Read from a StepPlan's aggregates, never per sequence."""
from __future__ import annotations

from policies.types import StepPlan

# Names and order of the feature vector. A profile stores them, so a model fitted on one version
# of this list refuses to load against another.
STEP_FEATURES: tuple[str, ...] = (
    "num_prefill_tokens",          # tokens of prefill chunks (linear layers, compute-bound)
    "num_prefill_seqs",            # prefill chunks (per-sequence overhead, LM head rows)
    "sum_squared_prefill_chunks",  # Σ chunk² (causal attention within a chunk)
    "prefill_attention_work",      # Σ chunk × context after it (attention over cached context)
    "num_decode_seqs",             # decoding sequences (one token each)
    "decode_context_tokens",       # Σ context of decodes: KV tokens read
    "num_blocks_copied",           # copy-on-write copies
    "num_blocks_swapped",          # swap-outs + swap-ins
)


def step_features(plan: StepPlan) -> tuple[float, ...]:
    """The plan's feature vector, in STEP_FEATURES order."""
    return (
        float(plan.num_prefill_tokens),
        float(plan.num_prefill_seqs),
        float(plan.sum_squared_prefill_chunks),
        float(plan.prefill_attention_work),
        float(plan.num_decode_seqs),
        float(plan.decode_context_tokens),
        float(len(plan.blocks_to_copy)),
        float(len(plan.blocks_to_swap_out) + len(plan.blocks_to_swap_in)),
    )
