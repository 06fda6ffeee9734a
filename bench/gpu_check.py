"""Kernel check for a lent GPU: correctness of the Triton kernels at Llama-2-7B shapes in bf16
against the loop oracle (kernels/naive.py), and the decode kernels' achieved bandwidth (bytes of
K/V read / time) against the device's own copy bandwidth. Prints a table last.

    python bench/gpu_check.py            # on a CUDA machine (bench/gpu_check.sh runs it)
    python bench/gpu_check.py --smoke    # the same steps at tiny sizes, on CPU, through
                                         # Triton's interpreter: checks this script, not speed
    python bench/gpu_check.py --compile  # no GPU needed: compile every kernel the launchers
                                         # launch at Llama shapes for sm_90, print registers and
                                         # spills (what the interpreter cannot tell)

Exit status 1 if a kernel disagrees with the oracle, 0 otherwise (and when there is no GPU).
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BF16_REL_TOLERANCE = 1e-2  # ||out - ref|| / ||ref||: bf16 operands land between 1e-3 and 1e-2


@dataclass(frozen=True)
class Shapes:
    """Model shapes and the batches each check uses: (query_lens, cached_lens) per workload,
    (num_seqs, context_len) per bandwidth case."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    decode: tuple
    chunked_prefill: tuple
    bandwidth_cases: tuple
    split_k_case: tuple
    prefill_case: tuple
    copy_bytes: int


LLAMA2_7B = Shapes(
    num_heads=32, num_kv_heads=32, head_dim=128, block_size=16, dtype=torch.bfloat16,
    decode=([1] * 8, [36, 499, 999, 3999, 15, 2047, 2999, 4095]),
    chunked_prefill=([512, 1, 300, 64], [1024, 2000, 0, 3000]),
    bandwidth_cases=((64, 2048), (256, 512), (16, 4096)),
    split_k_case=(2, 4096),
    prefill_case=(4, 1024),
    copy_bytes=2 << 30,
)
TINY = Shapes(
    num_heads=4, num_kv_heads=2, head_dim=32, block_size=4, dtype=torch.float16,
    decode=([1] * 3, [3, 17, 40]), chunked_prefill=([9, 1, 5], [4, 20, 0]),
    bandwidth_cases=((4, 32),), split_k_case=(2, 64), prefill_case=(2, 16), copy_bytes=1 << 20,
)


# ---------------------------------------------------------------------------------------------
# Inputs


def make_batch(shapes: Shapes, query_lens, cached_lens, device, seed=0):
    """A paged batch whose blocks come from a shuffled pool. Block 0 pads the tables; it and
    the unused tail of each last block are NaN, so a read outside a context shows."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bs = shapes.block_size
    seq_lens = [c + q for c, q in zip(cached_lens, query_lens)]
    blocks_per_seq = [-(-n // bs) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq)
    kv_cache = torch.randn(2, num_blocks, bs, shapes.num_kv_heads, shapes.head_dim,
                           generator=gen, device=device, dtype=shapes.dtype)
    kv_cache[:, 0] = float("nan")
    pool = 1 + torch.randperm(num_blocks - 1, generator=gen, device=device)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32,
                               device=device)
    first = 0
    for seq, (seq_len, num) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[seq, :num] = pool[first: first + num]
        kv_cache[:, int(pool[first + num - 1]), seq_len - (num - 1) * bs:] = float("nan")
        first += num
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    query = torch.randn(sum(query_lens), shapes.num_heads, shapes.head_dim, generator=gen,
                        device=device, dtype=shapes.dtype)
    return (query, kv_cache, block_tables,
            torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc.to(device), shapes.head_dim ** -0.5)


def kv_bytes_read(shapes: Shapes, total_context_tokens: int) -> int:
    element = torch.tensor([], dtype=shapes.dtype).element_size()
    return 2 * total_context_tokens * shapes.num_kv_heads * shapes.head_dim * element


# ---------------------------------------------------------------------------------------------
# Timing


def median_seconds(fn, device) -> float:
    """Median time of fn(): device events through triton's do_bench on CUDA, wall clock else."""
    if device.type == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(shapes: Shapes, device) -> float:
    """Bytes read plus bytes written per second by one large device-to-device copy."""
    src = torch.empty(shapes.copy_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device)
    return 2 * shapes.copy_bytes / seconds


# ---------------------------------------------------------------------------------------------
# Checks


def relative_error(out, expected) -> float:
    out, expected = out.float(), expected.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - expected).norm() / expected.norm())


def check_correctness(shapes: Shapes, device, triton_ops, naive):
    """Rows (name, relative error or 'exact'/'MISMATCH', ok)."""
    rows = []
    decode = make_batch(shapes, *shapes.decode, device, seed=1)
    expected = naive.paged_attention(*decode)
    num_splits = 8
    for name, out in [
        ("decode", triton_ops.paged_decode_attention(*decode)),
        (f"decode split-K ({num_splits} splits)",
         triton_ops.paged_decode_attention_split_k(*decode, num_splits=num_splits)),
        ("decode via dispatcher", triton_ops.paged_attention(*decode)),
        ("prefill kernel on decode", triton_ops.paged_prefill_attention(*decode)),
    ]:
        error = relative_error(out, expected)
        rows.append((name, f"{error:.1e}", error < BF16_REL_TOLERANCE))

    chunked = make_batch(shapes, *shapes.chunked_prefill, device, seed=2)
    error = relative_error(triton_ops.paged_attention(*chunked), naive.paged_attention(*chunked))
    rows.append(("chunked prefill", f"{error:.1e}", error < BF16_REL_TOLERANCE))

    gen = torch.Generator(device=device).manual_seed(3)
    num_blocks = 64
    num_tokens = num_blocks * shapes.block_size // 2
    kv_cache = torch.randn(2, num_blocks, shapes.block_size, shapes.num_kv_heads,
                           shapes.head_dim, generator=gen, device=device, dtype=shapes.dtype)
    key, value = (torch.randn(num_tokens, shapes.num_kv_heads, shapes.head_dim, generator=gen,
                              device=device, dtype=shapes.dtype) for _ in "kv")
    slots = torch.randperm(num_blocks * shapes.block_size, generator=gen,
                           device=device)[:num_tokens]
    slots[::7] = -1  # padding tokens
    expected_cache = kv_cache.clone()
    naive.write_kv_cache(key, value, expected_cache, slots)
    triton_ops.write_kv_cache(key, value, kv_cache, slots)
    same = torch.equal(kv_cache, expected_cache)
    rows.append(("write_kv_cache", "exact" if same else "MISMATCH", same))

    pairs = torch.stack([torch.arange(0, 20), torch.arange(30, 50)], dim=1).to(device)
    naive.copy_blocks(expected_cache, pairs)
    triton_ops.copy_blocks(kv_cache, pairs)
    same = torch.equal(kv_cache, expected_cache)
    rows.append(("copy_blocks", "exact" if same else "MISMATCH", same))
    return rows


def decode_bandwidth(shapes: Shapes, device, triton_ops, torch_paged, copy_rate):
    """Rows (case, ms, GB/s of K/V read, % of copy bandwidth)."""
    rows = []

    def measure(label, fn, batch):
        seconds = median_seconds(lambda: fn(*batch), device)
        rate = kv_bytes_read(shapes, int(batch[3].sum())) / seconds
        rows.append((label, seconds * 1e3, rate / 1e9, 100 * rate / copy_rate))

    for num_seqs, context in shapes.bandwidth_cases:
        batch = make_batch(shapes, [1] * num_seqs, [context - 1] * num_seqs, device)
        measure(f"decode {num_seqs} seqs x {context}", triton_ops.paged_decode_attention, batch)
        if torch_paged is not None:
            measure("  torch kernels, same", torch_paged.paged_attention, batch)
        del batch
    num_seqs, context = shapes.split_k_case
    batch = make_batch(shapes, [1] * num_seqs, [context - 1] * num_seqs, device)
    measure(f"decode {num_seqs} seqs x {context}, no split",
            triton_ops.paged_decode_attention, batch)
    chosen = triton_ops.choose_num_splits(num_seqs, shapes.num_kv_heads, context, device)
    for num_splits in sorted({4, 16, chosen}):
        def split_k(*args, n=num_splits):
            return triton_ops.paged_decode_attention_split_k(*args, num_splits=n)
        chosen_note = " (dispatcher's choice)" if num_splits == chosen else ""
        measure(f"  split-K, {num_splits} splits{chosen_note}", split_k, batch)
    return rows


def prefill_rate(shapes: Shapes, device, triton_ops):
    """(case, ms, TFLOP/s) of a causal prefill of num_seqs prompts of prompt_len tokens."""
    num_seqs, prompt_len = shapes.prefill_case
    batch = make_batch(shapes, [prompt_len] * num_seqs, [0] * num_seqs, device)
    seconds = median_seconds(lambda: triton_ops.paged_attention(*batch), device)
    # QK^T and PV, 2 flops per multiply-add, over the causal half of the square.
    flops = 4 * num_seqs * shapes.num_heads * shapes.head_dim * prompt_len * (prompt_len + 1) / 2
    return f"prefill {num_seqs} x {prompt_len} tokens", seconds * 1e3, flops / seconds / 1e12


# ---------------------------------------------------------------------------------------------
# Compile-only check (no GPU): what the interpreter cannot tell


def compile_report(arch: int = 90) -> int:
    """Run the launchers at Llama-2-7B (MHA) and Llama-3-8B (GQA 4) shapes with their kernel
    launches captured instead of run, compile each launch for sm_{arch} with the specialisation
    a real launch gets (16-byte aligned pointers, ints divisible by 16, ints equal to 1), and
    print registers, spills (stack) and shared memory. Written against Triton 3.9's internals."""
    import os
    import re
    import subprocess
    import tempfile
    os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (before triton's import)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from kernels import triton_ops

    launches = []
    original_run = JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append(
        (self, args, kwargs))
    triton_ops.UNAVAILABLE_REASON = None  # the launchers only prepare arguments here
    try:
        for heads, kv_heads in ((32, 32), (32, 8)):
            for dtype in (torch.bfloat16, torch.float32):
                shapes = Shapes(heads, kv_heads, 128, 16, dtype, (), (), (), (), (), 0)
                decode = make_batch(shapes, [1, 1], [30, 40], torch.device("cpu"))
                triton_ops.paged_decode_attention(*decode)
                triton_ops.paged_decode_attention_split_k(*decode, num_splits=8)
                triton_ops.paged_prefill_attention(*make_batch(shapes, [100, 3], [130, 40],
                                                               torch.device("cpu")))
                triton_ops.paged_prefill_attention(*make_batch(shapes, [100, 3], [130, 40],
                                                               torch.device("cpu")),
                                                   torch.full((103,), -1))   # a tree mask
                kv_cache = decode[1]
                key = torch.empty(5, kv_heads, 128, dtype=dtype)
                triton_ops.write_kv_cache(key, key, kv_cache, torch.zeros(5, dtype=torch.int64))
                triton_ops.copy_blocks(kv_cache, torch.tensor([[1, 2]]))
    finally:
        JITFunction.run = original_run

    type_names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                  torch.int32: "i32", torch.int64: "i64"}
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    seen, worst_stack = set(), 0
    print(f"| kernel (sm_{arch}) | constexprs | warps | registers | spill stack | shared |")
    print("|---|---|---|---|---|---|")
    for fn, args, kwargs in launches:
        kwargs = dict(kwargs)
        options = {"num_warps": kwargs.pop("num_warps", 4)}
        values = dict(zip(fn.arg_names, args), **kwargs)
        signature, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(fn.arg_names):
            value = values[name]
            if fn.params[i].is_constexpr or (type(value) is int and value == 1):
                signature[name], constexprs[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + type_names[value.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, int):
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            else:
                signature[name] = "fp32"
        key = (fn.__name__, str(constexprs), str(signature), options["num_warps"])
        if key in seen:
            continue
        seen.add(key)
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", arch, 32), options=options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(compiled.asm["cubin"])
            cubin.flush()
            usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", cubin.name],
                                   capture_output=True, text=True).stdout
        registers = re.search(r"REG:(\d+)", usage).group(1)
        stack = int(re.search(r"STACK:(\d+)", usage).group(1))
        worst_stack = max(worst_stack, stack)
        shown = {k: v for k, v in constexprs.items() if k.isupper() or k == "heads_per_kv_head"}
        print(f"| {fn.__name__} | {shown} | {options['num_warps']} | {registers} | {stack} | "
              f"{compiled.metadata.shared} |", flush=True)
    return 0 if worst_stack == 0 else 1


# ---------------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on CPU through Triton's interpreter (checks the script)")
    parser.add_argument("--compile", action="store_true",
                        help="no GPU: compile the kernels for sm_90 and report registers/spills")
    args = parser.parse_args()
    if args.compile:
        return compile_report()
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (use --smoke to exercise the "
              "script on CPU)")
        return 0
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = TINY if args.smoke else LLAMA2_7B

    from kernels import naive, triton_ops  # before triton: it picks the interpreter on CPU
    try:
        from kernels import torch_paged
    except ImportError:
        torch_paged = None
    torch.manual_seed(0)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    started = time.perf_counter()
    correctness = check_correctness(shapes, device, triton_ops, naive)
    copy_rate = copy_bandwidth(shapes, device)
    bandwidth = decode_bandwidth(shapes, device, triton_ops, torch_paged, copy_rate)
    prefill = prefill_rate(shapes, device, triton_ops)
    elapsed = time.perf_counter() - started

    shape_line = (f"{shapes.num_heads} heads / {shapes.num_kv_heads} KV heads, head_dim "
                  f"{shapes.head_dim}, block {shapes.block_size}, {str(shapes.dtype)[6:]}")
    print(f"\n## twinserve kernel check — {name}, {datetime.date.today()}, torch "
          f"{torch.__version__}, triton {triton_ops.triton.__version__} ({elapsed:.0f} s)")
    print(f"shapes: {shape_line}\n")
    print("| correctness vs kernels/naive.py | rel. error | ok |\n|---|---|---|")
    for label, value, ok in correctness:
        print(f"| {label} | {value} | {'yes' if ok else 'NO'} |")
    print(f"\ndevice copy bandwidth (read + write): {copy_rate / 1e9:.0f} GB/s\n")
    print("| decode case | ms | GB/s of K/V read | % of copy |\n|---|---|---|---|")
    for label, ms, gbs, percent in bandwidth:
        print(f"| {label} | {ms:.3f} | {gbs:.0f} | {percent:.0f}% |")
    label, ms, tflops = prefill
    print("\n| prefill case | ms | TFLOP/s |\n|---|---|---|")
    print(f"| {label} | {ms:.3f} | {tflops:.1f} |")
    return 0 if all(ok for _, _, ok in correctness) else 1


if __name__ == "__main__":
    sys.exit(main())
