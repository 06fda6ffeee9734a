"""Paged-KV kernels against the loop oracle (kernels/naive.py), itself checked against dense SDPA.

Every implementation (the Triton kernels, through Triton's interpreter without a GPU, and the
engine's vectorized torch path kernels/torch_paged.py) gets random inputs at tiny sizes: block
tables drawn from a shuffled pool, ragged contexts, pure decode, pure prefill and chunked prefill
over cached context, with every pair of block size (1/4/16), GQA ratio (1/2) and dtype
(fp32/fp16) covered. Memory a kernel must not read (block 0, which pads the block tables, and
the unused tail of each sequence's last block) is poisoned with NaN, so an unmasked read shows.

Triton's interpreter must be chosen before triton is first imported (kernels/triton_ops.py does
so when it is first). Under pytest-xdist another test module in this worker may have imported
triton already (transformers does, through torch._dynamo); then the in-process Triton tests skip
and one test reruns this file in a fresh process. Whether the kernels compile for a real GPU
without spilling is checked without one (bench/gpu_check.py --compile); tests at Llama-2-7B
shapes in bf16 need CUDA and skip without it.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernels import naive
from triton_interpreter import run_pytest_under_interpreter

try:
    from kernels import triton_ops  # picks the interpreter without CUDA, if it can (docstring)
    TRITON_SKIP_REASON = triton_ops.UNAVAILABLE_REASON
except ImportError as error:  # triton not installed
    triton_ops = None
    TRITON_SKIP_REASON = f"triton does not import: {error}"

REPO = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(TRITON_SKIP_REASON is not None,
                                  reason=str(TRITON_SKIP_REASON))
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


# ---------------------------------------------------------------------------------------------
# Random paged batches


@dataclass
class Batch:
    query: torch.Tensor
    kv_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    def args(self):
        return (self.query, self.kv_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, self.scale)


def make_batch(query_lens, cached_lens, *, block_size, heads_per_kv_head, dtype, seed,
               num_kv_heads=2, head_dim=32, spare_blocks=4, poison=float("nan"),
               device=DEVICE) -> Batch:
    """Sequence b has cached_lens[b] tokens from earlier steps and query_lens[b] new ones, all
    already in the cache. Its blocks come from a shuffled pool; block 0 is never allocated and
    pads the tables, and it and every unused slot hold `poison`."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(cached_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    kv_cache[:, 0] = poison
    pool = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    for seq, (seq_len, num) in enumerate(zip(seq_lens, blocks_per_seq)):
        blocks = [pool.pop() for _ in range(num)]
        block_tables[seq, :num] = torch.tensor(blocks)
        kv_cache[:, blocks[-1], seq_len - (num - 1) * block_size:] = poison
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    num_heads = num_kv_heads * heads_per_kv_head
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen)
    return Batch(query.to(device, dtype), kv_cache.to(device, dtype), block_tables.to(device),
                 torch.tensor(seq_lens, dtype=torch.int32, device=device),
                 query_start_loc.to(device), head_dim ** -0.5)


def dense_attention(batch: Batch) -> torch.Tensor:
    """Independent of the oracle: each sequence's K/V gathered by whole blocks, then SDPA in
    fp32 with a causal mask offset by the cached length."""
    query, kv_cache = batch.query, batch.kv_cache
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    heads_per_kv_head = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    starts = batch.query_start_loc.tolist()
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        blocks = batch.block_tables[seq, : -(-seq_len // block_size)].long()
        k, v = (kv_cache[i, blocks].flatten(0, 1)[:seq_len].float() for i in (0, 1))
        k, v = (t.repeat_interleave(heads_per_kv_head, dim=1).transpose(0, 1) for t in (k, v))
        q = query[starts[seq]: starts[seq + 1]].float().transpose(0, 1)
        positions = torch.arange(seq_len - q.shape[1], seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= positions[:, None]
        attended = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=visible, scale=batch.scale)
        out[starts[seq]: starts[seq + 1]] = attended.transpose(0, 1).to(query.dtype)
    return out


# Workloads: (query_lens, cached_lens).
DECODE = ([1, 1, 1, 1, 1], [0, 3, 15, 16, 62])
PREFILL = ([9, 1, 23, 40], [0, 0, 0, 0])
CHUNKED_PREFILL = ([7, 1, 20, 33], [10, 4, 25, 3])  # cached context (earlier chunks or prefix hits)
WORKLOADS = {"decode": DECODE, "prefill": PREFILL, "chunked_prefill": CHUNKED_PREFILL}


def assert_close(actual, expected, dtype):
    assert torch.isfinite(actual).all(), "non-finite output: a masked read or an unwritten element"
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCE[dtype])


# ---------------------------------------------------------------------------------------------
# Implementations under test


def reference_module():
    try:
        return importlib.import_module("kernels.torch_paged")
    except ModuleNotFoundError as error:
        if error.name in ("kernels.torch_paged", "kernels"):
            pytest.skip("kernels/torch_paged.py does not exist yet")
        raise


def triton_decode(*args):
    return triton_ops.paged_decode_attention(*args, tile=16)  # small tiles: several per context


def triton_split_k(*args):
    return triton_ops.paged_decode_attention_split_k(*args, num_splits=3, tile=16)


def triton_prefill(*args):
    return triton_ops.paged_prefill_attention(*args, block_m=16, block_n=16)


def reference_attention(*args):
    return reference_module().paged_attention(*args)


TRITON_ATTENTION = {"decode": triton_decode, "split_k": triton_split_k, "prefill": triton_prefill}


def attention_impls(workload):
    """pytest params of every implementation that takes this workload. The dispatcher has its
    own test (test_dispatcher_routes); the kernels it routes to are checked here."""
    names = ["decode", "split_k"] if workload == "decode" else ["prefill"]
    impls = [pytest.param(TRITON_ATTENTION[name], id=f"triton_{name}", marks=needs_triton)
             for name in names]
    return impls + [pytest.param(reference_attention, id="reference")]


# ---------------------------------------------------------------------------------------------
# The oracle itself


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("block_size", [1, 4])
def test_naive_matches_dense_sdpa(workload, block_size):
    batch = make_batch(*WORKLOADS[workload], block_size=block_size, heads_per_kv_head=2,
                       dtype=torch.float32, seed=block_size, device="cpu")
    assert_close(naive.paged_attention(*batch.args()), dense_attention(batch), torch.float32)


def test_naive_cache_ops():
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.zeros(2, 4, 2, 1, 3)
    key, value = torch.randn(3, 1, 3, generator=gen), torch.randn(3, 1, 3, generator=gen)
    naive.write_kv_cache(key, value, kv_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(kv_cache[0, 2, 1], key[0]) and torch.equal(kv_cache[1, 0, 0], value[2])
    assert int((kv_cache != 0).any(-1).sum()) == 4  # two slots, K and V; the padding skipped
    naive.copy_blocks(kv_cache, torch.tensor([[2, 3]]))
    assert torch.equal(kv_cache[:, 3], kv_cache[:, 2])
    host = torch.zeros_like(kv_cache)
    naive.swap_blocks(kv_cache, host, torch.tensor([[0, 1]]))
    assert torch.equal(host[:, 1], kv_cache[:, 0])


# ---------------------------------------------------------------------------------------------
# Attention


# Every pair of (block size, GQA ratio, dtype) values occurs in some case: half the full grid.
PAIRWISE_CASES = [(1, 1, torch.float32), (1, 2, torch.float16), (4, 1, torch.float16),
                  (4, 2, torch.float32), (16, 1, torch.float32), (16, 2, torch.float16)]


def attention_cases(workload):
    return [pytest.param(impl.values[0], block_size, heads_per_kv_head, dtype,
                         id=f"{impl.id}-bs{block_size}-gqa{heads_per_kv_head}-{str(dtype)[6:]}",
                         marks=impl.marks)
            for impl in attention_impls(workload)
            for block_size, heads_per_kv_head, dtype in PAIRWISE_CASES]


def check_attention(attention, workload, block_size, heads_per_kv_head, dtype):
    seed = zlib.crc32(f"{workload}-{block_size}-{heads_per_kv_head}-{dtype}".encode())
    # The kernels never load memory outside a context, so NaN there must not reach the output.
    # The reference gathers whole blocks and masks scores (0 x NaN = NaN), so it is held to the
    # weaker contract a zero-initialised pool gives: finite, wrong values there must not matter.
    poison = 1e3 if attention is reference_attention else float("nan")
    batch = make_batch(*WORKLOADS[workload], block_size=block_size,
                       heads_per_kv_head=heads_per_kv_head, dtype=dtype, seed=seed, poison=poison)
    out = attention(*batch.args())
    assert out.shape == batch.query.shape and out.dtype == dtype
    assert_close(out, naive.paged_attention(*batch.args()), dtype)


@pytest.mark.parametrize("attention, block_size, heads_per_kv_head, dtype",
                         attention_cases("decode"))
def test_decode_attention(attention, block_size, heads_per_kv_head, dtype):
    check_attention(attention, "decode", block_size, heads_per_kv_head, dtype)


@pytest.mark.parametrize("attention, block_size, heads_per_kv_head, dtype",
                         attention_cases("prefill"))
def test_prefill_attention(attention, block_size, heads_per_kv_head, dtype):
    check_attention(attention, "prefill", block_size, heads_per_kv_head, dtype)


@pytest.mark.parametrize("attention, block_size, heads_per_kv_head, dtype",
                         attention_cases("chunked_prefill"))
def test_chunked_prefill_attention(attention, block_size, heads_per_kv_head, dtype):
    check_attention(attention, "chunked_prefill", block_size, heads_per_kv_head, dtype)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("workload", WORKLOADS)
def test_dispatcher_routes(workload, dtype):
    """The engine's entry point, also in bf16 (the engine's dtype on a GPU)."""
    batch = make_batch(*WORKLOADS[workload], block_size=4, heads_per_kv_head=2, dtype=dtype,
                       seed=5)
    out = triton_ops.paged_attention(*batch.args())
    assert out.dtype == dtype
    assert_close(out, naive.paged_attention(*batch.args()), dtype)


def test_split_count_heuristic():
    if triton_ops is None:
        pytest.skip(TRITON_SKIP_REASON)
    choose = triton_ops.choose_num_splits
    assert choose(1, 8, 100_000, torch.device("cpu")) == 1  # the interpreter gains nothing
    if torch.cuda.is_available():
        cuda = torch.device("cuda")
        assert choose(2, 8, 1024, cuda) == 1  # short contexts
        assert choose(512, 32, 8192, cuda) == 1  # enough programs already
        assert 1 < choose(1, 8, 8192, cuda) <= 8192 // triton_ops.MIN_TOKENS_PER_SPLIT


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 2, 5, 8])
def test_split_k_any_number_of_splits(num_splits):
    """Splits past a short context are empty and must drop out of the reduce."""
    batch = make_batch([1, 1, 1], [2, 40, 70], block_size=4, heads_per_kv_head=2,
                       dtype=torch.float32, seed=num_splits)
    out = triton_ops.paged_decode_attention_split_k(*batch.args(), num_splits=num_splits, tile=16)
    assert_close(out, naive.paged_attention(*batch.args()), torch.float32)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_8_decode_runs_on_tensor_core_dots(dtype):
    """70B-style groups (8 query heads per KV head) take the tl.dot path, padded to 16 rows;
    one or two heads per KV head keep the broadcast product."""
    config = triton_ops.decode_config(8, 128, dtype)
    assert config.use_dot and config.group_pad == 16
    assert not triton_ops.decode_config(2, 128, dtype).use_dot
    batch = make_batch(*DECODE, block_size=4, heads_per_kv_head=8, dtype=dtype, seed=11)
    expected = naive.paged_attention(*batch.args())
    assert_close(triton_ops.paged_decode_attention(*batch.args(), tile=16), expected, dtype)
    assert_close(triton_ops.paged_decode_attention_split_k(*batch.args(), num_splits=4, tile=16),
                 expected, dtype)


def test_split_count_comes_from_the_fixed_set(monkeypatch):
    """On a GPU of 132 multiprocessors the dispatcher's split counts are SPLIT_K_CHOICES only
    (one compiled kernel serves them all), never more than the context allows."""
    if triton_ops is None:
        pytest.skip(TRITON_SKIP_REASON)

    class Properties:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    cuda = torch.device("cuda")
    chosen = {triton_ops.choose_num_splits(seqs, kv_heads, context, cuda)
              for seqs in (1, 2, 3, 5, 16, 64) for kv_heads in (1, 8, 32)
              for context in (1024, 2049, 3000, 4096, 8192, 32768)}
    assert chosen <= {1, *triton_ops.SPLIT_K_CHOICES} and len(chosen) > 2
    assert triton_ops.choose_num_splits(1, 8, 3000, cuda) <= 3000 // \
        triton_ops.MIN_TOKENS_PER_SPLIT
    assert triton_ops.choose_num_splits(64, 32, 8192, cuda) == 1  # enough programs already


def launch_variants(run) -> set:
    """The compiled variants `run()` launches: kernel, constexprs and warps (the launchers pass
    them by keyword, the run-time arguments by position), and the specialisation Triton gives
    the other ints (== 1, divisible by 16) but those a kernel does not specialise on; launches
    captured, not run (compiled kernels, or the interpreter's)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    variants = set()

    def unspecialised(kernel) -> set:
        if hasattr(kernel, "params"):  # a JITFunction
            return {p.name for p in kernel.params if p.do_not_specialize}
        return set(kernel.kwargs.get("do_not_specialize") or ())  # an InterpretedFunction

    def capture(self, *args, grid, warmup, **kwargs):
        skip = unspecialised(self)
        ints = tuple((name, value == 1, value % 16 == 0)
                     for name, value in zip(self.arg_names, args)
                     if type(value) is int and name not in skip)
        variants.add((self.__name__, tuple(sorted(kwargs.items())), ints))

    originals = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}
    for cls in originals:
        cls.run = capture
    try:
        run()
    finally:
        for cls, original in originals.items():
            cls.run = original
    assert variants, "no launch was captured"
    return variants


@needs_triton
@pytest.mark.parametrize("heads_per_kv_head, dtype", [(1, torch.float32), (8, torch.bfloat16)])
def test_warm_up_compiles_every_variant_a_run_launches(heads_per_kv_head, dtype):
    """No step compiles: whatever a run's steps launch (decodes of any width of block table,
    any split count, prefills and chunks of any length) warm_up has launched the same
    variant."""
    num_kv_heads, head_dim, block_size = 2, 32, 4
    warmed = launch_variants(lambda: triton_ops.warm_up(
        num_kv_heads * heads_per_kv_head, num_kv_heads, head_dim, block_size, dtype,
        torch.device(DEVICE)))

    def run_steps():
        for seed, (query_lens, cached_lens) in enumerate([
                ([1], [0]), ([1] * 3, [3, 60, 63]), ([1, 1], [127, 4]), ([5, 1], [3, 70]),
                ([16, 17], [0, 4]), ([40, 1, 1], [0, 8, 200]), ([100], [28])]):
            batch = make_batch(query_lens, cached_lens, block_size=block_size,
                               heads_per_kv_head=heads_per_kv_head, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, dtype=dtype, seed=seed)
            triton_ops.paged_attention(*batch.args(), max_query_len=max(query_lens),
                                       max_seq_len=int(batch.seq_lens.max()))
            if len(query_lens) == len(cached_lens) and max(query_lens) == 1:
                for num_splits in triton_ops.SPLIT_K_CHOICES:
                    triton_ops.paged_decode_attention_split_k(*batch.args(),
                                                              num_splits=num_splits)
            slots = torch.arange(sum(query_lens), device=DEVICE)
            key = batch.query[:, :num_kv_heads]
            triton_ops.write_kv_cache(key.contiguous(), key.contiguous(), batch.kv_cache, slots)
        triton_ops.copy_blocks(batch.kv_cache, torch.tensor([[1, 2], [3, 4]], device=DEVICE))

    assert launch_variants(run_steps) <= warmed


def test_no_silent_fallback_when_triton_cannot_load(monkeypatch):
    """On CUDA the Triton kernels or a clear error, naming the torch path as a choice."""
    import sys as _sys

    import kernels
    from kernels import get_kernel_ops
    monkeypatch.setitem(_sys.modules, "kernels.triton_ops", None)  # import fails
    # ... even where this process imported it already (the package holds it as an attribute).
    monkeypatch.delattr(kernels, "triton_ops", raising=False)
    with pytest.raises(RuntimeError, match="kernel_backend='torch'"):
        get_kernel_ops("cuda")
    assert get_kernel_ops("cuda", "torch").name == "torch"


def test_each_backend_describes_its_optional_parts():
    """get_kernel_ops hands out the backend's own descriptor; what a backend lacks is None."""
    from kernels import KernelOps, get_kernel_ops, torch_paged

    torch_ops = get_kernel_ops("cpu", "torch")
    assert torch_ops is torch_paged.KERNEL_OPS
    assert torch_ops.plan_attention is torch_paged.plan_attention
    assert torch_ops.warm_up is None and not torch_ops.takes_host_lengths
    naive_ops = get_kernel_ops("cpu", "naive")
    assert naive_ops.paged_attention is naive.paged_attention
    assert naive_ops.plan_attention is None and naive_ops.warm_up is None
    if triton_ops is not None:
        triton = get_kernel_ops("cpu", "triton")
        assert triton.takes_host_lengths and triton.warm_up is triton_ops.warm_up
        assert triton.plan_attention is None
    parts = [naive.write_kv_cache, naive.paged_attention, naive.copy_blocks, naive.swap_blocks]
    with pytest.raises(ValueError) as error:
        KernelOps("mine", *parts[:3], "swap")
    assert str(error.value) == "kernel backend mine: swap_blocks is not callable, got str"
    with pytest.raises(ValueError, match="^kernel backend mine: warm_up is not callable"):
        KernelOps("mine", *parts, warm_up=True)


@needs_triton
def test_gqa_4_and_odd_head_dim():
    """A group of 4 query heads per KV head and a head_dim that is no power of two."""
    for workload in ("decode", "chunked_prefill"):
        batch = make_batch(*WORKLOADS[workload], block_size=4, heads_per_kv_head=4,
                           head_dim=24, dtype=torch.float16, seed=7)
        expected = naive.paged_attention(*batch.args())
        assert_close(triton_ops.paged_attention(*batch.args()), expected, torch.float16)


# ---------------------------------------------------------------------------------------------
# Cache writes, block copies, swaps


def cache_op_impls():
    return [pytest.param("triton", id="triton", marks=needs_triton),
            pytest.param("reference", id="reference")]


def cache_op_module(name):
    return triton_ops if name == "triton" else reference_module()


@pytest.mark.parametrize("impl", cache_op_impls())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_write_kv_cache(impl, dtype, block_size):
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim, num_tokens = 12, 2, 16, 9
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    key, value = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) for _ in "kv")
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    args = [t.to(DEVICE, dtype) for t in (key, value, kv_cache)] + [slots.to(DEVICE)]
    expected = args[2].clone()
    naive.write_kv_cache(args[0], args[1], expected, args[3])
    cache_op_module(impl).write_kv_cache(*args)
    assert torch.equal(args[2], expected)


@needs_triton
def test_write_kv_cache_skips_padding_slots():
    kv_cache = torch.zeros(2, 3, 4, 2, 16, device=DEVICE)
    key = torch.ones(3, 2, 16, device=DEVICE)
    slots = torch.tensor([-1, 5, -1], device=DEVICE)
    triton_ops.write_kv_cache(key, 2 * key, kv_cache, slots)
    assert kv_cache[0, 1, 1].eq(1).all() and kv_cache[1, 1, 1].eq(2).all()
    assert int(kv_cache.ne(0).sum()) == 2 * 2 * 16


@pytest.mark.parametrize("impl", cache_op_impls())
def test_copy_blocks(impl):
    gen = torch.Generator().manual_seed(1)
    kv_cache = torch.randn(2, 10, 16, 2, 32, generator=gen).to(DEVICE)
    pairs = torch.tensor([[3, 7], [0, 1], [3, 9]], device=DEVICE)  # one source, two copies
    expected = kv_cache.clone()
    naive.copy_blocks(expected, pairs)
    cache_op_module(impl).copy_blocks(kv_cache, pairs)
    assert torch.equal(kv_cache, expected)


@pytest.mark.parametrize("impl", cache_op_impls())
def test_swap_blocks_both_ways(impl):
    gen = torch.Generator().manual_seed(2)
    device_cache = torch.randn(2, 6, 4, 2, 16, generator=gen).to(DEVICE)
    host_cache = torch.randn(2, 5, 4, 2, 16, generator=gen)
    out_pairs, in_pairs = torch.tensor([[5, 0], [2, 3]]), torch.tensor([[0, 1], [4, 4]])
    for src, dst, pairs in ((device_cache, host_cache, out_pairs),
                            (host_cache, device_cache, in_pairs)):
        expected = dst.clone()
        naive.swap_blocks(src, expected, pairs)
        cache_op_module(impl).swap_blocks(src, dst, pairs)
        assert torch.equal(dst, expected)


# ---------------------------------------------------------------------------------------------
# One engine-shaped sequence of steps: chunked prefill, then decode, through the kernels' own
# cache writes, against dense attention over the unpaged K/V.


@needs_triton
def test_engine_steps_write_then_attend():
    gen = torch.Generator().manual_seed(3)
    block_size, num_kv_heads, num_heads, head_dim = 4, 2, 4, 16
    prompt_lens, chunk = [11, 6], 8
    kv_cache = torch.full((2, 12, block_size, num_kv_heads, head_dim), float("nan"),
                          device=DEVICE)
    block_tables = torch.tensor([[5, 2, 9, 7, 0], [1, 11, 4, 0, 0]], dtype=torch.int32,
                                device=DEVICE)
    total = [14, 10]  # both finish in five steps: 2 + 3 and 1 + 4 (chunks + decodes)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in total]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in total]
    queries = [torch.randn(n, num_heads, head_dim, generator=gen) for n in total]
    done = [0, 0]
    while done != total:
        # This step's new positions per sequence: a chunk of the prompt, or one decoded token.
        steps = [range(d, min(d + chunk, p) if d < p else min(d + 1, t))
                 for d, p, t in zip(done, prompt_lens, total)]
        positions = [list(s) for s in steps]
        slots = [int(block_tables[b, i // block_size]) * block_size + i % block_size
                 for b, ps in enumerate(positions) for i in ps]
        key = torch.cat([keys[b][ps] for b, ps in enumerate(positions)]).to(DEVICE)
        value = torch.cat([values[b][ps] for b, ps in enumerate(positions)]).to(DEVICE)
        query = torch.cat([queries[b][ps] for b, ps in enumerate(positions)]).to(DEVICE)
        triton_ops.write_kv_cache(key, value, kv_cache, torch.tensor(slots, device=DEVICE))
        done = [ps[-1] + 1 for ps in positions]
        query_lens = torch.tensor([len(ps) for ps in positions])
        query_start_loc = torch.cat([torch.zeros(1), query_lens.cumsum(0)]).to(DEVICE, torch.int32)
        seq_lens = torch.tensor(done, dtype=torch.int32, device=DEVICE)
        out = triton_ops.paged_attention(query, kv_cache, block_tables, seq_lens,
                                         query_start_loc, head_dim ** -0.5)
        batch = Batch(query, kv_cache, block_tables, seq_lens, query_start_loc, head_dim ** -0.5)
        assert_close(out, dense_attention(batch), torch.float32)


# ---------------------------------------------------------------------------------------------
# When this worker imported triton before the interpreter could be chosen


def test_triton_kernels_in_a_fresh_process():
    if TRITON_SKIP_REASON is None:
        pytest.skip("the Triton tests ran in this process")
    if triton_ops is None:
        pytest.skip(TRITON_SKIP_REASON)
    # The compile check runs here already; the GPU shapes skip there as here.
    run_pytest_under_interpreter(__file__, "-k", "not fresh_process and not compile and not "
                                 "llama2_7b_shapes")


# ---------------------------------------------------------------------------------------------
# What the interpreter cannot tell: that the kernels compile for a real GPU, unspilled.


def test_kernels_compile_for_sm90_without_register_spills():
    """Compiles every launch the launchers make at Llama shapes for sm_90 (Triton's bundled
    ptxas, no GPU needed) in a fresh process, where triton is imported to compile."""
    if triton_ops is None:
        pytest.skip(TRITON_SKIP_REASON)
    result = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--compile"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "_paged_prefill_kernel" in result.stdout


# ---------------------------------------------------------------------------------------------
# Real sizes on a GPU: Llama-2-7B (32 heads, head_dim 128, block 16), bf16, contexts up to 4k.


@needs_cuda
@needs_triton
@pytest.mark.parametrize("workload", ["decode", "decode_long", "chunked_prefill"])
def test_llama2_7b_shapes_bf16(workload):
    query_lens, cached_lens = {
        "decode": ([1] * 16, [37, 500, 1000, 4000] * 4),
        "decode_long": ([1] * 2, [4095, 3000]),
        "chunked_prefill": ([512, 1, 300], [1024, 2000, 0]),
    }[workload]
    batch = make_batch(query_lens, cached_lens, block_size=16, heads_per_kv_head=1,
                       num_kv_heads=32, head_dim=128, dtype=torch.bfloat16, seed=0)
    expected = dense_attention(batch)
    outputs = {"dispatch": triton_ops.paged_attention(*batch.args())}
    if workload.startswith("decode"):
        outputs["split_k"] = triton_ops.paged_decode_attention_split_k(*batch.args(), num_splits=8)
        outputs["decode"] = triton_ops.paged_decode_attention(*batch.args())
    for name, out in outputs.items():
        error = (out.float() - expected.float()).norm() / expected.float().norm()
        assert error < 1e-2, f"{name}: relative error {error:.2e}"


# ---------------------------------------------------------------------------------------------
# Tree attention: a sequence's last token and a tree of speculative tokens after it, each node
# seeing the context and its own ancestors only (kernels/__init__.py's tree_mask).

# Per sequence: (cached tokens, parents of the tree's nodes; -1 is the root, the last token).
# None: an ordinary query of that many tokens (all entries -1).
TREE_SEQS = [
    (13, [-1, -1, 0, 0, 1, 2, 5, -1, 7]),          # bushy, depth 4
    (30, [-1, 0, 1, 2, 3, 4]),                     # a chain: plain speculative decoding
    (2, [-1]),
    (6, None),                                     # a prefill chunk of 6 tokens in the same step
    (21, [-1, 0, -1, 2, 0, 4, 5, 6, 3, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]),  # 20 nodes
]


def tree_ancestors(parents):
    """Per node, the set of nodes it sees: itself and its ancestors."""
    seen = []
    for node, parent in enumerate(parents):
        seen.append({node} | (seen[parent] if parent >= 0 else set()))
    return seen


def make_tree_batch(block_size, heads_per_kv_head, dtype, seed, poison=float("nan")):
    """TREE_SEQS as a paged batch: each tree sequence runs its root and nodes (1 + len(parents)
    query tokens after its cached ones); returns the batch, the tree_mask and a dense [token,
    position] visibility built from the ancestor sets directly."""
    from kernels import tree_mask_entry

    query_lens = [6 if parents is None else 1 + len(parents) for _, parents in TREE_SEQS]
    cached_lens = [cached for cached, _ in TREE_SEQS]
    batch = make_batch(query_lens, cached_lens, block_size=block_size,
                       heads_per_kv_head=heads_per_kv_head, dtype=dtype, seed=seed,
                       poison=poison)
    entries, visible_rows = [], []
    for (cached, parents), query_len in zip(TREE_SEQS, query_lens):
        seq_len = cached + query_len
        for j in range(query_len):
            position = cached + j
            row = torch.arange(seq_len) <= position
            if parents is None or j == 0:
                entries.append(-1)
            else:
                node = j - 1
                seen = tree_ancestors(parents)[node]
                hidden = [node - other for other in range(node) if other not in seen]
                entries.append(tree_mask_entry(hidden))
                row[cached + 1:] = False
                row[[cached + 1 + other for other in seen]] = True
            visible_rows.append(row)
    tree_mask = torch.tensor(entries, dtype=torch.int64, device=batch.query.device)
    return batch, tree_mask, visible_rows


def dense_tree_attention(batch, visible_rows):
    """fp32 attention of each token over exactly the positions its row marks, K/V gathered by
    whole blocks: independent of the oracle's bit arithmetic."""
    kv_cache = batch.kv_cache
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    heads_per_kv_head = batch.query.shape[1] // num_kv_heads
    out = torch.empty_like(batch.query)
    starts = batch.query_start_loc.tolist()
    for seq, seq_len in enumerate(batch.seq_lens.tolist()):
        blocks = batch.block_tables[seq, : -(-seq_len // block_size)].long()
        k, v = (kv_cache[i, blocks].flatten(0, 1)[:seq_len].float().cpu() for i in (0, 1))
        k, v = (t.repeat_interleave(heads_per_kv_head, dim=1).transpose(0, 1) for t in (k, v))
        for token in range(starts[seq], starts[seq + 1]):
            q = batch.query[token].float().cpu()[:, None]                     # [heads, 1, dim]
            attended = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=visible_rows[token][None], scale=batch.scale)
            out[token] = attended[:, 0].to(out.dtype)
    return out


def test_tree_mask_entry():
    from kernels import tree_mask_entry

    assert tree_mask_entry([]) == -1
    assert tree_mask_entry([1]) == -3
    assert tree_mask_entry([63]) == 2 ** 63 - 1   # bit 63 cleared: the largest int64
    with pytest.raises(ValueError, match="hides positions 1..63"):
        tree_mask_entry([64])


@pytest.mark.parametrize("block_size", [1, 4])
def test_naive_tree_attention_matches_dense(block_size):
    batch, tree_mask, visible_rows = make_tree_batch(block_size, 2, torch.float32, seed=11,
                                                     poison=1e3)
    batch = Batch(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in batch.args()))
    expected = dense_tree_attention(batch, visible_rows)
    assert_close(naive.paged_attention(*batch.args(), tree_mask=tree_mask.cpu()), expected,
                 torch.float32)
    # The mask matters: without it the tree's nodes see their siblings.
    assert not torch.allclose(naive.paged_attention(*batch.args()), expected)


def triton_tree(*args, tree_mask):
    return triton_ops.paged_prefill_attention(*args, tree_mask, block_m=16, block_n=16)


def reference_tree(*args, tree_mask):
    return reference_module().paged_attention(*args, tree_mask=tree_mask)


def planned_reference_tree(*args, tree_mask):
    """The engine's way: the mask folded into the step's plan once, shared by the layers."""
    torch_paged = reference_module()
    plan = torch_paged.plan_attention(*args[2:5], args[1], tree_mask)
    return torch_paged.paged_attention(*args, plan=plan)


@pytest.mark.parametrize("attention", [
    pytest.param(triton_tree, id="triton_prefill", marks=needs_triton),
    pytest.param(lambda *args, tree_mask: triton_ops.paged_attention(*args, tree_mask),
                 id="triton_dispatch", marks=needs_triton),
    pytest.param(reference_tree, id="reference"),
    pytest.param(planned_reference_tree, id="reference_planned")])
@pytest.mark.parametrize("block_size, heads_per_kv_head, dtype",
                         [(1, 2, torch.float32), (4, 1, torch.float16), (16, 2, torch.float32),
                          (3, 2, torch.float16)])
def test_tree_attention(attention, block_size, heads_per_kv_head, dtype):
    """Trees whose nodes span block boundaries (block sizes 1, 3, 4, 16 against contexts of 2 to
    30 tokens and trees of up to 20 nodes), beside a plain prefill chunk in the same call."""
    is_reference = attention in (reference_tree, planned_reference_tree)
    batch, tree_mask, _ = make_tree_batch(block_size, heads_per_kv_head, dtype,
                                          seed=block_size * 10 + heads_per_kv_head,
                                          poison=1e3 if is_reference else float("nan"))
    out = attention(*batch.args(), tree_mask=tree_mask)
    assert out.shape == batch.query.shape and out.dtype == dtype
    expected = naive.paged_attention(*(t.cpu() if isinstance(t, torch.Tensor) else t
                                       for t in batch.args()), tree_mask=tree_mask.cpu())
    assert_close(out.cpu(), expected, dtype)
