"""Triton kernels for the paged KV cache, with Python launchers that share kernels/naive.py's API.

- paged_decode_attention: one new token per sequence. One program per (sequence, KV head) holds
  the queries of every head that shares that KV head (GQA), gathers the context tile by tile
  through the block table and keeps an online softmax, so K/V are read from memory once.
- paged_decode_attention_split_k: flash-decoding. With few sequences and long contexts the plain
  decode grid has too few programs to fill the GPU, so each (sequence, KV head) is also split
  along the context; each split writes its partial max / sum / weighted values and a reduce
  kernel combines them.
- paged_prefill_attention: any number of new tokens per sequence (prefill, chunked prefill,
  prefix-cache hits, speculative token trees). Tiles of queries against tiles of context through
  the block table, causal by absolute position, with tl.dot; with a tree_mask (kernels/__init__.py)
  each query row also drops the positions its entry hides.
- write_kv_cache, copy_blocks: data movement; swap_blocks is a torch index copy (it crosses
  devices, which a kernel cannot).
- paged_attention: the dispatcher the engine calls.

Runs compiled on CUDA, and through Triton's interpreter on a machine without one. The
interpreter has to be chosen before triton is first imported (triton.language's own functions
are built then), so without CUDA this module sets TRITON_INTERPRET=1 before importing triton;
if something imported triton earlier without it, the launchers raise with the reason
(UNAVAILABLE_REASON). The interpreter computes a bf16 tl.dot wrongly, so under it (and for fp32
inputs, where the GPU would otherwise round to tf32) dot operands are cast to fp32. Every load
and store is masked: the interpreter has no bounds checks.

Assumption shared with the engine: every sequence in a call has at least one new token, so a
call with as many tokens as sequences is a pure decode step.
"""
from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the only way Triton runs without a GPU

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from kernels import TREE_WINDOW  # noqa: E402

# Ground truth for "which mode are the kernels in": how triton.language's own jit functions
# were built, whatever the environment says now.
INTERPRETED = isinstance(tl.standard.zeros, InterpretedFunction)
UNAVAILABLE_REASON = (
    None if INTERPRETED or torch.cuda.is_available() else
    "no CUDA device, and triton was imported before TRITON_INTERPRET=1 was set: set it in the "
    "environment, or import kernels.triton_ops before anything imports triton")

LOG2_E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2 e), exp2 is cheaper
SPLIT_K_MIN_CONTEXT = 2048  # decode contexts longer than this may be split (flash-decoding)
MIN_TOKENS_PER_SPLIT = 512  # shorter splits cost more in the reduce than they win
NUM_WARPS = 4


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _matmul(a, b, IN_FP32: tl.constexpr):
    """a @ b with fp32 accumulation; IN_FP32 casts the operands first (interpreter, fp32 inputs)."""
    if IN_FP32:
        result = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        result = tl.dot(a, b)
    return result


@triton.jit
def _attend_token_range(q, k_cache_ptr, v_cache_ptr, block_table_row_ptr, kv_head,
                        token_start, token_end, stride_block, stride_offset, stride_head,
                        head_dim, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                        HEAD_DIM_PAD: tl.constexpr, GROUP_PAD: tl.constexpr):
    """Online softmax of the query heads q [GROUP_PAD, HEAD_DIM_PAD] (fp32, pre-scaled for
    exp2) over cache positions [token_start, token_end) of one sequence and KV head.
    Returns (running max, running sum, unnormalized weighted values)."""
    offs_t = tl.arange(0, TILE)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = offs_d < head_dim
    m = tl.full([GROUP_PAD], -1.0e30, tl.float32)  # finite: an empty range must not make NaNs
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(token_start, token_end, TILE):
        positions = tile_start + offs_t
        in_range = positions < token_end
        # A tile may span several blocks: each position finds its own block (any block size).
        block_ids = tl.load(block_table_row_ptr + positions // BLOCK_SIZE, mask=in_range, other=0)
        rows = (block_ids.to(tl.int64) * stride_block + (positions % BLOCK_SIZE) * stride_offset
                + kv_head * stride_head)
        kv_offsets = rows[:, None] + offs_d[None, :]
        kv_mask = in_range[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        # Decode has a handful of query rows: a broadcast-multiply-sum works at any size,
        # where tl.dot would need 16 rows; decode is bound by reading K/V anyway.
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_PAD, TILE]
        scores = tl.where(in_range[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    return m, l, acc


@triton.jit
def _load_query_group(query_ptr, token, kv_head, stride_qt, stride_qh, scale_log2,
                      heads_per_kv_head, head_dim, HEAD_DIM_PAD: tl.constexpr,
                      GROUP_PAD: tl.constexpr):
    """The queries of the heads that read kv_head, [GROUP_PAD, HEAD_DIM_PAD] fp32, pre-scaled."""
    group = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * heads_per_kv_head + group
    mask = (group < heads_per_kv_head)[:, None] & (offs_d < head_dim)[None, :]
    q = tl.load(query_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                + offs_d[None, :], mask=mask, other=0.0)
    return q.to(tl.float32) * scale_log2


@triton.jit
def _paged_decode_kernel(out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                         seq_lens_ptr, query_start_loc_ptr, scale_log2,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                         stride_block, stride_offset, stride_head, heads_per_kv_head, head_dim,
                         BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                         HEAD_DIM_PAD: tl.constexpr, GROUP_PAD: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    q = _load_query_group(query_ptr, token, kv_head, stride_qt, stride_qh, scale_log2,
                          heads_per_kv_head, head_dim, HEAD_DIM_PAD, GROUP_PAD)
    m, l, acc = _attend_token_range(q, k_cache_ptr, v_cache_ptr,
                                    block_tables_ptr + seq.to(tl.int64) * stride_table, kv_head,
                                    0, seq_len, stride_block, stride_offset, stride_head,
                                    head_dim, BLOCK_SIZE, TILE, HEAD_DIM_PAD, GROUP_PAD)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    group = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * heads_per_kv_head + group
    mask = (group < heads_per_kv_head)[:, None] & (offs_d < head_dim)[None, :]
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
             + offs_d[None, :], out, mask=mask)


@triton.jit
def _paged_decode_split_kernel(max_ptr, sum_ptr, acc_ptr, query_ptr, k_cache_ptr, v_cache_ptr,
                               block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, scale_log2,
                               stride_qt, stride_qh, stride_table, stride_block, stride_offset,
                               stride_head, num_heads, heads_per_kv_head, head_dim,
                               NUM_SPLITS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                               TILE: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                               GROUP_PAD: tl.constexpr):
    """Split `split` of the context: partials go to max/sum [seqs, heads, splits] and
    acc [seqs, heads, splits, head_dim]; a split past the end writes an empty partial."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Tile-aligned equal shares of this sequence's context.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), TILE) * TILE
    token_start = split * split_len
    token_end = tl.minimum(token_start + split_len, seq_len)
    q = _load_query_group(query_ptr, token, kv_head, stride_qt, stride_qh, scale_log2,
                          heads_per_kv_head, head_dim, HEAD_DIM_PAD, GROUP_PAD)
    m, l, acc = _attend_token_range(q, k_cache_ptr, v_cache_ptr,
                                    block_tables_ptr + seq.to(tl.int64) * stride_table, kv_head,
                                    token_start, token_end, stride_block, stride_offset,
                                    stride_head, head_dim, BLOCK_SIZE, TILE, HEAD_DIM_PAD,
                                    GROUP_PAD)
    group = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * heads_per_kv_head + group
    head_mask = group < heads_per_kv_head
    partial = (seq * num_heads + heads) * NUM_SPLITS + split  # index into [seqs, heads, splits]
    tl.store(max_ptr + partial, m, mask=head_mask)
    tl.store(sum_ptr + partial, l, mask=head_mask)
    tl.store(acc_ptr + partial[:, None] * head_dim + offs_d[None, :], acc,
             mask=head_mask[:, None] & (offs_d < head_dim)[None, :])


@triton.jit
def _split_reduce_kernel(out_ptr, max_ptr, sum_ptr, acc_ptr, query_start_loc_ptr,
                         stride_ot, stride_oh, num_heads, head_dim, NUM_SPLITS: tl.constexpr,
                         SPLITS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, with M the largest m_s."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    split_mask = splits < NUM_SPLITS
    partial = (seq * num_heads + head) * NUM_SPLITS + splits
    m = tl.load(max_ptr + partial, mask=split_mask, other=float("-inf"))
    l = tl.load(sum_ptr + partial, mask=split_mask, other=0.0)
    acc = tl.load(acc_ptr + partial[:, None] * head_dim + offs_d[None, :],
                  mask=split_mask[:, None] & (offs_d < head_dim)[None, :], other=0.0)
    weights = tl.exp2(m - tl.max(m, axis=0))
    total = tl.sum(weights * l, axis=0)
    out = tl.sum(weights[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
    token = tl.load(query_start_loc_ptr + seq)
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + head * stride_oh + offs_d, out,
             mask=offs_d < head_dim)


@triton.jit
def _paged_prefill_kernel(out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                          seq_lens_ptr, query_start_loc_ptr, scale_log2,
                          stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                          stride_block, stride_offset, stride_head, heads_per_kv_head, head_dim,
                          tree_mask_ptr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                          DOT_IN_FP32: tl.constexpr, TREE: tl.constexpr,
                          TREE_WINDOW: tl.constexpr):
    """Queries [q_block * BLOCK_M, +BLOCK_M) of one sequence and head, against its context;
    with TREE, row r sees position p only if p is TREE_WINDOW or more before it or bit
    (its position - p) of its tree_mask entry is set."""
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    head = tl.program_id(2)
    first_token = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - first_token
    if q_block * BLOCK_M >= query_len:
        return  # the grid is sized for the longest query; this sequence is shorter
    seq_len = tl.load(seq_lens_ptr + seq)
    cached_len = seq_len - query_len  # positions before this chunk (earlier chunks, prefix hits)
    kv_head = head // heads_per_kv_head
    rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < query_len
    q_positions = cached_len + rows
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = offs_d < head_dim
    q_offsets = ((first_token + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh
                 + offs_d[None, :])
    q = tl.load(query_ptr + q_offsets, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if TREE:
        row_entries = tl.load(tree_mask_ptr + first_token + rows, mask=row_mask, other=-1)

    block_table_row_ptr = block_tables_ptr + seq.to(tl.int64) * stride_table
    offs_n = tl.arange(0, BLOCK_N)
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: padded rows see no key, make no NaN
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    # Causal: the last row of this tile sees positions up to cached_len + its row.
    kv_end = tl.minimum(seq_len, cached_len + (q_block + 1) * BLOCK_M)
    for tile_start in range(0, kv_end, BLOCK_N):
        positions = tile_start + offs_n
        in_range = positions < kv_end
        block_ids = tl.load(block_table_row_ptr + positions // BLOCK_SIZE, mask=in_range, other=0)
        rows_kv = (block_ids.to(tl.int64) * stride_block + (positions % BLOCK_SIZE) * stride_offset
                   + kv_head * stride_head)
        kv_mask = in_range[:, None] & dim_mask[None, :]
        kv_offsets = rows_kv[:, None] + offs_d[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        scores = _matmul(q, tl.trans(k), DOT_IN_FP32) * scale_log2  # [BLOCK_M, BLOCK_N]
        distance = q_positions[:, None] - positions[None, :]
        visible = (distance >= 0) & in_range[None, :]
        if TREE:
            shift = tl.minimum(tl.maximum(distance, 0), TREE_WINDOW - 1).to(tl.int64)
            seen = (row_entries[:, None] >> shift) & 1
            visible = visible & ((distance >= TREE_WINDOW) | (seen != 0))
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _matmul(p.to(v.dtype), v, DOT_IN_FP32)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_offsets = ((first_token + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh
                 + offs_d[None, :])
    tl.store(out_ptr + o_offsets, out, mask=row_mask[:, None] & dim_mask[None, :])


@triton.jit
def _write_kv_cache_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                           stride_kt, stride_kh, stride_vt, stride_vh, stride_block,
                           stride_offset, stride_head, num_kv_heads, head_dim,
                           BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr,
                           HEAD_DIM_PAD: tl.constexpr):
    """One token's K and V, all KV heads, into its slot; a negative slot is padding."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < num_kv_heads)[:, None] & (offs_d < head_dim)[None, :]
    cache_offsets = ((slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_offset
                     + heads[:, None] * stride_head + offs_d[None, :])
    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + offs_d[None, :],
                mask=mask, other=0.0)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + offs_d[None, :],
                mask=mask, other=0.0)
    tl.store(k_cache_ptr + cache_offsets, k, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v, mask=mask)


@triton.jit
def _copy_blocks_kernel(cache_ptr, block_pairs_ptr, stride_kv, stride_block, block_numel,
                        CHUNK: tl.constexpr):
    """Block dst <- block src for pair program_id(0), K or V by program_id(1)."""
    pair = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1).to(tl.int64)
    src = tl.load(block_pairs_ptr + pair * 2).to(tl.int64)
    dst = tl.load(block_pairs_ptr + pair * 2 + 1).to(tl.int64)
    src_ptr = cache_ptr + kv * stride_kv + src * stride_block
    dst_ptr = cache_ptr + kv * stride_kv + dst * stride_block
    for chunk_start in range(0, block_numel, CHUNK):
        offs = chunk_start + tl.arange(0, CHUNK)
        mask = offs < block_numel
        tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launchers


def _require_triton():
    if UNAVAILABLE_REASON is not None:
        raise RuntimeError(f"kernels.triton_ops cannot run: {UNAVAILABLE_REASON}")


def _check_attention_inputs(query, kv_cache, block_tables, seq_lens, query_start_loc):
    _require_triton()
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, \
        "kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim]"
    assert query.dim() == 3 and query.shape[2] == kv_cache.shape[4], "query is [tokens, heads, dim]"
    assert query.shape[1] % kv_cache.shape[3] == 0, "num_heads must be a multiple of num_kv_heads"
    assert query.stride(2) == 1 and kv_cache.stride(4) == 1, "head_dim must be contiguous"
    assert block_tables.dim() == 2 and block_tables.stride(1) == 1
    assert seq_lens.shape[0] == block_tables.shape[0] == query_start_loc.shape[0] - 1


def _cache_strides(kv_cache):
    """(block, offset in block, kv head) strides of the K (= V) half of the cache."""
    return kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)


def _decode_config(group_pad: int, head_dim_pad: int) -> tuple[int, int]:
    """(context tokens per loop step, warps) for the decode kernels. The [group, tile, head_dim]
    products live in registers: at most 32 fp32 values per thread keeps Llama shapes under about
    130 registers and unspilled on sm_90 (bench/gpu_check.py --compile reports them)."""
    num_warps = 4 if group_pad <= 2 else 8
    tile = max(16, min(64, 32 * 32 * num_warps // (group_pad * head_dim_pad)))
    return tile, num_warps


def _decode_shape(query, kv_cache, block_tables, seq_lens, query_start_loc) -> tuple:
    """Checks a decode call and returns its launch shape: num_seqs, num_heads, head_dim,
    num_kv_heads, block_size, heads_per_kv_head, group_pad, head_dim_pad, default_tile,
    num_warps."""
    _check_attention_inputs(query, kv_cache, block_tables, seq_lens, query_start_loc)
    num_seqs = seq_lens.shape[0]
    assert query.shape[0] == num_seqs, "decode takes exactly one new token per sequence"
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    heads_per_kv_head = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(heads_per_kv_head)
    head_dim_pad = triton.next_power_of_2(head_dim)
    default_tile, num_warps = _decode_config(group_pad, head_dim_pad)
    return (num_seqs, num_heads, head_dim, num_kv_heads, block_size, heads_per_kv_head,
            group_pad, head_dim_pad, default_tile, num_warps)


def paged_decode_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                           *, tile: int | None = None):
    """paged_attention for one new token per sequence. `tile`: context tokens per loop step."""
    shape = _decode_shape(query, kv_cache, block_tables, seq_lens, query_start_loc)
    num_seqs, num_heads, head_dim, num_kv_heads, block_size, heads_per_kv_head, group_pad, \
        head_dim_pad, default_tile, num_warps = shape
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out, query, kv_cache[0], kv_cache[1], block_tables, seq_lens, query_start_loc,
        scale * LOG2_E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *_cache_strides(kv_cache), heads_per_kv_head, head_dim,
        BLOCK_SIZE=block_size, TILE=tile or default_tile, HEAD_DIM_PAD=head_dim_pad,
        GROUP_PAD=group_pad, num_warps=num_warps)
    return out


def paged_decode_attention_split_k(query, kv_cache, block_tables, seq_lens, query_start_loc,
                                   scale, num_splits: int, *, tile: int | None = None):
    """Flash-decoding: paged_decode_attention with each context cut into num_splits parts."""
    assert num_splits >= 1
    shape = _decode_shape(query, kv_cache, block_tables, seq_lens, query_start_loc)
    num_seqs, num_heads, head_dim, num_kv_heads, block_size, heads_per_kv_head, group_pad, \
        head_dim_pad, default_tile, num_warps = shape
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    partial_shape = (num_seqs, num_heads, num_splits)
    partial_max = torch.empty(partial_shape, dtype=torch.float32, device=query.device)
    partial_sum = torch.empty(partial_shape, dtype=torch.float32, device=query.device)
    partial_acc = torch.empty(partial_shape + (head_dim,), dtype=torch.float32,
                              device=query.device)
    _paged_decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        partial_max, partial_sum, partial_acc, query, kv_cache[0], kv_cache[1], block_tables,
        seq_lens, query_start_loc, scale * LOG2_E, query.stride(0), query.stride(1),
        block_tables.stride(0), *_cache_strides(kv_cache), num_heads, heads_per_kv_head,
        head_dim, NUM_SPLITS=num_splits, BLOCK_SIZE=block_size,
        TILE=tile or default_tile, HEAD_DIM_PAD=head_dim_pad, GROUP_PAD=group_pad,
        num_warps=num_warps)
    _split_reduce_kernel[(num_seqs, num_heads)](
        out, partial_max, partial_sum, partial_acc, query_start_loc, out.stride(0),
        out.stride(1), num_heads, head_dim, NUM_SPLITS=num_splits,
        SPLITS_PAD=max(triton.next_power_of_2(num_splits), 2), HEAD_DIM_PAD=head_dim_pad,
        num_warps=NUM_WARPS)
    return out


def paged_prefill_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                            tree_mask=None, *, max_query_len: int | None = None,
                            block_m: int | None = None, block_n: int | None = None):
    """paged_attention for any number of new tokens per sequence, restricted by tree_mask
    ([tokens] int64, kernels/__init__.py) if given. max_query_len, when the caller knows it,
    saves reading query_start_loc back from the device to size the grid; block_m / block_n
    (query rows, context tokens per tile) override the defaults."""
    _check_attention_inputs(query, kv_cache, block_tables, seq_lens, query_start_loc)
    if tree_mask is not None:
        assert tree_mask.shape == (query.shape[0],) and tree_mask.dtype == torch.int64, \
            "tree_mask is one int64 entry per query token"
    num_seqs = seq_lens.shape[0]
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    out = torch.empty_like(query)
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    # tl.dot needs every dimension >= 16.
    head_dim_pad = max(triton.next_power_of_2(head_dim), 16)
    # fp32 operands take an exact (not tf32) dot; on a GPU that needs smaller tiles to fit the
    # registers (64 x 64 x 128 bf16 tiles take about 185 registers on sm_90, fp32 ones spill).
    dot_in_fp32 = INTERPRETED or torch.float32 in (query.dtype, kv_cache.dtype)
    default_tile = 32 if dot_in_fp32 and not INTERPRETED else 64
    block_m = max(16, min(block_m or default_tile, triton.next_power_of_2(max_query_len)))
    block_n = max(16, block_n or default_tile)
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _paged_prefill_kernel[grid](
        out, query, kv_cache[0], kv_cache[1], block_tables, seq_lens, query_start_loc,
        scale * LOG2_E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *_cache_strides(kv_cache), num_heads // num_kv_heads, head_dim,
        tree_mask if tree_mask is not None else query_start_loc,  # not read without TREE
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM_PAD=head_dim_pad,
        DOT_IN_FP32=dot_in_fp32, TREE=tree_mask is not None, TREE_WINDOW=TREE_WINDOW,
        num_warps=NUM_WARPS)
    return out


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int,
                      device: torch.device) -> int:
    """Splits for a decode step: 1 unless the contexts are long and the plain grid of
    (sequence, KV head) programs leaves the GPU's multiprocessors idle."""
    if max_context <= SPLIT_K_MIN_CONTEXT or device.type != "cuda":
        return 1  # short contexts, or the interpreter, which runs programs one after another
    programs = num_seqs * num_kv_heads
    multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= multiprocessors:
        return 1
    wanted = triton.cdiv(2 * multiprocessors, programs)  # about two programs per multiprocessor
    return max(1, min(wanted, max_context // MIN_TOKENS_PER_SPLIT))


def paged_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                    tree_mask=None):
    """The engine's entry point: decode (split-K for long contexts) or prefill. A tree_mask
    goes to the prefill kernel; a step of one token per sequence has no tree (a lone token's
    entry is -1), so the decode kernels take none."""
    num_seqs = seq_lens.shape[0]
    if query.shape[0] != num_seqs:
        return paged_prefill_attention(query, kv_cache, block_tables, seq_lens, query_start_loc,
                                       scale, tree_mask)
    # The block tables' width bounds the longest context without reading seq_lens back.
    max_context = block_tables.shape[1] * kv_cache.shape[2]
    num_splits = choose_num_splits(num_seqs, kv_cache.shape[3], max_context, query.device)
    if num_splits > 1:
        return paged_decode_attention_split_k(query, kv_cache, block_tables, seq_lens,
                                              query_start_loc, scale, num_splits)
    return paged_decode_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, scale)


def write_kv_cache(key, value, kv_cache, slot_mapping):
    """kv_cache[:, slot] <- (key[t], value[t]) per token; negative slots are skipped."""
    _require_triton()
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape and kv_cache.shape[3:] == (num_kv_heads, head_dim)
    assert slot_mapping.shape == (num_tokens,), "one slot per token"
    assert key.stride(2) == 1 and value.stride(2) == 1 and kv_cache.stride(4) == 1
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, kv_cache[0], kv_cache[1], slot_mapping, key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), *_cache_strides(kv_cache), num_kv_heads, head_dim,
        BLOCK_SIZE=kv_cache.shape[2], HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), num_warps=NUM_WARPS)


def copy_blocks(kv_cache, block_pairs):
    """Block dst <- block src, K and V, for each (src, dst) row. The pairs run in parallel, so
    no dst may be another pair's src (copy-on-write copies into fresh blocks)."""
    _require_triton()
    assert kv_cache.is_contiguous(), "a block is copied as one contiguous run"
    if block_pairs.shape[0] == 0:
        return
    block_pairs = block_pairs.to(device=kv_cache.device, dtype=torch.int64).contiguous()
    _copy_blocks_kernel[(block_pairs.shape[0], 2)](
        kv_cache, block_pairs, kv_cache.stride(0), kv_cache.stride(1), kv_cache[0, 0].numel(),
        CHUNK=1024, num_warps=NUM_WARPS)


def swap_blocks(src_cache, dst_cache, block_pairs):
    """dst_cache's block dst <- src_cache's block src, between a device and a host cache. A
    kernel cannot reach across devices, so this is one gather, one transfer, one scatter."""
    if block_pairs.shape[0] == 0:
        return
    src_ids = block_pairs[:, 0].to(src_cache.device)
    dst_ids = block_pairs[:, 1].to(dst_cache.device)
    # Blocking transfer: a non_blocking device-to-host copy would be read before it lands.
    dst_cache[:, dst_ids] = src_cache[:, src_ids].to(dst_cache.device)
