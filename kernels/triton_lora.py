"""The Triton multi-LoRA kernels (SGMV-style, as Punica and S-LoRA) and their launcher, with
kernels/lora_batch.py's API. Over the tokens grouped by slot, shrink computes x @ A^T and expand
adds scaling * v @ B^T per output tile, gathering token rows in place; a token is in exactly one
group, so expand needs no atomics. Ranks are padded to a power of two >= 16 (tl.dot's minimum),
and operands are cast to fp32 where bf16 dots would be wrong (the interpreter) or tf32 (fp32 in).
"""
from __future__ import annotations

import torch

from kernels.lora_batch import LoRABatch
from kernels.triton_mode import INTERPRETED, tl, triton

BLOCK_M = 16
# Input and output columns per tile; the interpreter runs one program at a time, each a numpy
# call per operation, so there wider tiles (fewer programs) run many times faster.
BLOCK_K, BLOCK_N = (256, 256) if INTERPRETED else (64, 64)
NUM_WARPS = 4


@triton.jit
def _group_tile(sorted_tokens_ptr, group_starts_ptr, group_slots_ptr, BLOCK_M: tl.constexpr):
    """(tile rows in sorted order, their mask, their token ids, slot) of program (group, tile)."""
    group = tl.program_id(0)
    start = tl.load(group_starts_ptr + group)
    end = tl.load(group_starts_ptr + group + 1)
    slot = tl.load(group_slots_ptr + group).to(tl.int64)
    rows = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    tokens = tl.load(sorted_tokens_ptr + rows, mask=row_mask, other=0)
    return rows.to(tl.int64), row_mask, tokens.to(tl.int64), slot


@triton.jit
def _lora_shrink_kernel(v_ptr, x_ptr, a_ptr, sorted_tokens_ptr, group_starts_ptr,
                        group_slots_ptr, in_features, max_rank, stride_xt, stride_as,
                        stride_ar, stride_vt, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        RANK_PAD: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """v[rows] = x[tokens] @ A[slot]^T for one tile of one group."""
    rows, row_mask, tokens, slot = _group_tile(sorted_tokens_ptr, group_starts_ptr,
                                               group_slots_ptr, BLOCK_M)
    offs_r = tl.arange(0, RANK_PAD)
    rank_mask = offs_r < max_rank
    acc = tl.zeros([BLOCK_M, RANK_PAD], tl.float32)
    for k_start in range(0, in_features, BLOCK_K):
        offs_k = k_start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < in_features
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_ptr + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :],
                    mask=rank_mask[:, None] & k_mask[None, :], other=0.0)
        if DOT_IN_FP32:
            acc += tl.dot(x.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(a))
    tl.store(v_ptr + rows[:, None] * stride_vt + offs_r[None, :], acc, mask=row_mask[:, None])


@triton.jit
def _lora_expand_kernel(out_ptr, v_ptr, b_ptr, scalings_ptr, sorted_tokens_ptr,
                        group_starts_ptr, group_slots_ptr, out_features, max_rank, stride_ot,
                        stride_vt, stride_bs, stride_bn, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, RANK_PAD: tl.constexpr,
                        DOT_IN_FP32: tl.constexpr):
    """out[tokens, n-tile] += scaling[slot] * v[rows] @ B[slot, n-tile]^T."""
    rows, row_mask, tokens, slot = _group_tile(sorted_tokens_ptr, group_starts_ptr,
                                               group_slots_ptr, BLOCK_M)
    offs_r = tl.arange(0, RANK_PAD)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    v = tl.load(v_ptr + rows[:, None] * stride_vt + offs_r[None, :], mask=row_mask[:, None],
                other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + offs_n[:, None] * stride_bn + offs_r[None, :],
                mask=n_mask[:, None] & (offs_r < max_rank)[None, :], other=0.0)
    if DOT_IN_FP32:
        delta = tl.dot(v, tl.trans(b.to(tl.float32)), input_precision="ieee")
    else:
        delta = tl.dot(v.to(b.dtype), tl.trans(b))
    delta = delta * tl.load(scalings_ptr + slot)
    out_offsets = tokens[:, None] * stride_ot + offs_n[None, :]
    out_mask = row_mask[:, None] & n_mask[None, :]
    out = tl.load(out_ptr + out_offsets, mask=out_mask, other=0.0)
    tl.store(out_ptr + out_offsets, (out.to(tl.float32) + delta).to(out.dtype), mask=out_mask)


def rank_pad(max_rank: int) -> int:
    return max(16, triton.next_power_of_2(max_rank))


def add_lora(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scalings: torch.Tensor, batch: LoRABatch, *, block_k: int = BLOCK_K,
             block_n: int = BLOCK_N) -> None:
    """out[t] += scalings[s] * lora_b[s] @ (lora_a[s] @ x[t]) for each token t of slot s;
    unchecked (triton_ops.add_lora checks that the kernels can run)."""
    num_tokens, in_features = x.shape
    num_slots, max_rank, _ = lora_a.shape
    out_features = out.shape[1]
    assert out.shape[0] == num_tokens and lora_a.shape[2] == in_features
    assert lora_b.shape == (num_slots, out_features, max_rank) and scalings.shape == (num_slots,)
    assert x.stride(1) == 1 and out.stride(1) == 1, "feature dimensions must be contiguous"
    assert lora_a.stride(2) == 1 and lora_b.stride(2) == 1
    if batch.num_groups == 0:
        return
    pad = rank_pad(max_rank)
    dot_in_fp32 = INTERPRETED or torch.float32 in (x.dtype, lora_a.dtype)
    v = torch.empty(batch.num_lora_tokens, pad, dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(batch.max_group_len, BLOCK_M)
    group_args = (batch.sorted_tokens, batch.group_starts, batch.group_slots)
    _lora_shrink_kernel[(batch.num_groups, tiles)](
        v, x, lora_a, *group_args, in_features, max_rank, x.stride(0), lora_a.stride(0),
        lora_a.stride(1), v.stride(0), BLOCK_M=BLOCK_M, BLOCK_K=block_k, RANK_PAD=pad,
        DOT_IN_FP32=dot_in_fp32, num_warps=NUM_WARPS)
    _lora_expand_kernel[(batch.num_groups, tiles, triton.cdiv(out_features, block_n))](
        out, v, lora_b, scalings, *group_args, out_features, max_rank, out.stride(0),
        v.stride(0), lora_b.stride(0), lora_b.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        RANK_PAD=pad, DOT_IN_FP32=dot_in_fp32, num_warps=NUM_WARPS)


def warm_up_lora(shapes: list[tuple[int, int]], max_rank: int, dtype: torch.dtype,
                 device: torch.device) -> None:
    """Compile, before a run, the kernels for target modules of (in_features, out_features)
    `shapes` with slots of `max_rank` in `dtype` (one variant per rank padding and dtype)."""
    gen = torch.Generator(device=device).manual_seed(0)
    batch = LoRABatch.build([0, -1, 0], device)
    scalings = torch.ones(1, dtype=torch.float32, device=device)
    for in_features, out_features in shapes:
        x = torch.randn(3, in_features, generator=gen, device=device, dtype=dtype)
        out = torch.zeros(3, out_features, device=device, dtype=dtype)
        lora_a = torch.zeros(1, max_rank, in_features, device=device, dtype=dtype)
        lora_b = torch.zeros(1, out_features, max_rank, device=device, dtype=dtype)
        add_lora(out, x, lora_a, lora_b, scalings, batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
