"""Triton kernels for the paged KV cache, with Python launchers that share kernels/naive.py's API.

- paged_decode_attention: one new token per sequence. One program per (sequence, KV head) holds
  the queries of every head that shares that KV head (GQA), gathers the context tile by tile
  through the block table and keeps an online softmax, so K/V are read from memory once. From
  four query heads per KV head on, the group runs on tl.dot (decode_config).
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
- paged_attention: the dispatcher the engine calls; warm_up: compiles every variant a run
  launches, before the run.

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
from dataclasses import dataclass

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
# The split counts the dispatcher chooses from; the split kernel takes the count at run time, so
# one compiled variant serves them all (warm_up compiles it).
SPLIT_K_CHOICES = (2, 4, 8, 16)
MAX_SPLITS = 16
NUM_WARPS = 4
# The dispatcher takes the step's longest query and context from the caller (the engine's
# runner, which has them on the host): kernels.get_kernel_ops passes them.
TAKES_HOST_LENGTHS = True


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
                        token_start, token_end, scale_log2, stride_block, stride_offset,
                        stride_head, head_dim, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                        HEAD_DIM_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
                        USE_DOT: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """Online softmax of the query heads q [GROUP_PAD, HEAD_DIM_PAD] (as loaded) over cache
    positions [token_start, token_end) of one sequence and KV head. Returns (running max,
    running sum, unnormalized weighted values), base-2 exponents.

    USE_DOT: scores and weighted values by tl.dot (tensor cores; GROUP_PAD >= 16 rows, the
    padding rows are zeros). Otherwise a broadcast-multiply-sum, which works at any number of
    rows but holds a [GROUP_PAD, TILE, HEAD_DIM_PAD] product in registers: fine for one or two
    heads per KV head, a register spill for a group of 8."""
    offs_t = tl.arange(0, TILE)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    dim_mask = offs_d < head_dim
    m = tl.full([GROUP_PAD], -1.0e30, tl.float32)  # finite: an empty range must not make NaNs
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    q_scaled = q.to(tl.float32) * scale_log2
    for tile_start in range(token_start, token_end, TILE):
        positions = tile_start + offs_t
        in_range = positions < token_end
        # A tile may span several blocks: each position finds its own block (any block size).
        block_ids = tl.load(block_table_row_ptr + positions // BLOCK_SIZE, mask=in_range, other=0)
        rows = (block_ids.to(tl.int64) * stride_block + (positions % BLOCK_SIZE) * stride_offset
                + kv_head * stride_head)
        kv_offsets = rows[:, None] + offs_d[None, :]
        kv_mask = in_range[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if USE_DOT:
            scores = _matmul(q, tl.trans(k), DOT_IN_FP32) * scale_log2  # [GROUP_PAD, TILE]
        else:
            scores = tl.sum(q_scaled[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
        scores = tl.where(in_range[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if USE_DOT:
            acc = acc * alpha[:, None] + _matmul(p.to(v.dtype), v, DOT_IN_FP32)
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :],
                                                axis=1)
        m = m_new
    return m, l, acc


@triton.jit
def _load_query_group(query_ptr, token, kv_head, stride_qt, stride_qh, heads_per_kv_head,
                      head_dim, HEAD_DIM_PAD: tl.constexpr, GROUP_PAD: tl.constexpr):
    """The queries of the heads that read kv_head, [GROUP_PAD, HEAD_DIM_PAD] in the query's
    dtype; rows past the group are zeros."""
    group = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * heads_per_kv_head + group
    mask = (group < heads_per_kv_head)[:, None] & (offs_d < head_dim)[None, :]
    return tl.load(query_ptr + token.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
                   + offs_d[None, :], mask=mask, other=0.0)


@triton.jit(do_not_specialize=["stride_table"])
def _paged_decode_kernel(out_ptr, query_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                         seq_lens_ptr, query_start_loc_ptr, scale_log2,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
                         stride_block, stride_offset, stride_head, heads_per_kv_head, head_dim,
                         BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                         HEAD_DIM_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
                         USE_DOT: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    token = tl.load(query_start_loc_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    q = _load_query_group(query_ptr, token, kv_head, stride_qt, stride_qh, heads_per_kv_head,
                          head_dim, HEAD_DIM_PAD, GROUP_PAD)
    m, l, acc = _attend_token_range(q, k_cache_ptr, v_cache_ptr,
                                    block_tables_ptr + seq.to(tl.int64) * stride_table, kv_head,
                                    0, seq_len, scale_log2, stride_block, stride_offset,
                                    stride_head, head_dim, BLOCK_SIZE, TILE, HEAD_DIM_PAD,
                                    GROUP_PAD, USE_DOT, DOT_IN_FP32)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    group = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * heads_per_kv_head + group
    mask = (group < heads_per_kv_head)[:, None] & (offs_d < head_dim)[None, :]
    tl.store(out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
             + offs_d[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["stride_table", "num_splits"])
def _paged_decode_split_kernel(max_ptr, sum_ptr, acc_ptr, query_ptr, k_cache_ptr, v_cache_ptr,
                               block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, scale_log2,
                               stride_qt, stride_qh, stride_table, stride_block, stride_offset,
                               stride_head, num_heads, heads_per_kv_head, head_dim, num_splits,
                               BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                               HEAD_DIM_PAD: tl.constexpr, GROUP_PAD: tl.constexpr,
                               USE_DOT: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """Split `split` of the context: partials go to max/sum [seqs, heads, splits] and
    acc [seqs, heads, splits, head_dim]; a split past the end writes an empty partial.
    num_splits is a run-time value (not specialised), so one compiled kernel serves every
    split count."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    token = tl.load(query_start_loc_ptr + seq)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Tile-aligned equal shares of this sequence's context.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE) * TILE
    token_start = split * split_len
    token_end = tl.minimum(token_start + split_len, seq_len)
    q = _load_query_group(query_ptr, token, kv_head, stride_qt, stride_qh, heads_per_kv_head,
                          head_dim, HEAD_DIM_PAD, GROUP_PAD)
    m, l, acc = _attend_token_range(q, k_cache_ptr, v_cache_ptr,
                                    block_tables_ptr + seq.to(tl.int64) * stride_table, kv_head,
                                    token_start, token_end, scale_log2, stride_block,
                                    stride_offset, stride_head, head_dim, BLOCK_SIZE, TILE,
                                    HEAD_DIM_PAD, GROUP_PAD, USE_DOT, DOT_IN_FP32)
    group = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * heads_per_kv_head + group
    head_mask = group < heads_per_kv_head
    partial = (seq * num_heads + heads) * num_splits + split  # index into [seqs, heads, splits]
    tl.store(max_ptr + partial, m, mask=head_mask)
    tl.store(sum_ptr + partial, l, mask=head_mask)
    tl.store(acc_ptr + partial[:, None] * head_dim + offs_d[None, :], acc,
             mask=head_mask[:, None] & (offs_d < head_dim)[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _split_reduce_kernel(out_ptr, max_ptr, sum_ptr, acc_ptr, query_start_loc_ptr,
                         stride_ot, stride_oh, num_heads, head_dim, num_splits,
                         SPLITS_PAD: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s, with M the largest m_s."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    split_mask = splits < num_splits
    partial = (seq * num_heads + head) * num_splits + splits
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


@triton.jit(do_not_specialize=["stride_table"])
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


@dataclass(frozen=True)
class DecodeConfig:
    """How the decode kernels run for one model shape and dtype."""
    group_pad: int      # query rows per program: the heads sharing a KV head, padded
    tile: int           # context tokens per loop step
    num_warps: int
    use_dot: bool       # tensor-core dots (group_pad >= 16) instead of broadcast products
    dot_in_fp32: bool   # dot operands cast to fp32 (the interpreter, fp32 inputs)


def decode_config(heads_per_kv_head: int, head_dim: int, dtype: torch.dtype) -> DecodeConfig:
    """The decode kernels' configuration. Up to two query heads per KV head a broadcast product
    [group, tile, head_dim] in registers is cheapest; from four on (Llama-3's and 70B's groups)
    it spills on sm_90, so the group is padded to 16 rows and runs on tensor cores (decode
    is bound by reading K/V: the padding rows cost nothing measurable). Register use of every
    configuration is checked by bench/gpu_check.py --compile."""
    head_dim_pad = triton.next_power_of_2(head_dim)
    dot_in_fp32 = INTERPRETED or dtype == torch.float32
    if heads_per_kv_head >= 4:
        group_pad = max(16, triton.next_power_of_2(heads_per_kv_head))
        # 8 warps, and for fp32 operands (an exact FMA dot) tiles of 32 tokens: at head_dim
        # 128 wider tiles or 4 warps spill under Triton 3.6 or 3.9; these take <= 80 registers.
        tile = 32 if dot_in_fp32 and not INTERPRETED else 64
        return DecodeConfig(group_pad, tile, 8, True, dot_in_fp32)
    group_pad = triton.next_power_of_2(heads_per_kv_head)
    # At most 32 fp32 values per thread in the [group, tile, head_dim] products.
    tile = max(16, min(64, 32 * 32 * NUM_WARPS // (group_pad * head_dim_pad)))
    return DecodeConfig(group_pad, tile, NUM_WARPS, False, dot_in_fp32)


def _decode_shape(query, kv_cache, block_tables, seq_lens, query_start_loc) -> tuple:
    """Checks a decode call and returns (num_seqs, num_kv_heads, heads_per_kv_head,
    DecodeConfig)."""
    _check_attention_inputs(query, kv_cache, block_tables, seq_lens, query_start_loc)
    num_seqs = seq_lens.shape[0]
    assert query.shape[0] == num_seqs, "decode takes exactly one new token per sequence"
    num_kv_heads = kv_cache.shape[3]
    heads_per_kv_head = query.shape[1] // num_kv_heads
    config = decode_config(heads_per_kv_head, query.shape[2], kv_cache.dtype)
    return num_seqs, num_kv_heads, heads_per_kv_head, config


def _decode_launch_args(query, kv_cache, block_tables, config: DecodeConfig,
                        tile: int | None) -> dict:
    head_dim = query.shape[2]
    return dict(BLOCK_SIZE=kv_cache.shape[2], TILE=tile or config.tile,
                HEAD_DIM_PAD=triton.next_power_of_2(head_dim), GROUP_PAD=config.group_pad,
                USE_DOT=config.use_dot, DOT_IN_FP32=config.dot_in_fp32,
                num_warps=config.num_warps)


def paged_decode_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                           *, tile: int | None = None):
    """paged_attention for one new token per sequence. `tile`: context tokens per loop step."""
    num_seqs, num_kv_heads, heads_per_kv_head, config = _decode_shape(
        query, kv_cache, block_tables, seq_lens, query_start_loc)
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    _paged_decode_kernel[(num_seqs, num_kv_heads)](
        out, query, kv_cache[0], kv_cache[1], block_tables, seq_lens, query_start_loc,
        scale * LOG2_E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), *_cache_strides(kv_cache), heads_per_kv_head, query.shape[2],
        **_decode_launch_args(query, kv_cache, block_tables, config, tile))
    return out


def paged_decode_attention_split_k(query, kv_cache, block_tables, seq_lens, query_start_loc,
                                   scale, num_splits: int, *, tile: int | None = None):
    """Flash-decoding: paged_decode_attention with each context cut into num_splits parts
    (1..MAX_SPLITS; the engine uses SPLIT_K_CHOICES)."""
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{MAX_SPLITS}, got {num_splits}")
    num_seqs, num_kv_heads, heads_per_kv_head, config = _decode_shape(
        query, kv_cache, block_tables, seq_lens, query_start_loc)
    num_heads, head_dim = query.shape[1], query.shape[2]
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
        head_dim, num_splits, **_decode_launch_args(query, kv_cache, block_tables, config, tile))
    _split_reduce_kernel[(num_seqs, num_heads)](
        out, partial_max, partial_sum, partial_acc, query_start_loc, out.stride(0),
        out.stride(1), num_heads, head_dim, num_splits, SPLITS_PAD=MAX_SPLITS,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim), num_warps=NUM_WARPS)
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
    # An exact fp32 dot of 16 query rows against 32 context tokens spills under Triton 3.6:
    # fp32 context tiles are no taller than the query tile.
    if dot_in_fp32 and not INTERPRETED:
        default_tile = min(default_tile, block_m)
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
    (sequence, KV head) programs leaves the GPU's multiprocessors idle; else the largest of
    SPLIT_K_CHOICES up to about two programs per multiprocessor and MIN_TOKENS_PER_SPLIT
    tokens per split."""
    if max_context <= SPLIT_K_MIN_CONTEXT or device.type != "cuda":
        return 1  # short contexts, or the interpreter, which runs programs one after another
    programs = num_seqs * num_kv_heads
    multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= multiprocessors:
        return 1
    wanted = min(triton.cdiv(2 * multiprocessors, programs), max_context // MIN_TOKENS_PER_SPLIT)
    return max((n for n in SPLIT_K_CHOICES if n <= wanted), default=1)


def paged_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, scale,
                    tree_mask=None, *, max_query_len: int | None = None,
                    max_seq_len: int | None = None):
    """The engine's entry point: decode (split-K for long contexts) or prefill. A tree_mask
    goes to the prefill kernel; a step of one token per sequence has no tree (a lone token's
    entry is -1), so the decode kernels take none. max_query_len and max_seq_len are the step's
    longest query and context, which the engine's runner knows on the host: given, nothing is
    read back from the device (without them the prefill grid reads query_start_loc back and the
    split choice takes the block tables' width)."""
    num_seqs = seq_lens.shape[0]
    if query.shape[0] != num_seqs:
        return paged_prefill_attention(query, kv_cache, block_tables, seq_lens, query_start_loc,
                                       scale, tree_mask, max_query_len=max_query_len)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * kv_cache.shape[2]
    num_splits = choose_num_splits(num_seqs, kv_cache.shape[3], max_seq_len, query.device)
    if num_splits > 1:
        return paged_decode_attention_split_k(query, kv_cache, block_tables, seq_lens,
                                              query_start_loc, scale, num_splits)
    return paged_decode_attention(query, kv_cache, block_tables, seq_lens, query_start_loc, scale)


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
            dtype: torch.dtype, device: torch.device) -> None:
    """Compile, before a run, every kernel variant the engine launches for this model shape:
    the decode kernel, the split-K kernel and its reduce (one variant serves every count in
    SPLIT_K_CHOICES), the prefill kernel at each query-tile height it picks (by the step's
    longest query: 16, 32, 64 rows) with and without a tree mask, the cache write and the block
    copy. Run-time values that vary from step to step (the block tables' width, the split
    count) are not specialised on, so no step compiles."""
    _require_triton()
    gen = torch.Generator(device=device).manual_seed(0)
    longest = 64
    blocks_per_seq = triton.cdiv(longest, block_size)
    kv_cache = torch.zeros(2, 1 + blocks_per_seq, block_size, num_kv_heads, head_dim,
                           dtype=dtype, device=device)
    block_tables = 1 + torch.arange(blocks_per_seq, dtype=torch.int32,
                                    device=device).repeat(2, 1)
    for query_len in (1, 16, 32, longest):
        num_tokens = 2 * query_len
        query = torch.randn(num_tokens, num_heads, head_dim, generator=gen, device=device,
                            dtype=dtype)
        key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device=device,
                          dtype=dtype)
        slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
        write_kv_cache(key, key, kv_cache, slots)
        seq_lens = torch.full((2,), query_len, dtype=torch.int32, device=device)
        query_start_loc = torch.arange(0, 3 * query_len, query_len, dtype=torch.int32,
                                       device=device)
        args = (query, kv_cache, block_tables, seq_lens, query_start_loc, head_dim ** -0.5)
        if query_len == 1:
            paged_decode_attention(*args)
            paged_decode_attention_split_k(*args, num_splits=SPLIT_K_CHOICES[0])
        else:
            paged_prefill_attention(*args, max_query_len=query_len)
            # Token-tree verification's variant (a mask entry of -1: plain causal).
            paged_prefill_attention(*args, torch.full((num_tokens,), -1, dtype=torch.int64,
                                                      device=device), max_query_len=query_len)
    copy_blocks(kv_cache, torch.tensor([[1, 2]], device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
