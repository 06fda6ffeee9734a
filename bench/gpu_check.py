"""The check for a lent GPU, in one command (bash bench/gpu_check.sh runs it): the environment,
every kernel configuration the engine runs against the loop oracle (kernels/naive.py), the
engine's greedy outputs against HF generate on the Triton kernels, decode bandwidth against the
device's copy bandwidth, engine throughput against HF generate, and a profile plus a small
validation grid on the GPU (the GPU fidelity table). Each step runs in its own process under its
own time budget and streams its rows as it goes; the results go to one JSON file, rewritten
after every step, so a hung step loses nothing before it.

    python bench/gpu_check.py [--out DIR]   # every step (DIR/gpu_check.json; default gpu_check_out)
    python bench/gpu_check.py --smoke       # the same steps at tiny sizes on CPU, Triton through
                                            # its interpreter: checks this script, not the GPU
    python bench/gpu_check.py --compile     # no GPU needed: compile every kernel variant the
                                            # engine's warm-up compiles, for sm_90; registers
                                            # and spills (what the interpreter cannot tell)
    python bench/gpu_check.py --step NAME   # one step in this process (what the driver runs)
    python bench/gpu_check.py --only NAME.. # some steps (for a rerun; never exits 0)

Exit status (EXIT_* below): 0 every step passed; 1 a check failed, or a step crashed, ran out
of its budget or could not run; 2 the environment cannot run the check (a GPU is there but
torch cannot use it, triton or a dependency is missing or the wrong version, TRITON_INTERPRET
is set): one line names what is missing and the command that installs it; 3 no GPU here,
nothing checked. --compile: 0 without spills, 1 with.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

EXIT_OK, EXIT_FAILED, EXIT_ENVIRONMENT, EXIT_NO_GPU = 0, 1, 2, 3
TOTAL_BUDGET_S = 540  # the whole check, on an H200: 9 minutes
# Relative error ||out - ref|| / ||ref|| allowed per dtype: bf16 operands land between 1e-3 and
# 1e-2; fp32 (exact dots) near 1e-6.
REL_TOLERANCE = {"bfloat16": 1e-2, "float32": 1e-4}
# The kernel configurations checked and compiled: (query heads per KV head, head_dim, dtype
# name); the engine runs bf16 (2-byte conf/model entries) and fp32 (tiny-llama).
GROUPS, HEAD_DIMS, DTYPES = (1, 2, 8), (64, 128), ("bfloat16", "float32")
KERNEL_MATRIX_NAMES = [(g, d, t) for t in DTYPES for g in GROUPS for d in HEAD_DIMS]
# bf16 greedy runs of two implementations may part at a near tie: the engine's token is
# accepted where HF's logit for it is within this of HF's top logit (bf16 keeps 8 bits of
# mantissa: logits of magnitude ~10 round in steps of ~0.06).
BF16_TIE_LOGIT_GAP = 0.125
DECODE_BANDWIDTH_GOAL = 0.85  # of the copy bandwidth, at long contexts


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: int          # on the GPU; --smoke gives each step SMOKE_BUDGET_S
    title: str


STEPS = (
    # Kernels: about 100 Triton compiles (12 configurations), the oracle on the host.
    Step("kernels", 150, "kernel configurations vs kernels/naive.py"),
    Step("engine", 90, "engine greedy outputs vs HF generate (Triton kernels)"),
    Step("bandwidth", 45, "decode attention bandwidth vs device copy bandwidth"),
    Step("throughput", 45, "engine output tok/s vs HF generate"),
    Step("fidelity", 170, "twinserve-profile + a small twinserve-validate grid on the device"),
)
SMOKE_BUDGET_S = 600
assert sum(step.budget_s for step in STEPS) + 30 <= TOTAL_BUDGET_S


class CheckFailed(Exception):
    """A step's check did not hold (the step records it and goes on to its next check)."""


# ---------------------------------------------------------------------------------------------
# The environment


def gpu_present() -> bool:
    """Whether nvidia-smi sees a GPU: the question before whether torch can use it."""
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0 and "GPU" in result.stdout


def pinned_requirement(package: str) -> str:
    """The project's requirement on `package`, as pyproject.toml writes it."""
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(rf'"({re.escape(package)}[<>=!~][^";]*)', text)
    return match.group(1) if match else package


def _version_tuple(text: str) -> tuple:
    return tuple(int(part) for part in re.findall(r"\d+", text.split("+")[0])[:3])


def satisfies(version: str, requirement: str) -> bool:
    """version against a requirement of >=, <, <=, == bounds (what pyproject.toml uses)."""
    for op, bound in re.findall(r"(>=|<=|==|<|>)\s*([\w.]+)", requirement):
        have, want = _version_tuple(version), _version_tuple(bound)
        if not {">=": have >= want, "<=": have <= want, "==": have == want,
                "<": have < want, ">": have > want}[op]:
            return False
    return True


INSTALL_HINT = ("bash bench/gpu_check.sh --install [--wheels DIR] (a venv with the CUDA build "
                "and the project; DIR: local wheels, for a machine without network)")


def environment_problem(smoke: bool) -> tuple[int, str] | None:
    """(exit status, one line) when this environment cannot run the check, else None."""
    if not smoke and not gpu_present():
        return EXIT_NO_GPU, "no GPU here, nothing checked (nvidia-smi finds none)"
    if not smoke and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return EXIT_ENVIRONMENT, ("TRITON_INTERPRET is set: the kernels would run in Triton's "
                                  "interpreter, not on the GPU; unset it (env -u "
                                  "TRITON_INTERPRET bash bench/gpu_check.sh)")
    try:
        import torch
    except ImportError as error:
        return EXIT_ENVIRONMENT, (f"torch does not import ({error}): install a CUDA build, "
                                  f"pip install torch --index-url "
                                  f"https://download.pytorch.org/whl/cu130, or {INSTALL_HINT}")
    if not smoke:
        if torch.version.cuda is None:
            return EXIT_ENVIRONMENT, (f"torch {torch.__version__} is a CPU build and cannot use "
                                      f"the GPU: pip install torch --index-url "
                                      f"https://download.pytorch.org/whl/cu130, or {INSTALL_HINT}")
        if not torch.cuda.is_available():
            return EXIT_ENVIRONMENT, (f"torch {torch.__version__} (CUDA {torch.version.cuda}) "
                                      f"cannot use the GPU nvidia-smi lists (driver too old for "
                                      f"this CUDA, or CUDA_VISIBLE_DEVICES hides it): install "
                                      f"the torch build for the driver's CUDA version, or "
                                      f"{INSTALL_HINT}")
    try:
        import triton
    except ImportError as error:
        return EXIT_ENVIRONMENT, (f"triton does not import ({error}): pip install triton "
                                  f"(it comes with a CUDA build of torch), or {INSTALL_HINT}")
    from importlib import metadata
    for package in ("transformers",):
        requirement = pinned_requirement(package)
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            version = None
        if version is None or not satisfies(version, requirement):
            found = f"{package} {version}" if version else f"no {package}"
            return EXIT_ENVIRONMENT, (f"{found}; the project needs {requirement}: pip install "
                                      f"'{requirement}', or {INSTALL_HINT}")
    missing = []
    for module, package in (("simpy", "simpy"), ("hydra", "hydra-core"),
                            ("omegaconf", "omegaconf"), ("numpy", "numpy"), ("tqdm", "tqdm"),
                            ("rich", "rich"), ("matplotlib", "matplotlib")):
        try:
            __import__(module)
        except ImportError:
            missing.append(package)
    if missing:
        return EXIT_ENVIRONMENT, (f"missing {', '.join(missing)}: pip install -e . (the "
                                  f"project's dependencies), or {INSTALL_HINT}")
    del triton
    return None


def environment_summary() -> dict:
    import torch
    import transformers
    import triton
    summary = {"python": sys.version.split()[0], "torch": torch.__version__,
               "cuda": torch.version.cuda, "triton": triton.__version__,
               "transformers": transformers.__version__}
    if torch.cuda.is_available():
        summary["device"] = torch.cuda.get_device_name(0)
        summary["device_memory_gib"] = round(
            torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    else:
        summary["device"] = "CPU (Triton interpreter)"
    return summary


# ---------------------------------------------------------------------------------------------
# What a step reports


class StepReport:
    """A step's rows, printed as they come (a table), kept for the JSON file."""

    def __init__(self):
        self.rows: list[dict] = []
        self.measurements: dict = {}

    def check(self, label: str, value: str, ok: bool, **data) -> None:
        print(f"| {label} | {value} | {'yes' if ok else 'NO'} |", flush=True)
        self.rows.append({"check": label, "value": value, "ok": bool(ok), **data})

    def measure(self, label: str, value: str, **data) -> None:
        print(f"| {label} | {value} | |", flush=True)
        self.rows.append({"measure": label, "value": value, **data})

    @property
    def ok(self) -> bool:
        return all(row.get("ok", True) for row in self.rows)


def relative_error(out, expected) -> float:
    out, expected = out.float().cpu(), expected.float().cpu()
    if not bool(out.isfinite().all()):
        return float("inf")
    return float((out - expected).norm() / expected.norm().clamp_min(1e-30))


def dtype_of(name: str):
    import torch
    return getattr(torch, name)


def make_batch(query_lens, cached_lens, *, num_kv_heads, heads_per_kv_head, head_dim,
               block_size, dtype, device, seed=0):
    """A paged batch whose blocks come from a shuffled pool. Block 0 pads the tables; it and
    the unused tail of each last block are NaN, so a read outside a context shows. Returns the
    paged_attention arguments."""
    import torch
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(cached_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(blocks_per_seq)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    kv_cache[:, 0] = float("nan")
    pool = 1 + torch.randperm(num_blocks - 1, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    first = 0
    for seq, (seq_len, num) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[seq, :num] = pool[first: first + num]
        kv_cache[:, int(pool[first + num - 1]), seq_len - (num - 1) * block_size:] = float("nan")
        first += num
    query_start_loc = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    query = torch.randn(sum(query_lens), num_kv_heads * heads_per_kv_head, head_dim,
                        generator=gen)
    return (query.to(device, dtype), kv_cache.to(device, dtype), block_tables.to(device),
            torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc.to(device), head_dim ** -0.5)


def to_cpu(args):
    return tuple(a.cpu() if hasattr(a, "cpu") else a for a in args)


# ---------------------------------------------------------------------------------------------
# Step: every kernel configuration against the oracle


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
    matrix = KERNEL_MATRIX_NAMES if not smoke else [(g, 32, t) for g in GROUPS
                                                    for t in DTYPES]
    for heads_per_kv_head, head_dim, dtype_name in matrix:
        dtype = dtype_of(dtype_name)
        tolerance = REL_TOLERANCE[dtype_name]
        short_dtype = {"bfloat16": "bf16", "float32": "fp32"}[dtype_name]
        config = f"{short_dtype}, {heads_per_kv_head} q/kv heads, d{head_dim}"
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


# ---------------------------------------------------------------------------------------------
# Step: the engine on the Triton kernels against HF generate


ENGINE_PROMPT_LENS = [1, 7, 16, 17, 33, 64, 100]  # tests/test_engine.py's
ENGINE_MAX_TOKENS = 16


def hf_greedy(model, prompts, max_tokens, device):
    """HF generate, one unpadded prompt at a time, with the model's own sdpa attention."""
    import torch

    from engine.attention import PAGED_ATTENTION
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            return [model.generate(torch.tensor([p], device=device), max_new_tokens=max_tokens,
                                   min_new_tokens=max_tokens, do_sample=False,
                                   pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    finally:
        model.set_attn_implementation(PAGED_ATTENTION)


def near_tie_gap(model, prompt, shared, engine_token, hf_token, device) -> float:
    """HF's logit of its own next token minus that of the engine's, after prompt + shared."""
    import torch

    from engine.attention import PAGED_ATTENTION
    model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + shared], device=device)).logits[0, -1].float()
    finally:
        model.set_attn_implementation(PAGED_ATTENTION)
    return float(logits[hf_token] - logits[engine_token])


def compare_greedy(report, label, llm, prompts, expected, device, tie_gap=None,
                   **stats_checks) -> None:
    """The engine's greedy outputs against `expected`; with tie_gap, a divergence at a near tie
    (HF's logits of the two tokens within tie_gap) passes and is reported as such. On CUDA the
    engine's decode steps must have replayed CUDA graphs unless it was built enforce_eager."""
    from engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=ENGINE_MAX_TOKENS, ignore_eos=True)
    graphs = llm.executor.runner.decode_graphs
    replays_before = graphs.num_replays if graphs is not None else 0
    outputs = [out.outputs[0].token_ids for out in llm.generate(prompts, params,
                                                                use_tqdm=False)]
    backend = llm.executor.runner.ops.name
    replays = (graphs.num_replays if graphs is not None else 0) - replays_before
    steps = f"{replays} of {llm.last_stats.num_steps} steps as CUDA graphs"
    differing = [i for i, (a, b) in enumerate(zip(outputs, expected)) if a != b]
    value = f"identical ({len(prompts)} prompts), kernels: {backend}, {steps}"
    ok = not differing
    ties = []
    if differing and tie_gap is not None:
        for i in differing:
            a, b = outputs[i], expected[i]
            at = next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)
            gap = near_tie_gap(llm.model, prompts[i], b[:at], a[at], b[at], device)
            ties.append({"prompt": i, "position": at, "logit_gap": gap})
        ok = all(abs(tie["logit_gap"]) <= tie_gap for tie in ties)
        gaps = ", ".join(f"{tie['logit_gap']:.3f}" for tie in ties)
        value = (f"{len(differing)} prompt(s) part at a near tie (HF logit gaps {gaps} <= "
                 f"{tie_gap})" if ok else f"{len(differing)} prompt(s) differ: {ties}")
    elif differing:
        value = f"prompts {differing} differ"
    if device.type == "cuda" and not llm.config.enforce_eager and replays == 0:
        ok, value = False, f"{value}; but no decode step replayed a CUDA graph"
    if backend != "triton":
        ok, value = False, f"ran the {backend} kernels, not Triton"
    stats = llm.last_stats
    for name, wanted in stats_checks.items():
        if not getattr(stats, name) > 0:
            ok, value = False, f"{value}; but {name} = 0 (wanted {wanted})"
    report.check(label, value, ok, near_ties=ties, backend=backend, graph_replays=replays)


def step_engine(report: StepReport, smoke: bool) -> None:
    import torch

    from engine import LLM
    device = torch.device("cpu" if smoke else "cuda")
    gen = torch.Generator().manual_seed(1)
    lens = ENGINE_PROMPT_LENS[:4] if smoke else ENGINE_PROMPT_LENS
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lens]
    common = dict(device=str(device), kernel_backend="triton")
    for dtype, tie_gap in (("float32", None), ("bfloat16", BF16_TIE_LOGIT_GAP)):
        if smoke and dtype == "bfloat16":
            continue  # the interpreter's bf16 dots run in fp32: nothing more to see on CPU
        reference = LLM("tiny-llama", num_gpu_blocks=256, dtype=dtype, **common)
        expected = hf_greedy(reference.model, prompts, ENGINE_MAX_TOKENS, device)
        tag = f"tiny-llama {'fp32' if dtype == 'float32' else 'bf16'}"
        compare_greedy(report, f"{tag}, continuous", reference, prompts, expected, device,
                       tie_gap)
        if dtype != "float32":
            continue
        eager = LLM("tiny-llama", num_gpu_blocks=256, dtype=dtype, enforce_eager=True, **common)
        compare_greedy(report, f"{tag}, continuous, enforce_eager", eager, prompts, expected,
                       device)
        del eager
        # Pools of 36 blocks of 4 slots: the longest request alone needs 29, all of them 90.
        small_pool = dict(block_size=4, num_gpu_blocks=36 if not smoke else 12)
        cases = [
            ("chunked prefill", dict(scheduler="chunked_prefill", max_num_batched_tokens=24,
                                     num_gpu_blocks=256), {}),
            ("recompute preemption", dict(preemption="recompute", **small_pool),
             {"num_preemptions": "> 0"}),
            ("swap preemption", dict(preemption="swap", swap_space_gb=0.01, **small_pool),
             {"num_swapped_out_blocks": "> 0"}),
            ("prefix caching (second run)", dict(enable_prefix_caching=True,
                                                 num_gpu_blocks=256),
             {"num_cached_tokens": "> 0"}),
        ]
        for name, kwargs, stats_checks in cases:
            llm = LLM("tiny-llama", dtype=dtype, **common, **kwargs)
            if name.startswith("prefix caching"):
                llm.generate(prompts, use_tqdm=False)  # fills the prefix cache
            compare_greedy(report, f"{tag}, {name}", llm, prompts, expected, device,
                           **stats_checks)
            del llm
        del reference


# ---------------------------------------------------------------------------------------------
# Step: decode bandwidth


def median_seconds(fn, device) -> float:
    """Median time of fn(): device events through triton's do_bench on CUDA, wall clock else."""
    if device.type == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_bandwidth(report: StepReport, smoke: bool) -> None:
    """Decode attention's bytes of K/V read per second against one large device copy's bytes
    read and written per second, at Llama-2-7B (32/32 heads) and 70B-style (64/8) shapes."""
    import torch

    from kernels import triton_ops
    device = torch.device("cpu" if smoke else "cuda")
    copy_bytes = (1 << 20) if smoke else (2 << 30)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_rate = 2 * copy_bytes / median_seconds(lambda: dst.copy_(src), device)
    del src, dst
    report.measure("device copy bandwidth (read + write)", f"{copy_rate / 1e9:.0f} GB/s",
                   gb_per_s=copy_rate / 1e9)
    dtype = torch.bfloat16
    cases = [  # (label, num_kv_heads, heads_per_kv_head, num_seqs, context)
        ("7B", 32, 1, 64, 2048), ("7B", 32, 1, 256, 512), ("7B", 32, 1, 16, 4096),
        ("7B", 32, 1, 2, 4096), ("70B-style GQA 8", 8, 8, 64, 4096),
        ("70B-style GQA 8", 8, 8, 4, 8192)]
    if smoke:
        cases = [("tiny", 2, 1, 64, 32), ("tiny GQA 8", 2, 8, 2, 64)]
    for label, num_kv_heads, group, num_seqs, context in cases:
        batch = make_batch([1] * num_seqs, [context - 1] * num_seqs, num_kv_heads=num_kv_heads,
                           heads_per_kv_head=group, head_dim=128 if not smoke else 32,
                           block_size=16 if not smoke else 4, dtype=dtype, device=device)
        kv_bytes = 2 * num_seqs * context * num_kv_heads * batch[1].shape[4] * 2
        splits = triton_ops.choose_num_splits(num_seqs, num_kv_heads, context, device)
        seconds = median_seconds(lambda: triton_ops.paged_attention(
            *batch, max_query_len=1, max_seq_len=context), device)
        rate = kv_bytes / seconds
        share = rate / copy_rate
        report.measure(f"decode {label}, {num_seqs} seqs x {context}, {splits} split(s)",
                       f"{seconds * 1e3:.3f} ms, {rate / 1e9:.0f} GB/s, {share:.0%} of copy "
                       f"(goal {DECODE_BANDWIDTH_GOAL:.0%} at long contexts)",
                       ms=seconds * 1e3, gb_per_s=rate / 1e9, share_of_copy=share,
                       num_splits=splits)
        if splits == 1 and num_seqs == 64:
            # Other context tiles than decode_config's, for the next round of tuning.
            config = triton_ops.decode_config(group, batch[0].shape[2], dtype)
            for tile in sorted({16, 32, 64, 128} - {config.tile}):
                seconds = median_seconds(lambda: triton_ops.paged_decode_attention(
                    *batch, tile=tile), device)
                report.measure(f"  same, tile {tile} (default {config.tile})",
                               f"{kv_bytes / seconds / copy_rate:.0%} of copy",
                               tile=tile, share_of_copy=kv_bytes / seconds / copy_rate)
        del batch


# ---------------------------------------------------------------------------------------------
# Step: engine throughput


def step_throughput(report: StepReport, smoke: bool) -> None:
    """bench/engine_throughput.py's eval-style workload (tiny-llama, ragged prompts and
    outputs, greedy): the engine's output tok/s against HF generate's static batches."""
    import gc

    import torch
    sys.path.insert(0, str(REPO / "bench"))
    from engine_throughput import make_workload, run_engine, run_hf_generate

    from engine.model_loader import load_model
    device = "cpu" if smoke else "cuda"
    num_requests = 4 if smoke else 64
    hf_model = load_model("tiny-llama", torch.device(device)).model
    prompts, output_lens = make_workload(num_requests, hf_model.config.vocab_size, seed=0)
    if smoke:
        prompts, output_lens = [p[:16] for p in prompts], [min(n, 4) for n in output_lens]
    engine_s, engine_tokens = run_engine(prompts, output_lens, device, 16)
    gc.collect()
    hf_s, hf_tokens = run_hf_generate(hf_model, prompts, output_lens, 16, device)
    engine_rate, hf_rate = engine_tokens / engine_s, hf_tokens / hf_s
    report.measure(f"engine, {num_requests} requests", f"{engine_rate:,.0f} output tok/s",
                   tok_per_s=engine_rate)
    report.measure("HF generate (static batches of 16)", f"{hf_rate:,.0f} output tok/s",
                   tok_per_s=hf_rate)
    report.measure("engine / HF generate", f"{engine_rate / hf_rate:.2f}x",
                   ratio=engine_rate / hf_rate)


# ---------------------------------------------------------------------------------------------
# Step: the GPU fidelity table (profile, then a small validation grid)


def step_fidelity(report: StepReport, smoke: bool, out_dir: Path) -> None:
    """twinserve-profile on the device, then twinserve-validate over a small grid against that
    profile. The validation's gates are measurements here (the table is the result): the step
    fails only when a command errs or writes no table."""
    device = "cpu" if smoke else "cuda"
    profile_dir = out_dir / "profiles"
    profile_args = [sys.executable, "-m", "engine.profiler", "--device", device,
                    "--block-sizes", "16", "--repeats", "2" if smoke else "5",
                    "--speed-probe-interval", "0", "--out-dir", str(profile_dir),
                    "--no-progress"] + (["--quick", "--kernel-backend", "torch"] if smoke else [])
    print("$ " + " ".join(profile_args[1:]), flush=True)
    result = subprocess.run(profile_args, cwd=REPO)
    profiles = sorted(profile_dir.glob("*/tiny-llama.json"))
    report.check("twinserve-profile", f"exit {result.returncode}, "
                 f"{profiles[0].relative_to(out_dir) if profiles else 'no profile written'}",
                 result.returncode == 0 and bool(profiles))
    if not profiles:
        return
    grid_dir = out_dir / "validation"
    overrides = ["model=tiny-llama", "hardware=h200" if not smoke else "hardware=cpu",
                 "workload.with_token_ids=true", f"workload.num_requests={8 if smoke else 48}",
                 "++workload.prompt_len={dist: uniform, low: 16, high: 256}",
                 "++workload.output_len={dist: uniform, low: 8, high: 64}",
                 "kv_cache.num_blocks=128", "kv_cache.block_size=16",
                 "scheduler=continuous,chunked_prefill", "preemption=recompute,swap",
                 "workload.rate=8,inf" if not smoke else "workload.rate=inf"]
    if smoke:
        overrides[4:6] = ["++workload.prompt_len={dist: uniform, low: 4, high: 16}",
                          "++workload.output_len={dist: uniform, low: 2, high: 4}"]
    validate_args = [sys.executable, "-m", "sim.calibration.validate", "--out", str(grid_dir),
                     "--profile", str(profiles[0]), "--wall-clock", "--sim-runs", "2",
                     *overrides]
    print("$ " + " ".join(validate_args[1:]), flush=True)
    result = subprocess.run(validate_args, cwd=REPO)
    table = grid_dir / "grid.md"
    report.check("twinserve-validate grid", f"exit {result.returncode} "
                 f"({'gates met' if result.returncode == 0 else 'gates missed' if result.returncode == 1 else 'error'}), "
                 f"{table.relative_to(out_dir) if table.is_file() else 'no table written'}",
                 result.returncode in (0, 1) and table.is_file(),
                 gates_met=result.returncode == 0)
    if table.is_file():  # twinserve-validate printed it above
        grid_json = grid_dir / "grid.json"
        if grid_json.is_file():
            report.measurements["validation_grid"] = json.loads(grid_json.read_text())


# ---------------------------------------------------------------------------------------------
# The driver: each step in its own process, under its budget


STEP_FUNCTIONS = {"kernels": step_kernels, "engine": step_engine, "bandwidth": step_bandwidth,
                  "throughput": step_throughput}


def run_step_here(name: str, smoke: bool, out_dir: Path, result_path: Path) -> int:
    """One step in this process; its rows go to result_path (JSON)."""
    import torch
    torch.manual_seed(0)
    if smoke:
        torch.set_num_threads(1)
    report = StepReport()
    error = None
    try:
        if name == "fidelity":
            step_fidelity(report, smoke, out_dir)
        else:
            STEP_FUNCTIONS[name](report, smoke)
    except Exception as exc:  # noqa: BLE001 - a crash is the step's result, with its reason
        import traceback
        traceback.print_exc()
        error = f"{type(exc).__name__}: {exc}"
    status = "crashed" if error else ("passed" if report.ok else "failed")
    result_path.write_text(json.dumps({"status": status, "error": error, "rows": report.rows,
                                       "measurements": report.measurements}, default=str))
    return EXIT_OK if status == "passed" else EXIT_FAILED


def run_step_process(step: Step, smoke: bool, out_dir: Path, budget_s: float) -> dict:
    """Runs one step in a child process (its output streams through), killed when it overruns
    its budget; returns its result: status passed / failed / crashed / timed out."""
    result_path = out_dir / f".step-{step.name}.json"
    result_path.unlink(missing_ok=True)
    args = [sys.executable, str(Path(__file__).resolve()), "--step", step.name,
            "--out", str(out_dir)] + (["--smoke"] if smoke else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if smoke:  # before anything imports triton (transformers does): Triton's interpreter
        env["TRITON_INTERPRET"] = "1"
    started = time.perf_counter()
    child = subprocess.Popen(args, cwd=REPO, env=env, start_new_session=True)
    try:
        child.wait(timeout=budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the step and anything it started
        child.wait()
    elapsed = time.perf_counter() - started
    if result_path.is_file():
        result = json.loads(result_path.read_text())
        result_path.unlink()
    else:
        timed_out = elapsed >= budget_s
        result = {"status": "timed out" if timed_out else "crashed", "rows": [],
                  "error": (f"over its budget of {budget_s:.0f} s" if timed_out else
                            f"exit {child.returncode} without a result")}
    result.update(name=step.name, title=step.title, seconds=round(elapsed, 1),
                  budget_s=budget_s)
    return result


def run_all(smoke: bool, out_dir: Path, only: list[str] | None = None) -> int:
    problem = environment_problem(smoke)
    if problem is not None:
        status, line = problem
        print(f"gpu_check: {line}", flush=True)
        return status
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "gpu_check.json"
    started = time.perf_counter()
    results = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="seconds"),
               "git_commit": git_commit(), "smoke": smoke,
               "environment": environment_summary(), "steps": []}
    env = results["environment"]
    print(f"## twinserve GPU check: {env['device']}, torch {env['torch']} (CUDA {env['cuda']}), "
          f"triton {env['triton']}, transformers {env['transformers']}", flush=True)
    steps = [step for step in STEPS if only is None or step.name in only]
    for step in steps:
        budget = SMOKE_BUDGET_S if smoke else step.budget_s
        print(f"\n### {step.name}: {step.title} (budget {budget} s)\n", flush=True)
        print("| check | value | ok |\n|---|---|---|", flush=True)
        result = run_step_process(step, smoke, out_dir, budget)
        results["steps"].append(result)
        results["seconds"] = round(time.perf_counter() - started, 1)
        results_path.write_text(json.dumps(results, indent=1, default=str))
        line = f"{step.name}: {result['status']} in {result['seconds']} s"
        print(f"\n{line}" + (f" ({result['error']})" if result.get("error") else ""),
              flush=True)
    failed = [r["name"] for r in results["steps"] if r["status"] != "passed"]
    results["status"] = "failed" if failed else "passed"
    results_path.write_text(json.dumps(results, indent=1, default=str))
    print(f"\ngpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'all steps passed'} "
          f"({results['seconds']} s); results in {results_path}", flush=True)
    return EXIT_FAILED if failed else EXIT_OK


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                              capture_output=True, text=True, timeout=10).stdout.strip() or None
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------
# Compile-only check (no GPU): what the interpreter cannot tell


def compile_report(arch: int = 90) -> int:
    """Run the kernels' warm-up (kernels/triton_ops.warm_up: every variant the engine
    launches) for each configuration of KERNEL_MATRIX_NAMES (block size 16; 32, 16, 8 KV heads
    for groups of 1, 2, 8: Llama-2-7B, -, 70B) with the kernel launches captured instead of
    run, compile each launch for sm_{arch} with the specialisation a real launch gets (16-byte
    aligned pointers; ints divisible by 16 or equal to 1, but for the kernels'
    do_not_specialize arguments), and print registers, spills (stack) and shared memory.
    Written against the internals of Triton 3.6 to 3.9 (JITFunction.run, ASTSource)."""
    import tempfile
    os.environ["TRITON_INTERPRET"] = "0"  # compile, do not interpret (before triton's import)
    import torch
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
        for heads_per_kv_head, head_dim, dtype_name in KERNEL_MATRIX_NAMES:
            num_kv_heads = 32 // heads_per_kv_head
            triton_ops.warm_up(32, num_kv_heads, head_dim, 16, dtype_of(dtype_name),
                               torch.device("cpu"))
    finally:
        JITFunction.run = original_run

    type_names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                  torch.int32: "i32", torch.int64: "i64"}
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    seen, worst_stack = set(), 0
    print(f"triton {triton.__version__}\n")
    print(f"| kernel (sm_{arch}) | constexprs | warps | registers | spill stack | shared |")
    print("|---|---|---|---|---|---|")
    for fn, args, kwargs in launches:
        kwargs = dict(kwargs)
        options = {"num_warps": kwargs.pop("num_warps", 4)}
        values = dict(zip(fn.arg_names, args), **kwargs)
        signature, constexprs, attrs = {}, {}, {}
        for i, name in enumerate(fn.arg_names):
            value = values[name]
            specialised = not fn.params[i].do_not_specialize
            if fn.params[i].is_constexpr or (specialised and type(value) is int and value == 1):
                signature[name], constexprs[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + type_names[value.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(value, int):
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if specialised and value % 16 == 0:
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
        shown = {k: (str(v).removeprefix("torch.") if not isinstance(v, (int, bool)) else v)
                 for k, v in shown.items()}
        print(f"| {fn.__name__} | {shown} | {options['num_warps']} | {registers} | {stack} | "
              f"{compiled.metadata.shared} |", flush=True)
    return 0 if worst_stack == 0 else 1


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on CPU through Triton's interpreter (checks the script)")
    parser.add_argument("--compile", action="store_true",
                        help="no GPU: compile the kernels for sm_90 and report registers/spills")
    parser.add_argument("--out", type=Path, default=Path("gpu_check_out"),
                        help="folder of the results (gpu_check.json, profile, validation)")
    names = [step.name for step in STEPS]
    parser.add_argument("--step", choices=names, help="run one step in this process")
    parser.add_argument("--only", nargs="+", choices=names, metavar="STEP",
                        help=f"run only these steps (of {', '.join(names)}); the check then "
                             f"still fails, as any step that does not run leaves it unchecked")
    args = parser.parse_args(argv)
    if args.compile:
        return compile_report()
    out_dir = args.out.resolve()
    if args.step:
        out_dir.mkdir(parents=True, exist_ok=True)
        return run_step_here(args.step, args.smoke, out_dir,
                             out_dir / f".step-{args.step}.json")
    status = run_all(args.smoke, out_dir, args.only)
    if args.only and status == EXIT_OK and set(args.only) != set(names):
        print(f"gpu_check: steps {sorted(set(names) - set(args.only))} did not run: not a "
              f"complete check", flush=True)
        return EXIT_FAILED
    return status


if __name__ == "__main__":
    sys.exit(main())
