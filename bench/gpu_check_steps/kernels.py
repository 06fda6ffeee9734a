"""Step: every kernel configuration the engine runs against the loop oracle (kernels/naive.py):
decode, split-K, the dispatcher, prefill with a cached prefix, chunked prefill with decodes,
short verification queries and token trees; KV write, block copy and swaps exactly; the
multi-LoRA kernel at Llama-2-7B's module shapes (lora.py)."""
from __future__ import annotations

from gpu_check_steps.common import REL_TOLERANCE, SHORT_DTYPE, StepReport, dtype_of, \
    make_batch, relative_error, to_cpu
from gpu_check_steps.lora import check_lora_kernel

# The kernel configurations checked and compiled: (query heads per KV head, head_dim, dtype
# name); the engine runs bf16 (2-byte conf/model entries) and fp32 (tiny-llama).
GROUPS, HEAD_DIMS, DTYPES = (1, 2, 8), (64, 128), ("bfloat16", "float32")
KERNEL_MATRIX_NAMES = [(g, d, t) for t in DTYPES for g in GROUPS for d in HEAD_DIMS]
# --smoke: one grouped configuration (the interpreter is slow; its bf16 dots run in fp32).
SMOKE_MATRIX_NAMES = [(2, 32, "bfloat16")]

# Workloads, (query_lens, cached_lens) at GPU / smoke sizes. The cached lengths of the prefix
# prefill are whole blocks of 16 (what a prefix-cache hit leaves); the short queries are what
# speculative verification runs (k + 1 tokens).
KERNEL_WORKLOADS = {
    "decode": (([1] * 6, [0, 15, 499, 1000, 2047, 3000]), ([1] * 3, [0, 17, 40])),
    "decode, long contexts (split-K)": (([1] * 2, [4095, 2500]), ([1] * 2, [70, 33])),
    "prefill with a cached prefix": (([40, 100, 7], [48, 512, 0]), ([9, 5], [16, 0])),
    "chunked prefill with decodes": (([96, 1, 40, 1], [1024, 2000, 0, 77]),
                                     ([9, 1, 5, 1], [4, 20, 0, 7])),
    "short queries (verification)": (([5, 1, 9], [100, 40, 3000]), ([3, 1, 4], [10, 4, 30])),
}


TREE_WORKLOAD = "short queries (verification)"


def random_tree_mask(query_lens, seed):
    """tree_mask entries for a batch whose every query is a root and a random tree of candidate
    tokens (engine/token_tree.py's layout)."""
    import random

    import torch

    from engine.token_tree import TokenTree
    rng = random.Random(seed)
    entries = []
    for query_len in query_lens:
        parents = [rng.randrange(-1, node) for node in range(query_len - 1)]
        entries += TokenTree.from_parents([0] * len(parents), parents).mask_entries()
    return torch.tensor(entries, dtype=torch.int64)


def step_kernels(report: StepReport, smoke: bool) -> None:
    import torch

    from kernels import naive, triton_ops
    device = torch.device("cpu" if smoke else "cuda")
    size = 1 if smoke else 0
    block_size = 4 if smoke else 16
    matrix = SMOKE_MATRIX_NAMES if smoke else KERNEL_MATRIX_NAMES
    for heads_per_kv_head, head_dim, dtype_name in matrix:
        dtype = dtype_of(dtype_name)
        tolerance = REL_TOLERANCE[dtype_name]
        config = f"{SHORT_DTYPE[dtype_name]}, {heads_per_kv_head} q/kv heads, d{head_dim}"
        shape = dict(num_kv_heads=2, heads_per_kv_head=heads_per_kv_head, head_dim=head_dim,
                     block_size=block_size, dtype=dtype, device=device)
        for seed, (workload, sizes) in enumerate(KERNEL_WORKLOADS.items()):
            batch = make_batch(*sizes[size], seed=seed, **shape)
            expected = naive.paged_attention(*to_cpu(batch))
            is_decode = batch[0].shape[0] == batch[3].shape[0]
            max_query_len = int((batch[4][1:] - batch[4][:-1]).max())
            outputs = {"dispatcher": triton_ops.paged_attention(
                *batch, max_query_len=max_query_len, max_seq_len=int(batch[3].max()))}
            if is_decode:
                outputs["decode kernel"] = triton_ops.paged_decode_attention(*batch)
                for num_splits in triton_ops.SPLIT_K_CHOICES:
                    outputs[f"split-K {num_splits}"] = \
                        triton_ops.paged_decode_attention_split_k(*batch, num_splits=num_splits)
            if workload == TREE_WORKLOAD:
                # The same queries as token trees: each node sees the context and its ancestors.
                tree_mask = random_tree_mask(sizes[size][0], seed)
                expected_tree = naive.paged_attention(*to_cpu(batch), tree_mask=tree_mask)
                outputs["dispatcher, token trees"] = triton_ops.paged_attention(
                    *batch, tree_mask.to(device), max_query_len=max_query_len,
                    max_seq_len=int(batch[3].max()))
            for kernel, out in outputs.items():
                reference = expected_tree if kernel.endswith("token trees") else expected
                error = relative_error(out, reference)
                report.check(f"{config}: {workload}, {kernel}", f"{error:.1e}",
                             error <= tolerance, rel_error=error, tolerance=tolerance)
        check_cache_ops(report, config, triton_ops, naive, shape)
    check_lora_kernel(report, smoke, device)


def check_cache_ops(report: StepReport, config: str, triton_ops, naive, shape: dict) -> None:
    """write_kv_cache (with padding slots), copy_blocks, swap out and in: exact."""
    import torch
    device, dtype = shape["device"], shape["dtype"]
    block_size, num_kv_heads, head_dim = shape["block_size"], shape["num_kv_heads"], \
        shape["head_dim"]
    gen = torch.Generator().manual_seed(3)
    num_blocks = 64
    num_tokens = num_blocks * block_size // 2
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    key, value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) for _ in "kv")
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::7] = -1  # padding tokens
    expected = kv_cache.to(dtype)
    naive.write_kv_cache(key.to(dtype), value.to(dtype), expected, slots)
    cache = kv_cache.to(device, dtype)
    triton_ops.write_kv_cache(key.to(device, dtype), value.to(device, dtype), cache,
                              slots.to(device))
    same = torch.equal(cache.cpu(), expected)
    report.check(f"{config}: write_kv_cache", "exact" if same else "MISMATCH", same)

    pairs = torch.stack([torch.arange(0, 20), torch.arange(30, 50)], dim=1)
    naive.copy_blocks(expected, pairs)
    triton_ops.copy_blocks(cache, pairs.to(device))
    same = torch.equal(cache.cpu(), expected)
    report.check(f"{config}: copy_blocks", "exact" if same else "MISMATCH", same)

    host = torch.zeros(2, 16, block_size, num_kv_heads, head_dim, dtype=dtype,
                       pin_memory=device.type == "cuda")
    out_pairs, in_pairs = torch.tensor([[5, 0], [40, 3]]), torch.tensor([[0, 9], [3, 1]])
    triton_ops.swap_blocks(cache, host, out_pairs)
    triton_ops.swap_blocks(host, cache, in_pairs)
    naive.swap_blocks(expected, expected, torch.tensor([[5, 9], [40, 1]]))
    same = torch.equal(cache.cpu(), expected)
    report.check(f"{config}: swap_blocks out and in", "exact" if same else "MISMATCH", same)


