"""Attention-tile step features: on a CPU each padded tile of the torch attention costs a gather
and a call per layer and pads to its longest sequence, which the plan's aggregates do not show."""
from __future__ import annotations

from dataclasses import dataclass

from kernels.tiling import TILE_BYTES, tile_tokens, tiling_work
from policies.types import StepPlan

TILE_FEATURES: tuple[str, ...] = (
    "num_attention_tiles",         # padded batches the torch attention runs (per layer)
    "padded_kv_tokens",            # K/V tokens those tiles gather, padding included
    "padded_attention_scores",     # query x K/V scores the tiles compute: each tile pads its
                                   # queries to its longest and its contexts to its longest
)


@dataclass(frozen=True)
class AttentionTiling:
    """What the tile features need: the KV block size and the tile capacity in tokens."""

    block_size: int
    max_tile_tokens: int

    @classmethod
    def of(cls, block_size: int, kv_bytes_per_token: int,
           tile_bytes: int = TILE_BYTES) -> "AttentionTiling":
        """The tiling of a model with `kv_bytes_per_token` K/V bytes per token and layer."""
        return cls(block_size, tile_tokens(block_size, kv_bytes_per_token, tile_bytes))


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


def tile_features(plan: StepPlan, tiling: AttentionTiling | None) -> tuple[float, float, float]:
    """The plan's TILE_FEATURES (0 without a tiling: a profile whose samples had none)."""
    if tiling is None or not plan.seqs:
        return 0.0, 0.0, 0.0
    seq_lens, query_lens = attention_lengths(plan)
    num_tiles, padded_kv_tokens, padded_scores = tiling_work(
        seq_lens, query_lens, tiling.block_size, tiling.max_tile_tokens)
    return float(num_tiles), float(padded_kv_tokens), float(padded_scores)


def profile_tiling(metadata: dict, block_size) -> AttentionTiling | None:
    """The tiling a profile's tile features were computed with (its
    `metadata.attention_tiling`), at this run's block size; None where the profile has none.
    A problem is a ValueError naming the field."""
    tiling = metadata.get("attention_tiling")
    if not tiling:
        return None
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"cost_model.block_size must be the run's positive KV block size (the "
                         f"profile's tile features need it), got {block_size!r}")
    try:
        kv_bytes_per_token = int(tiling["kv_bytes_per_token"])
        tile_bytes = int(tiling["tile_bytes"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"metadata.attention_tiling must have integer kv_bytes_per_token and "
                         f"tile_bytes, got {tiling!r}") from None
    if kv_bytes_per_token <= 0 or tile_bytes <= 0:
        raise ValueError("metadata.attention_tiling values must be positive")
    return AttentionTiling.of(block_size, kv_bytes_per_token, tile_bytes)
