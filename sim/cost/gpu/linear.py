"""Linear layers, the small per-layer kernels and the LM head from the operator tables: measured
kernels interpolated over token counts and carried to the target by each kernel's roofline ratio
(docs/gpu-cost-model.md)."""
from __future__ import annotations

import numpy as np

from runtime.specs import HardwareSpec
from sim.cost.gpu.tables import LAYER_OPS, STEP_OPS, LayerShape, OpTable, op_tables
from sim.cost.gpu.transfer import (elementwise_bytes_per_token, gemm_dims, gemm_roofline_s,
                              gpu_distance, rates_covered, shape_distance, transfer_kind)

TABLE_DTYPE_BYTES = 2  # every operator table was measured in fp16


class NoGPUTable(ValueError):
    """No operator table is within reach of the hardware's rates (a CPU, say): the run falls
    back to the roofline (sim/core/build.py)."""


def nearest_op_table(hardware: HardwareSpec, shape: LayerShape, tensor_parallel_size: int,
                     tables: tuple[OpTable, ...] | None = None, key: str = "hardware") -> OpTable:
    """The table closest to the target by GPU rates plus per-GPU GEMM widths. NoGPUTable naming
    `key` when no table's GPU is within reach of `hardware`'s rates."""
    return min(covering_tables(hardware, tables, key), key=lambda t: (
        gpu_distance(hardware, t.hardware)
        + shape_distance(shape, tensor_parallel_size, t.shape, t.tensor_parallel_size)))


def covering_tables(hardware: HardwareSpec, tables: tuple[OpTable, ...] | None = None,
                    key: str = "hardware") -> list[OpTable]:
    """The tables whose GPU is within reach of `hardware`'s rates; NoGPUTable naming `key` when
    none is."""
    tables = op_tables() if tables is None else tables
    covered = [t for t in tables if rates_covered(hardware, t.hardware)]
    if not covered:
        gpus = sorted({t.hardware.name for t in tables})
        raise NoGPUTable(f"{key}: no GPU operator table covers {hardware.name} "
                         f"(peak_tflops={hardware.peak_tflops:g}, memory_bandwidth_gbps="
                         f"{hardware.memory_bandwidth_gbps:g}); measured GPUs: {', '.join(gpus)}. "
                         f"Use cost_model=roofline for it")
    return covered


def is_exact_shape(table: OpTable, shape: LayerShape, tensor_parallel_size: int) -> bool:
    return table.shape == shape and table.tensor_parallel_size == tensor_parallel_size


def describe_transfer(table: OpTable, hardware: HardwareSpec, shape: LayerShape,
                      tensor_parallel_size: int) -> tuple[str, str]:
    """(transfer kind, one line saying where the prediction comes from)."""
    kind = transfer_kind(hardware, is_exact_shape(table, shape, tensor_parallel_size),
                         table.hardware)
    if kind == "measured":
        return kind, f"measured: {table.name}"
    how = {"same-chip": f"same chip as {hardware.name}, taken as is",
           "shape": "by the op shapes' roofline ratio",
           "gpu": "by bandwidth and FLOP ratios",
           "gpu+shape": "by op shapes and bandwidth and FLOP ratios"}[kind]
    return kind, f"predicted from {table.name} ({table.hardware.name}) {how}"


def interpolate(tokens: np.ndarray, measured_tokens, measured_ms) -> np.ndarray:
    """Linear between measured token counts, flat below the first, and beyond the last at the
    slope between the last and the one at half its count (robust to the last row's noise)."""
    xs = np.asarray(measured_tokens, dtype=float)
    ys = np.asarray(measured_ms, dtype=float)
    values = np.interp(tokens, xs, ys)
    last = xs[-1]
    slope = (ys[-1] - np.interp(last / 2, xs, ys)) / (last / 2)
    beyond = tokens > last
    values[beyond] = ys[-1] + (tokens[beyond] - last) * slope
    return values


def op_roofline_s(op: str, tokens: np.ndarray, shape: LayerShape, tensor_parallel_size: int,
                  dtype_bytes: int, hardware: HardwareSpec) -> np.ndarray:
    gemms = gemm_dims(shape, tensor_parallel_size)
    if op in gemms:
        k, n = gemms[op]
        return gemm_roofline_s(tokens, k, n, dtype_bytes, hardware)
    per_token = elementwise_bytes_per_token(shape, tensor_parallel_size, dtype_bytes)[op]
    return tokens * per_token / hardware.memory_bandwidth


# Kernels whose single-token time is their launch-to-completion floor: they move a few KB.
FLOOR_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "add")


def kernel_floor_ms(table: OpTable) -> float:
    """The table's per-kernel latency floor (ms): the median single-token time of its small
    elementwise kernels, which read and write a few KB. No spec-sheet rate sets it, so the
    transfer keeps it as measured and scales only what lies above it."""
    return float(np.median([table.op_ms[op][0] for op in FLOOR_OPS if op in table.op_ms]))


def predict_op_ms(table: OpTable, op: str, tokens: np.ndarray, hardware: HardwareSpec,
                  shape: LayerShape, tensor_parallel_size: int, dtype_bytes: int) -> np.ndarray:
    """The table's `op` at `tokens` (ms, tokens >= 1): its kernel floor as measured, plus the
    time above the floor times roofline(target) / roofline(table) — exactly the measurement for
    the table's own GPU chip, shape and dtype."""
    measured = interpolate(tokens, table.tokens, table.op_ms[op])
    target = op_roofline_s(op, tokens, shape, tensor_parallel_size, dtype_bytes, hardware)
    reference = op_roofline_s(op, tokens, table.shape, table.tensor_parallel_size,
                              TABLE_DTYPE_BYTES, table.hardware)
    floor = np.minimum(kernel_floor_ms(table), measured)
    return measured + (measured - floor) * (target / reference - 1.0)


def predict_layer_ms(table: OpTable, tokens: np.ndarray, hardware: HardwareSpec,
                     shape: LayerShape, tensor_parallel_size: int, dtype_bytes: int,
                     ops: tuple[str, ...] = LAYER_OPS) -> np.ndarray:
    """One layer's non-attention kernels (ms) at each of `tokens` (`ops`: which of them)."""
    return sum(predict_op_ms(table, op, tokens, hardware, shape, tensor_parallel_size, dtype_bytes)
               for op in ops)


def predict_step_ops_ms(table: OpTable, tokens: np.ndarray, hardware: HardwareSpec,
                        shape: LayerShape, tensor_parallel_size: int,
                        dtype_bytes: int) -> np.ndarray:
    """Kernels that run once per forward pass: the embedding lookup and the final norm (a third
    norm, as the table's input_layernorm)."""
    return sum(predict_op_ms(table, op, tokens, hardware, shape, tensor_parallel_size, dtype_bytes)
               for op in STEP_OPS + ("input_layernorm",))


def predict_lm_head_ms(table: OpTable, rows: np.ndarray, hardware: HardwareSpec,
                       hidden_size: int, vocab_size: int, tensor_parallel_size: int,
                       dtype_bytes: int) -> np.ndarray:
    """The LM head over `rows` sampling sequences (vocabulary split over the GPUs), from the
    table's gate+up GEMM by the ratio of their rooflines."""
    measured = interpolate(rows, table.tokens, table.op_ms["mlp_up_proj"])
    k, n = gemm_dims(table.shape, table.tensor_parallel_size)["mlp_up_proj"]
    reference = gemm_roofline_s(rows, k, n, TABLE_DTYPE_BYTES, table.hardware)
    target = gemm_roofline_s(rows, hidden_size, -(-vocab_size // tensor_parallel_size),
                             dtype_bytes, hardware)
    return measured * (target / reference)
