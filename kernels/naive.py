"""The paged-KV operations as plain loops, one sequence, token and head at a time: the test
oracle every implementation is checked against, readable rather than fast.

Layout shared by all implementations:
- kv_cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (K, then V); a slot
  is block_id * block_size + offset.
- New tokens are flattened sequence-major; query_start_loc[b]:query_start_loc[b + 1] are sequence
  b's, and seq_lens[b] counts its cached tokens after this step's writes, so its new token j sits
  at position seq_lens[b] - q_len_b + j.
- tree_mask (optional): kernels/__init__.py.
"""
from __future__ import annotations

import torch

from kernels.ops import KernelOps
from kernels.tree_mask import TREE_WINDOW


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """kv_cache[:, slot] <- (key[t], value[t]) for each token t; a negative slot (padding) is
    skipped."""
    block_size = kv_cache.shape[2]
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        kv_cache[0, block, offset] = key[token]
        kv_cache[1, block, offset] = value[token]


def gather_context(kv_cache: torch.Tensor, block_table_row: torch.Tensor, context_len: int):
    """K and V of a sequence's first context_len positions, [context_len, num_kv_heads, head_dim]
    each, read token by token through its block table."""
    block_size = kv_cache.shape[2]
    keys, values = [], []
    for position in range(context_len):
        block = int(block_table_row[position // block_size])
        offset = position % block_size
        keys.append(kv_cache[0, block, offset])
        values.append(kv_cache[1, block, offset])
    return torch.stack(keys), torch.stack(values)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    scale: float, tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached context (and, with a
    tree_mask, only over the positions its entry lets it see); softmax in fp32."""
    masks = tree_mask.tolist() if tree_mask is not None else None
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    heads_per_kv_head = num_heads // num_kv_heads
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for seq, seq_len in enumerate(seq_lens.tolist()):
        first_token, end_token = starts[seq], starts[seq + 1]
        query_len = end_token - first_token
        keys, values = gather_context(kv_cache, block_tables[seq], seq_len)
        keys, values = keys.float(), values.float()
        for j in range(query_len):
            token = first_token + j
            position = seq_len - query_len + j  # causal: sees positions 0..position
            seen = [p for p in range(position + 1)
                    if masks is None or position - p >= TREE_WINDOW
                    or (masks[token] >> (position - p)) & 1]
            for head in range(num_heads):
                kv_head = head // heads_per_kv_head
                q = query[token, head].float()
                k = keys[seen, kv_head]
                v = values[seen, kv_head]
                weights = torch.softmax((k @ q) * scale, dim=0)
                out[token, head] = (weights @ v).to(query.dtype)
    return out


def copy_blocks(kv_cache: torch.Tensor, block_pairs: torch.Tensor) -> None:
    """For each (src, dst) pair, K and V of block dst <- those of block src (copy-on-write)."""
    for src, dst in block_pairs.tolist():
        kv_cache[:, dst] = kv_cache[:, src]


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor,
                block_pairs: torch.Tensor) -> None:
    """For each (src, dst) pair, dst_cache's block dst <- src_cache's block src (device <->
    host)."""
    for src, dst in block_pairs.tolist():
        dst_cache[:, dst] = src_cache[:, src].to(dst_cache.device)


def add_lora(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scalings: torch.Tensor, batch) -> None:
    """out[t] += scalings[s] * lora_b[s] @ (lora_a[s] @ x[t]) for each token t whose slot s
    (batch.token_slots, kernels/lora_batch.py) is not -1: one token at a time, in fp32."""
    for token, slot in enumerate(batch.token_slots.tolist()):
        if slot < 0:
            continue
        shrunk = lora_a[slot].float() @ x[token].float()
        delta = (lora_b[slot].float() @ shrunk) * float(scalings[slot])
        out[token] = (out[token].float() + delta).to(out.dtype)


KERNEL_OPS = KernelOps("naive", write_kv_cache, paged_attention, copy_blocks, swap_blocks,
                       add_lora=add_lora)
