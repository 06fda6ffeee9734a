"""The Triton attention kernels over the paged KV cache (launched by kernels/triton_ops.py):
decode (one program per sequence and KV head, the GQA group's queries together so that K/V are
read once), split-K decode and its reduce (flash-decoding), and prefill (query tiles against
context tiles, causal by position, with an optional tree mask).

Softmax runs in base 2. Dot operands are cast to fp32 under the interpreter, which computes a
bf16 tl.dot wrongly, and for fp32 inputs, which the GPU would round to tf32; every load and store
is masked since the interpreter has no bounds checks.
"""
from __future__ import annotations

from kernels.triton_mode import tl, triton


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
    """Online softmax of the query heads q over cache positions [token_start, token_end) of one
    sequence and KV head: (running max, running sum, unnormalized weighted values), base 2.
    USE_DOT runs on tensor cores (>= 16 rows, padded with zeros); otherwise a broadcast product,
    which spills registers past two heads per KV head."""
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
    """Split `split` of the context: partials to max/sum [seqs, heads, splits] and acc [seqs,
    heads, splits, head_dim] (empty past the end); num_splits is not specialised, so one
    compiled kernel serves every split count."""
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
    """Queries [q_block * BLOCK_M, +BLOCK_M) of one sequence and head against its context; with
    TREE, a row sees a position within TREE_WINDOW only where its tree_mask bit is set."""
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
