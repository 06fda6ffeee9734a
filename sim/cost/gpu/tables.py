"""The GPU measurements under data/gpu/ (operator, attention and NCCL tables; data/gpu/README.md
says where each comes from), parsed once per process."""
from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

import conf
from runtime.specs import HardwareSpec

DATA_DIR = Path(__file__).resolve().parents[3] / "data" / "gpu"
HARDWARE_DIR = Path(conf.__file__).parent / "hardware"

# Per-layer kernels of an operator table, in a layer's order. `emb` runs once per forward pass.
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
             "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
STEP_OPS = ("emb",)

# (path under data/gpu, conf/hardware name of the GPU it was measured on)
OP_TABLE_FILES = (
    ("vidur/a100/Llama-2-7b-hf/mlp.csv", "a100-80gb"),
    ("vidur/a100/Llama-2-70b-hf/mlp.csv", "a100-80gb"),
    ("vidur/a100/Meta-Llama-3-8B/mlp.csv", "a100-80gb"),
    ("vidur/h100/Llama-2-7b-hf/mlp.csv", "h100-80gb"),
    ("vidur/h100/Llama-2-70b-hf/mlp.csv", "h100-80gb"),
    ("frontier/a800/Llama-2-7b-hf/mlp.csv", "a800-80gb"),
)
ATTENTION_TABLE_FILES = (
    ("vidur/a100/Llama-2-70b-hf/attention.csv", "a100-80gb"),
    ("frontier/a800/Llama-2-7b-hf/attention.csv", "a800-80gb"),
    ("frontier/h100/qwen2_moe_example/attention.csv", "h100-80gb"),
)
ALLREDUCE_TABLE_FILES = (
    ("vidur/network/a100_dgx/all_reduce.csv", "a100-80gb"),
    ("vidur/network/h100_dgx/all_reduce.csv", "h100-80gb"),
)
SEND_RECV_TABLE_FILES = (
    ("vidur/network/a100_dgx/send_recv.csv", "a100-80gb"),
    ("vidur/network/h100_dgx/send_recv.csv", "h100-80gb"),
)


@dataclass(frozen=True)
class LayerShape:
    """What an operator's cost depends on: a layer's widths (whole model, not per GPU)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    gated_mlp: bool

    @classmethod
    def of_model(cls, model) -> LayerShape:
        return cls(model.hidden_size, model.num_attention_heads, model.num_key_value_heads,
                   model.head_dim, model.intermediate_size, model.mlp == "gated")


@dataclass(frozen=True)
class OpTable:
    """One (GPU, model shape, tensor-parallel size) operator table: per op, ms at `tokens`."""

    name: str                      # e.g. "a100/Llama-2-7b-hf tp1"
    hardware: HardwareSpec
    shape: LayerShape
    tensor_parallel_size: int
    tokens: tuple[int, ...]        # ascending
    op_ms: dict                    # op -> tuple of medians (ms), one per token count
    duplicate_spread_pct: float    # mean |a - b| / mean over token counts measured twice


@dataclass(frozen=True)
class AttentionRow:
    is_prefill: bool
    batch_size: int
    prefill_chunk_size: int
    kv_cache_size: int
    ms: float                      # every kernel of the call (attention, reshapes, KV save)


@dataclass(frozen=True)
class AttentionTable:
    name: str
    hardware: HardwareSpec
    shape: LayerShape
    tensor_parallel_size: int
    backend: str
    rows: tuple[AttentionRow, ...]


@dataclass(frozen=True)
class AllReduceTable:
    name: str
    hardware: HardwareSpec
    # num_workers -> (message bytes ascending, ms)
    curves: dict


@functools.lru_cache(maxsize=None)
def hardware_spec(name: str) -> HardwareSpec:
    """The conf/hardware spec a table was measured on."""
    return HardwareSpec.from_config(OmegaConf.load(HARDWARE_DIR / f"{name}.yaml"))


def _table_name(path: str, tp: int) -> str:
    parts = Path(path).parts  # (source, gpu, model, file)
    return f"{parts[1]}/{parts[2]} tp{tp}"


def _shape_of_row(row: dict) -> LayerShape:
    hidden, heads = int(row["n_embd"]), int(row.get("n_head") or row["n_q_head"])
    return LayerShape(hidden, heads, int(row["n_kv_head"]), hidden // heads,
                      int(row.get("n_expanded_embd") or 0), row.get("use_gated_mlp", "True") == "True")


def _read_rows(path: str) -> list[dict]:
    with open(DATA_DIR / path, newline="") as file:
        return list(csv.DictReader(file))


@functools.lru_cache(maxsize=None)
def op_tables() -> tuple[OpTable, ...]:
    """Every operator table, one per (file, tensor-parallel size). Token counts measured twice
    keep the mean of their medians."""
    tables = []
    for path, gpu in OP_TABLE_FILES:
        rows = _read_rows(path)
        by_tp: dict[int, dict[int, list[dict]]] = {}
        for row in rows:
            by_tp.setdefault(int(row["num_tensor_parallel_workers"]), {}).setdefault(
                int(row["num_tokens"]), []).append(row)
        for tp, by_tokens in sorted(by_tp.items()):
            tokens = tuple(sorted(by_tokens))
            op_ms, spreads = {}, []
            for op in LAYER_OPS + STEP_OPS:
                column = f"time_stats.{op}.median"
                op_ms[op] = tuple(sum(float(r[column]) for r in by_tokens[n]) / len(by_tokens[n])
                                  for n in tokens)
            for n in tokens:
                if len(by_tokens[n]) == 2:
                    a, b = (sum(float(r[f"time_stats.{op}.median"]) for op in LAYER_OPS)
                            for r in by_tokens[n])
                    spreads.append(abs(a - b) / ((a + b) / 2))
            tables.append(OpTable(_table_name(path, tp), hardware_spec(gpu), _shape_of_row(rows[0]),
                                  tp, tokens, op_ms,
                                  100 * sum(spreads) / len(spreads) if spreads else 0.0))
    return tuple(tables)


@functools.lru_cache(maxsize=None)
def attention_tables() -> tuple[AttentionTable, ...]:
    """Every attention table, one per (file, tensor-parallel size). (Read with a plain csv
    reader by column index: these files have tens of thousands of wide rows.)"""
    tables = []
    for path, gpu in ATTENTION_TABLE_FILES:
        with open(DATA_DIR / path, newline="") as file:
            reader = csv.reader(file)
            header = next(reader)
            rows = list(reader)
        column = {name: index for index, name in enumerate(header)}
        kernels = [index for name, index in column.items()
                   if name.startswith("time_stats.") and name.endswith(".median")]
        tp_at, prefill_at, batch_at, chunk_at, kv_at = (column[name] for name in (
            "num_tensor_parallel_workers", "is_prefill", "batch_size", "prefill_chunk_size",
            "kv_cache_size"))
        by_tp: dict[int, list[AttentionRow]] = {}
        for row in rows:
            ms = sum(float(row[i]) for i in kernels if row[i] != "")
            by_tp.setdefault(int(row[tp_at]), []).append(AttentionRow(
                row[prefill_at] == "True", int(row[batch_at]), int(row[chunk_at]),
                int(row[kv_at]), ms))
        first = dict(zip(header, rows[0]))
        backend = first["attention_backend"].rsplit(".", 1)[-1]
        for tp, table_rows in sorted(by_tp.items()):
            tables.append(AttentionTable(_table_name(path, tp), hardware_spec(gpu),
                                         _shape_of_row(first), tp, backend, tuple(table_rows)))
    return tuple(tables)


@functools.lru_cache(maxsize=None)
def allreduce_tables() -> tuple[AllReduceTable, ...]:
    """NCCL all-reduce within one node (devices_per_node = num_workers), rank 0. `size` is in
    bytes: read as fp16 elements, the largest messages would exceed NVLink's 300 GB/s a
    direction on the A100 (data/gpu/README.md)."""
    return _collective_tables(ALLREDUCE_TABLE_FILES, "all_reduce")


@functools.lru_cache(maxsize=None)
def send_recv_tables() -> tuple[AllReduceTable, ...]:
    """NCCL send/recv between two GPUs of one node, rank 0, in the all-reduce tables' form (one
    curve, 2 workers); `size` in bytes as there."""
    return _collective_tables(SEND_RECV_TABLE_FILES, "send_recv")


def _collective_tables(files, collective: str) -> tuple[AllReduceTable, ...]:
    tables = []
    for path, gpu in files:
        curves: dict[int, list[tuple[int, float]]] = {}
        for row in _read_rows(path):
            if row["devices_per_node"] == row["num_workers"] and row["rank"] == "0":
                curves.setdefault(int(row["num_workers"]), []).append(
                    (int(row["size"]), float(row[f"time_stats.{collective}.median"])))
        parts = Path(path).parts
        tables.append(AllReduceTable(f"{parts[2]} {collective}", hardware_spec(gpu), {
            workers: (tuple(s for s, _ in sorted(points)), tuple(t for _, t in sorted(points)))
            for workers, points in curves.items()}))
    return tuple(tables)
