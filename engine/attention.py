"""The paged attention function registered with transformers' AttentionInterface: HF's model
code hands it q, k, v of one flattened batch, and it writes the new K/V into the layer's block
pool and attends through the block tables of its `attn_metadata=` keyword (no HF cache object)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from kernels import KernelOps

PAGED_ATTENTION = "twinserve_paged"


@dataclass
class AttentionMetadata:
    """One step's attention inputs, shared by every layer (tensors on the model's device)."""

    slot_mapping: torch.Tensor      # [num_tokens] int64: cache slot of each new token
    block_tables: torch.Tensor      # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor          # [num_seqs] int32: cached tokens after this step's writes
    query_start_loc: torch.Tensor   # [num_seqs + 1] int32
    kv_caches: list[torch.Tensor]   # per layer [2, num_blocks, block_size, kv_heads, head_dim]
    ops: KernelOps
    max_query_len: int              # the step's longest query and context, host ints: kernels
    max_seq_len: int                # that take them read nothing back from the device
    attention_plan: object = None   # ops.plan_attention(...) of this step, shared by the layers
    tree_mask: torch.Tensor | None = None  # [num_tokens] int64 with token trees (kernels/)


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask, scaling: float | None = None,
                            dropout: float = 0.0, attn_metadata: AttentionMetadata | None = None,
                            **kwargs):
    """query [1, heads, tokens, head_dim], key/value [1, kv_heads, tokens, head_dim] ->
    ([1, tokens, heads, head_dim], None)."""
    if attn_metadata is None:
        raise RuntimeError(
            f"this model's attention is {PAGED_ATTENTION!r}, which only runs inside the engine "
            f"(it needs attn_metadata); for a plain forward or generate(), call "
            f"model.set_attn_implementation('sdpa') first")
    if query.shape[0] != 1:
        raise ValueError(f"paged attention runs a flattened batch of 1, got {query.shape[0]}")
    ops = attn_metadata.ops
    kv_cache = attn_metadata.kv_caches[module.layer_idx]
    query = query[0].transpose(0, 1)   # [tokens, heads, head_dim]
    ops.write_kv_cache(key[0].transpose(0, 1), value[0].transpose(0, 1), kv_cache,
                       attn_metadata.slot_mapping)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    args = (query, kv_cache, attn_metadata.block_tables, attn_metadata.seq_lens,
            attn_metadata.query_start_loc, scaling)
    if attn_metadata.attention_plan is not None:   # the tree mask is part of the plan
        out = ops.paged_attention(*args, plan=attn_metadata.attention_plan)
    else:
        kwargs = {} if attn_metadata.tree_mask is None else {"tree_mask": attn_metadata.tree_mask}
        if ops.takes_host_lengths:
            kwargs.update(max_query_len=attn_metadata.max_query_len,
                        max_seq_len=attn_metadata.max_seq_len)
        out = ops.paged_attention(*args, **kwargs)
    return out.unsqueeze(0), None


def use_paged_attention(model: torch.nn.Module) -> None:
    """Register the function (idempotent: a dict entry under a fixed name) and switch `model` to
    it."""
    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
    model.set_attn_implementation(PAGED_ATTENTION)
