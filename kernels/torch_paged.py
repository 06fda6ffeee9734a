"""The paged-KV operations in vectorized torch (kernels/naive.py's layout): the engine's CPU path
and the reference for the Triton kernels. Attention gathers contexts into padded tiles of
sequences sorted by context length, decodes apart from prefills, so that padding stays small and
each tile's K/V is still in cache when attention reads it (about twice as fast on a CPU as one
batch); the tiling is planned once per step and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.ops import KernelOps
from kernels.tiling import TILE_BYTES, group_into_tiles, tile_tokens
from kernels.torch_lora import add_lora
from kernels.tree_mask import TREE_WINDOW


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """kv_cache[:, slot] <- (key[t], value[t]) for every token t; a negative slot is padding."""
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(kv_cache.dtype))


def copy_blocks(kv_cache: torch.Tensor, block_pairs: torch.Tensor) -> None:
    """Block dst <- block src for each (src, dst) pair (copy-on-write). All sources are read
    before any destination is written."""
    if block_pairs.numel() == 0:
        return
    pairs = block_pairs.to(kv_cache.device).long()
    kv_cache[:, pairs[:, 1]] = kv_cache[:, pairs[:, 0]]


def swap_blocks(src_cache: torch.Tensor, dst_cache: torch.Tensor,
                block_pairs: torch.Tensor) -> None:
    """dst_cache's block dst <- src_cache's block src for each (src, dst) pair: device <-> host."""
    if block_pairs.numel() == 0:
        return
    pairs = block_pairs.long()
    src = pairs[:, 0].to(src_cache.device)
    dst = pairs[:, 1].to(dst_cache.device)
    # Gather on the source's side, one (blocking) transfer, scatter on the destination's side.
    dst_cache.index_copy_(1, dst, src_cache.index_select(1, src).to(dst_cache.device))


@dataclass
class AttentionTile:
    """Sequences attended as one padded batch, and where their tokens go."""

    seq_ids: torch.Tensor       # [n] rows of block_tables / seq_lens
    block_ids: torch.Tensor     # [n * num_blocks] their first num_blocks blocks, flattened
    tokens: torch.Tensor        # [tokens] rows of query / out, sequence-major
    padded_rows: torch.Tensor | None  # [tokens] rows in the padded [n * max_query_len] batch
    visible: torch.Tensor       # [n, 1, max_query_len, context] causal (and tree) mask
    num_seqs: int
    max_query_len: int
    context: int                # num_blocks * block_size


def plan_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, kv_cache: torch.Tensor,
                   tree_mask: torch.Tensor | None = None) -> list[AttentionTile]:
    """The tiles of one step. Every layer attends the same sequences, so the engine plans once
    per step and passes the plan to each layer's paged_attention."""
    device = query_start_loc.device
    block_size, num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    kv_bytes_per_token = 2 * num_kv_heads * head_dim * kv_cache.element_size()
    max_tile_tokens = tile_tokens(block_size, kv_bytes_per_token, TILE_BYTES)
    lens = seq_lens.tolist()
    starts = query_start_loc.tolist()
    all_query_lens = [end - start for start, end in zip(starts, starts[1:])]
    tiles = []
    for members in group_into_tiles(lens, all_query_lens, max_tile_tokens):
        query_lens = [all_query_lens[b] for b in members]
        max_query_len = max(query_lens)
        num_blocks = -(-lens[members[0]] // block_size)
        context = num_blocks * block_size
        seq_ids = torch.tensor(members, device=device)
        block_ids = block_tables[seq_ids, :num_blocks].reshape(-1).long()
        first_token = query_start_loc[seq_ids].long()
        query_lens_t = torch.tensor(query_lens, device=device)
        if max_query_len == 1:
            tokens, padded_rows = first_token, None
        else:
            # Token j of the tile's sequence b goes to row b * max_query_len + j.
            token_seq = torch.repeat_interleave(torch.arange(len(members), device=device),
                                                query_lens_t)
            offsets = torch.arange(token_seq.shape[0], device=device) - torch.repeat_interleave(
                torch.cumsum(query_lens_t, 0) - query_lens_t, query_lens_t)
            tokens = first_token[token_seq] + offsets
            padded_rows = token_seq * max_query_len + offsets
        # Token j of sequence b sits at position seq_lens[b] - query_len_b + j.
        first_position = seq_lens[seq_ids].long() - query_lens_t
        query_positions = first_position[:, None] + torch.arange(max_query_len, device=device)
        distance = query_positions[:, :, None] - torch.arange(context, device=device)
        visible = distance >= 0
        if tree_mask is not None:
            entries = tree_mask[tokens].long()
            if padded_rows is not None:
                padded = torch.full((len(members) * max_query_len,), -1, dtype=torch.int64,
                                    device=device)
                padded[padded_rows] = entries
                entries = padded
            seen = (entries.view(len(members), max_query_len, 1)
                    >> distance.clamp(0, TREE_WINDOW - 1)) & 1
            visible &= (distance >= TREE_WINDOW) | (seen == 1)
        visible = visible[:, None]
        tiles.append(AttentionTile(seq_ids, block_ids, tokens, padded_rows, visible,
                                   len(members), max_query_len, context))
    return tiles


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    tree_mask: torch.Tensor | None = None,
                    plan: list[AttentionTile] | None = None) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached context (restricted by
    tree_mask); [num_tokens, num_heads, head_dim] in the query's dtype. `plan`: this step's
    plan_attention(), made once for all layers."""
    if plan is None:
        plan = plan_attention(block_tables, seq_lens, query_start_loc, kv_cache, tree_mask)
    out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    for tile in plan:
        # Whole blocks are gathered (contiguous block_size * kv_heads * head_dim runs).
        shape = (tile.num_seqs, tile.context, num_kv_heads, head_dim)
        keys = kv_cache[0].index_select(0, tile.block_ids).view(shape)
        values = kv_cache[1].index_select(0, tile.block_ids).view(shape)
        if tile.padded_rows is None:
            padded_query = query[tile.tokens].unsqueeze(1)
        else:
            padded_query = query.new_zeros(tile.num_seqs * tile.max_query_len, num_heads,
                                           head_dim)
            padded_query[tile.padded_rows] = query[tile.tokens]
            padded_query = padded_query.view(tile.num_seqs, tile.max_query_len, num_heads,
                                             head_dim)
        attended = F.scaled_dot_product_attention(
            padded_query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=tile.visible, scale=scale, enable_gqa=num_heads != num_kv_heads)
        attended = attended.transpose(1, 2)
        if tile.padded_rows is None:
            out[tile.tokens] = attended[:, 0]
        else:
            out[tile.tokens] = attended.reshape(-1, num_heads, head_dim)[tile.padded_rows]
    return out


KERNEL_OPS = KernelOps("torch", write_kv_cache, paged_attention, copy_blocks, swap_blocks,
                       plan_attention=plan_attention, add_lora=add_lora)
