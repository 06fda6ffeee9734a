"""The Triton data-movement kernels of the paged KV cache: writing a step's K and V into their
slots, and copying blocks (copy-on-write); loads and stores masked for the interpreter."""
from __future__ import annotations

from kernels.triton_mode import tl, triton


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
