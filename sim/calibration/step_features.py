"""The features of a step that its duration depends on: what the profiler measures over, what the
profiled cost model predicts from.

Most are the StepPlan's aggregates. Three describe the attention's tiles as the engine's torch
kernels run them (kernels/tiling.py): on a CPU each padded tile costs a gather and an attention
call per layer, a batch of decodes with spread-out contexts pads to its tiles' longest (so
Σ context alone under-predicts it), and the queries of a tile pad to its longest query. They
need the sequences' lengths (one pass over the batch), so they are computed only when an
`AttentionTiling` is given.
"""
from __future__ import annotations

from dataclasses import dataclass

from kernels.tiling import tiling_work
from policies.types import StepPlan

# Names and order of the feature vector. A profile stores them, so a model fitted on one version
# of this list refuses to load against another.
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
    "num_attention_tiles",         # padded batches the torch attention runs (per layer)
    "padded_kv_tokens",            # K/V tokens those tiles gather, padding included
    "num_draft_tokens",            # speculative drafts verified (more batched tokens, queries)
    "draft_context_work",          # Σ k × context over speculating decodes: the k verified
                                   # queries' and a draft model's k steps' attention
    "speculating",                 # 1 when the step verifies drafts (verification's fixed work)
    "draft_model_steps",           # longest draft - 1: a draft model's sequential single-token
                                   # steps (its first draft comes from its pass over the step)
    "draft_catch_up_tokens",       # tokens a draft model runs again in its pass over the step,
                                   # where it lags the target (Sequence.draft_lag)
    "padded_attention_scores",     # query x K/V scores the tiles compute: each tile pads its
                                   # queries to its longest and its contexts to its longest
)


@dataclass(frozen=True)
class AttentionTiling:
    """What the tile features need: the KV block size and the tile capacity in tokens
    (kernels.tiling.tile_tokens of the model's K/V bytes per token)."""

    block_size: int
    max_tile_tokens: int


def attention_lengths(plan: StepPlan) -> tuple[list[int], list[int]]:
    """(context length after the step, query length) of every sequence of the plan, as the
    engine's attention sees them: a speculating decode also runs its k drafts."""
    query_lens = list(plan.num_new_tokens)
    if plan.spec_lens:
        for index, seq in enumerate(plan.seqs):
            query_lens[index] += plan.spec_lens.get(seq.seq_id, 0)
    seq_lens = [seq.num_computed_tokens + query_len
                for seq, query_len in zip(plan.seqs, query_lens)]
    return seq_lens, query_lens


def draft_context_work(plan: StepPlan) -> int:
    """Σ over the speculating decodes of k × their context (the cached tokens and the one
    the step decodes)."""
    spec_lens = plan.spec_lens
    if not spec_lens:
        return 0
    return sum(spec_lens[seq.seq_id] * (seq.num_computed_tokens + 1) for seq in plan.seqs
               if seq.seq_id in spec_lens)


def step_features(plan: StepPlan, tiling: AttentionTiling | None = None) -> tuple[float, ...]:
    """The plan's feature vector, in STEP_FEATURES order (tile features 0 without `tiling`)."""
    num_tiles = padded_kv_tokens = padded_scores = 0
    if tiling is not None and plan.seqs:
        seq_lens, query_lens = attention_lengths(plan)
        num_tiles, padded_kv_tokens, padded_scores = tiling_work(
            seq_lens, query_lens, tiling.block_size, tiling.max_tile_tokens)
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
        float(num_tiles),
        float(padded_kv_tokens),
        float(plan.num_draft_tokens),
        float(draft_context_work(plan)),
        1.0 if plan.num_draft_tokens else 0.0,
        float(max(plan.max_draft_len - 1, 0)),
        float(plan.draft_catch_up_tokens),
        float(padded_scores),
    )
