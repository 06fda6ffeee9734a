"""What the GPU check's steps share: the report a step writes its rows into, the paged batches
the kernel steps run, and timing."""
from __future__ import annotations

import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Relative error ||out - ref|| / ||ref|| allowed per dtype: bf16 operands land between 1e-3 and
# 1e-2; fp16's (3 mantissa bits more) 8 times lower; fp32 (exact dots) near 1e-6.
REL_TOLERANCE = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-4}
SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


class StepReport:
    """A step's rows, printed as they come (a table), kept for the JSON file; `on_row` (the
    driver's) is told after each row, so a step killed later keeps what it learned."""

    def __init__(self, on_row=None):
        self.rows: list[dict] = []
        self.measurements: dict = {}
        self.on_row = on_row

    def _add(self, row: dict) -> None:
        self.rows.append(row)
        if self.on_row is not None:
            self.on_row(self)

    def check(self, label: str, value: str, ok: bool, **data) -> None:
        print(f"| {label} | {value} | {'yes' if ok else 'NO'} |", flush=True)
        self._add({"check": label, "value": value, "ok": bool(ok), **data})

    def measure(self, label: str, value: str, **data) -> None:
        print(f"| {label} | {value} | |", flush=True)
        self._add({"measure": label, "value": value, **data})

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
