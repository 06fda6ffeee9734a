"""Attention of decodes and prefill chunks, fitted from the attention tables as achieved rates
(fixed + bytes or FLOPs over a rate, per table) and carried to the target's shape and GPU
(docs/gpu-cost-model.md, Attention)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from runtime.specs import HardwareSpec
from sim.cost.gpu.tables import AttentionTable, LayerShape, attention_tables
from sim.cost.gpu.transfer import gpu_distance, kv_heads_per_gpu

# A table of another backend than the preferred one ranks behind every table of it.
OTHER_BACKEND_DISTANCE = 100.0


@dataclass(frozen=True)
class AttentionFit:
    """One table's achieved rates, in seconds per call of one layer on one GPU."""

    table: AttentionTable
    decode_fixed_s: float
    decode_s_per_byte: float
    decode_s_per_seq: float
    prefill_fixed_s: float
    prefill_s_per_context_flop: float   # queries x cached keys
    prefill_s_per_causal_flop: float    # the chunk's own causal triangle
    decode_error_pct: float             # mean relative error of the fit over its rows
    prefill_error_pct: float


@dataclass(frozen=True)
class AttentionCost:
    """Seconds per layer for the target: what the cost model multiplies by its plan's features."""

    decode_fixed_s: float
    decode_s_per_context_token: float
    decode_s_per_seq: float
    prefill_fixed_s: float
    prefill_s_per_context_pair: float   # chunk token x cached token
    prefill_s_per_causal_pair: float    # pairs of the chunk's own triangle (c^2 / 2)
    source: str
    prefill_s_per_token: float = 0.0    # per prompt token of the step's chunks
    # A decode's attention in a step with prompt tokens, per token of its context (0: priced as
    # in a decode-only step).
    mixed_decode_s_per_context_token: float = 0.0


def _heads(shape: LayerShape, tp: int) -> tuple[int, int]:
    return shape.num_attention_heads // tp, kv_heads_per_gpu(shape, tp)


def _relative_least_squares(columns: list[np.ndarray], ms: np.ndarray) -> tuple[list[float], float]:
    matrix = np.stack(columns, axis=1)
    coef, *_ = np.linalg.lstsq(matrix / ms[:, None], np.ones_like(ms), rcond=None)
    coef = np.maximum(coef, 0.0)  # a negative rate or cost is noise, not physics
    error = float(np.mean(np.abs(matrix @ coef - ms) / ms)) * 100
    return [float(c) * 1e-3 for c in coef], error  # ms -> s; plain floats keep steps cheap


@functools.lru_cache(maxsize=None)
def fit_table(table: AttentionTable) -> AttentionFit:
    q_heads, kv_heads = _heads(table.shape, table.tensor_parallel_size)
    kv_bytes_per_token = 2 * kv_heads * table.shape.head_dim * 2  # K and V, fp16
    flops_per_pair = 4 * q_heads * table.shape.head_dim          # QK^T and PV
    decodes = [r for r in table.rows if not r.is_prefill]
    prefills = [r for r in table.rows if r.is_prefill]
    d_ms = np.array([r.ms for r in decodes])
    d_seqs = np.array([r.batch_size for r in decodes], dtype=float)
    d_bytes = d_seqs * np.array([r.kv_cache_size for r in decodes]) * kv_bytes_per_token
    (d_fixed, d_byte, d_seq), d_err = _relative_least_squares(
        [np.ones_like(d_ms), d_bytes, d_seqs], d_ms)
    p_ms = np.array([r.ms for r in prefills])
    chunk = np.array([r.prefill_chunk_size for r in prefills], dtype=float)
    cached = np.array([r.kv_cache_size for r in prefills], dtype=float)
    (p_fixed, p_context, p_causal), p_err = _relative_least_squares(
        [np.ones_like(p_ms), flops_per_pair * chunk * cached, flops_per_pair * chunk ** 2 / 2], p_ms)
    return AttentionFit(table, d_fixed, d_byte, d_seq, p_fixed, p_context, p_causal, d_err, p_err)


def nearest_attention_table(hardware: HardwareSpec, shape: LayerShape, tensor_parallel_size: int,
                            backend: str, tables: tuple[AttentionTable, ...] | None = None
                            ) -> AttentionTable:
    tables = attention_tables() if tables is None else tables
    q_heads, kv_heads = _heads(shape, tensor_parallel_size)

    def distance(table: AttentionTable) -> float:
        ref_q, ref_kv = _heads(table.shape, table.tensor_parallel_size)
        return ((0.0 if table.backend == backend else OTHER_BACKEND_DISTANCE)
                + gpu_distance(hardware, table.hardware)
                + abs(math.log(q_heads / ref_q)) + abs(math.log(kv_heads / ref_kv))
                + abs(math.log(shape.head_dim / table.shape.head_dim)))
    return min(tables, key=distance)


def attention_cost(hardware: HardwareSpec, shape: LayerShape, tensor_parallel_size: int,
                   dtype_bytes: int, backend: str,
                   tables: tuple[AttentionTable, ...] | None = None) -> AttentionCost:
    table = nearest_attention_table(hardware, shape, tensor_parallel_size, backend, tables)
    fit = fit_table(table)
    q_heads, kv_heads = _heads(shape, tensor_parallel_size)
    byte_scale = table.hardware.memory_bandwidth / hardware.memory_bandwidth
    flop_scale = table.hardware.peak_flops / hardware.peak_flops
    kv_bytes_per_token = 2 * kv_heads * shape.head_dim * dtype_bytes
    flops_per_pair = 4 * q_heads * shape.head_dim
    same_gpu = byte_scale == 1 and flop_scale == 1
    source = (f"fitted on {table.name} ({table.hardware.name}, {table.backend}; fit error "
              f"decode {fit.decode_error_pct:.0f} %, prefill {fit.prefill_error_pct:.0f} %), "
              f"scaled to this shape by KV bytes and FLOPs"
              + ("" if same_gpu else f" and to {hardware.name} by bandwidth and FLOP ratios"))
    return AttentionCost(
        decode_fixed_s=fit.decode_fixed_s,
        decode_s_per_context_token=kv_bytes_per_token * fit.decode_s_per_byte * byte_scale,
        decode_s_per_seq=fit.decode_s_per_seq,
        prefill_fixed_s=fit.prefill_fixed_s,
        prefill_s_per_context_pair=flops_per_pair * fit.prefill_s_per_context_flop * flop_scale,
        prefill_s_per_causal_pair=flops_per_pair * fit.prefill_s_per_causal_flop * flop_scale,
        source=source)
