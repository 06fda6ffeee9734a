"""The transfer rule: a measurement of one (GPU, shape, tensor-parallel size) predicts another as
the nearest measured time times roofline(target) / roofline(reference) (docs/gpu-cost-model.md)."""
from __future__ import annotations

import math

import numpy as np

from runtime.specs import HardwareSpec
from sim.cost.gpu.tables import LayerShape

# Another board of the same chip (same peak FLOP/s and HBM bandwidth) ranks just after the board
# the table was measured on.
SAME_CHIP_DISTANCE = 1e-3
# A GPU whose rates are this many times off every table's is not covered (a CPU, say).
MAX_RATE_RATIO = 8.0

# Transfer kinds, from the closest to the farthest: the leave-one-out errors are kept per kind.
MEASURED, SAME_CHIP, SHAPE, GPU, GPU_AND_SHAPE = (
    "measured", "same-chip", "shape", "gpu", "gpu+shape")
TRANSFER_KINDS = (MEASURED, SAME_CHIP, SHAPE, GPU, GPU_AND_SHAPE)


def same_chip(a: HardwareSpec, b: HardwareSpec) -> bool:
    return a.peak_tflops == b.peak_tflops and a.memory_bandwidth_gbps == b.memory_bandwidth_gbps


def gpu_distance(target: HardwareSpec, reference: HardwareSpec) -> float:
    if target.name == reference.name:
        return 0.0
    if same_chip(target, reference):
        return SAME_CHIP_DISTANCE
    return (abs(math.log(target.peak_flops / reference.peak_flops))
            + abs(math.log(target.memory_bandwidth / reference.memory_bandwidth)))


def rates_covered(target: HardwareSpec, reference: HardwareSpec) -> bool:
    """Whether `reference`'s measurements may stand for `target` at all."""
    return all(1 / MAX_RATE_RATIO <= ratio <= MAX_RATE_RATIO for ratio in (
        target.peak_flops / reference.peak_flops,
        target.memory_bandwidth / reference.memory_bandwidth))


def transfer_kind(target_hw: HardwareSpec, same_shape: bool, reference_hw: HardwareSpec) -> str:
    if target_hw.name == reference_hw.name:
        return MEASURED if same_shape else SHAPE
    if same_chip(target_hw, reference_hw):
        return SAME_CHIP if same_shape else SHAPE
    return GPU if same_shape else GPU_AND_SHAPE


def kv_heads_per_gpu(shape: LayerShape, tp: int) -> int:
    """vLLM replicates KV heads when tp exceeds their number."""
    return max(1, -(-shape.num_key_value_heads // tp))


def gemm_dims(shape: LayerShape, tp: int) -> dict[str, tuple[int, int]]:
    """(input width K, output width N) per GPU of each linear layer of a layer: column-parallel
    layers split N, row-parallel ones split K."""
    q = shape.num_attention_heads * shape.head_dim // tp
    kv = kv_heads_per_gpu(shape, tp) * shape.head_dim
    inter = shape.intermediate_size // tp
    return {"attn_pre_proj": (shape.hidden_size, q + 2 * kv),
            "attn_post_proj": (q, shape.hidden_size),
            "mlp_up_proj": (shape.hidden_size, (2 if shape.gated_mlp else 1) * inter),
            "mlp_down_proj": (inter, shape.hidden_size)}


def elementwise_bytes_per_token(shape: LayerShape, tp: int, dtype_bytes: int) -> dict[str, int]:
    """Bytes each small kernel reads and writes per token (they do no FLOPs worth counting)."""
    q = shape.num_attention_heads * shape.head_dim // tp
    kv = kv_heads_per_gpu(shape, tp) * shape.head_dim
    inter = shape.intermediate_size // tp
    h = shape.hidden_size
    return {"input_layernorm": 2 * h * dtype_bytes,
            "post_attention_layernorm": 2 * h * dtype_bytes,
            "attn_rope": 2 * (q + kv) * dtype_bytes,
            # SwiGLU reads gate and up and writes their product; ReLU reads one and writes one.
            "mlp_act": (3 if shape.gated_mlp else 2) * inter * dtype_bytes,
            "add": 3 * h * dtype_bytes,
            "emb": 2 * h * dtype_bytes}


def gemm_roofline_s(num_tokens, k: int, n: int, dtype_bytes: int, hw: HardwareSpec):
    """max(FLOPs / peak, bytes / bandwidth) of a (tokens x k) @ (k x n) GEMM: weights read once,
    activations in and out; `num_tokens` may be an array."""
    flops_s = 2 * num_tokens * k * n / hw.peak_flops
    bytes_s = (k * n + num_tokens * (k + n)) * dtype_bytes / hw.memory_bandwidth
    return np.maximum(flops_s, bytes_s)


def shape_distance(target: LayerShape, target_tp: int, reference: LayerShape,
                   reference_tp: int) -> float:
    """Mean over the four GEMMs of |log K ratio| + |log N ratio|, per GPU."""
    a, b = gemm_dims(target, target_tp), gemm_dims(reference, reference_tp)
    return sum(abs(math.log(a[op][0] / b[op][0])) + abs(math.log(a[op][1] / b[op][1]))
               for op in a) / len(a)
