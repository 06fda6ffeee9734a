"""The Triton paged-KV operations' launchers, with kernels/naive.py's API: decode, split-K
decode (flash-decoding: few sequences with long contexts leave the plain grid too few programs),
prefill, the `paged_attention` dispatcher the engine calls, `warm_up`, add_lora, and the cache's
data movement (swap_blocks is a torch copy, as it crosses devices).

Every sequence in a call has at least one new token, so a call with as many tokens as sequences
is a pure decode step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.ops import KernelOps
from kernels.tree_mask import TREE_WINDOW
from kernels.triton_attention import (_paged_decode_kernel, _paged_decode_split_kernel,
                                      _paged_prefill_kernel, _split_reduce_kernel)
from kernels.triton_cache import _copy_blocks_kernel, _write_kv_cache_kernel
from kernels.triton_lora import add_lora as grouped_add_lora
# Launchers read UNAVAILABLE_REASON from this module, where bench/gpu_check.py --compile clears it.
from kernels.triton_mode import INTERPRETED, UNAVAILABLE_REASON, triton

LOG2_E = 1.4426950408889634  # softmax in base 2: exp(x) = exp2(x * log2 e), exp2 is cheaper
SPLIT_K_MIN_CONTEXT = 2048  # decode contexts longer than this may be split (flash-decoding)
MIN_TOKENS_PER_SPLIT = 512  # shorter splits cost more in the reduce than they win
# The split counts the dispatcher chooses from; the split kernel takes the count at run time, so
# one compiled variant serves them all (warm_up compiles it).
SPLIT_K_CHOICES = (2, 4, 8, 16)
MAX_SPLITS = 16
NUM_WARPS = 4


def require_triton():
    """Raise, saying why, when the kernels cannot run in this process."""
    if UNAVAILABLE_REASON is not None:
        raise RuntimeError(f"kernels.triton_ops cannot run: {UNAVAILABLE_REASON}")


def _check_attention_inputs(query, kv_cache, block_tables, seq_lens, query_start_loc):
    require_triton()
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
    """The decode kernels' configuration: a broadcast product up to two query heads per KV head;
    from four on it spills registers on sm_90, so the group is padded to 16 rows on tensor cores,
    whose padding costs nothing measurable in a step bound by reading K/V."""
    head_dim_pad = triton.next_power_of_2(head_dim)
    dot_in_fp32 = INTERPRETED or dtype == torch.float32
    if heads_per_kv_head >= 4:
        group_pad = max(16, triton.next_power_of_2(heads_per_kv_head))
        # 8 warps, and 32-token tiles for an exact fp32 dot: wider tiles or 4 warps spill registers.
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
    """paged_attention for any number of new tokens per sequence (tree_mask optional); a given
    max_query_len saves reading query_start_loc back to size the grid."""
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
    # fp32 operands take an exact (not tf32) dot, which needs smaller tiles to fit the registers.
    dot_in_fp32 = INTERPRETED or torch.float32 in (query.dtype, kv_cache.dtype)
    default_tile = 32 if dot_in_fp32 and not INTERPRETED else 64
    block_m = max(16, min(block_m or default_tile, triton.next_power_of_2(max_query_len)))
    # An exact fp32 dot spills with context tiles taller than the query tile.
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
    """Splits for a decode step: 1 unless the contexts are long and the plain grid leaves
    multiprocessors idle, else the largest of SPLIT_K_CHOICES up to about two programs per
    multiprocessor and MIN_TOKENS_PER_SPLIT tokens per split."""
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
    """The engine's entry point: decode (split-K for long contexts) or prefill (which alone takes
    a tree_mask). Given max_query_len and max_seq_len, nothing is read back from the device."""
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
    """Compile every kernel variant the engine launches for this model shape before a run; the
    values that vary per step (block-table width, split count) are not specialised on, so no
    step compiles."""
    require_triton()
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
    require_triton()
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
    require_triton()
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


def add_lora(out, x, lora_a, lora_b, scalings, batch, **tiles):
    """kernels/triton_lora.py's add_lora (kernels/lora_batch.py's API), where the kernels run."""
    require_triton()
    grouped_add_lora(out, x, lora_a, lora_b, scalings, batch, **tiles)


# The dispatcher takes the step's longest query and context from the caller (the engine's runner,
# which has them on the host), so it reads nothing back from the device.
KERNEL_OPS = KernelOps("triton", write_kv_cache, paged_attention, copy_blocks, swap_blocks,
                       takes_host_lengths=True, warm_up=warm_up, add_lora=add_lora)
