"""A mixture-of-experts layer's MLP kernels (router, shared and routed experts, expert-parallel
all-to-alls) from the dense operator tables carried to the expert's shape by the roofline ratio,
at the tokens each kernel sees (docs/gpu-cost-model.md derives each)."""
from __future__ import annotations

import dataclasses

import numpy as np

from sim.cost.experts import ExpertLayout
from runtime.specs import HardwareSpec
from sim.cost.gpu.collectives import allreduce_cost
from sim.cost.gpu.linear import TABLE_DTYPE_BYTES, interpolate, kernel_floor_ms, predict_op_ms
from sim.cost.gpu.tables import LayerShape, OpTable
from sim.cost.gpu.transfer import gemm_dims, gemm_roofline_s

MLP_OPS = ("mlp_up_proj", "mlp_act", "mlp_down_proj")


def predict_gemm_ms(table: OpTable, rows: np.ndarray, hardware: HardwareSpec, k: int, n: int,
                    dtype_bytes: int) -> np.ndarray:
    """A (rows x k) @ (k x n) GEMM (ms): the table's gate+up GEMM at `rows`, its launch floor as
    measured and the rest by the ratio of the two rooflines."""
    measured = interpolate(rows, table.tokens, table.op_ms["mlp_up_proj"])
    ref_k, ref_n = gemm_dims(table.shape, table.tensor_parallel_size)["mlp_up_proj"]
    reference = gemm_roofline_s(rows, ref_k, ref_n, TABLE_DTYPE_BYTES, table.hardware)
    target = gemm_roofline_s(rows, k, n, dtype_bytes, hardware)
    floor = np.minimum(kernel_floor_ms(table), measured)
    return floor + (measured - floor) * (target / reference)


@dataclasses.dataclass(frozen=True)
class ExpertKernels:
    """One MoE layer's MLP kernels on one GPU, per token count (module docstring)."""

    table: OpTable
    hardware: HardwareSpec        # the rates the kernels are predicted at
    layout: ExpertLayout
    shape: LayerShape             # the model's layer shape (attention widths)

    def layer_ms(self, tokens: np.ndarray) -> np.ndarray:
        """ms of the router, shared experts, routed experts and all-to-alls at `tokens` (>= 1)."""
        return (self.router_ms(tokens) + self.shared_ms(tokens) + self.routed_ms(tokens)
                + self.all_to_all_ms(tokens))

    def router_ms(self, tokens: np.ndarray) -> np.ndarray:
        m = self.layout.model
        return predict_gemm_ms(self.table, tokens, self.hardware, m.hidden_size, m.num_experts,
                               m.dtype_bytes)

    def shared_ms(self, tokens: np.ndarray) -> np.ndarray:
        m = self.layout.model
        if not m.shared_expert_intermediate_size:
            return np.zeros_like(tokens)
        shape = dataclasses.replace(self.shape, intermediate_size=m.shared_expert_intermediate_size)
        return sum(predict_op_ms(self.table, op, tokens, self.hardware, shape,
                                 self.layout.tensor_parallel_size, m.dtype_bytes)
                   for op in MLP_OPS)

    def routed_ms(self, tokens: np.ndarray) -> np.ndarray:
        layout, m = self.layout, self.layout.model
        touched = layout.experts_touched(tokens)
        group_routed = tokens * layout.group_tokens_per_token * m.num_experts_per_tok
        per_expert_tokens = group_routed / touched
        local_touched = touched / layout.expert_parallel_size
        # One expert's slice on this GPU, as a one-GPU gated MLP of the local width.
        shape = dataclasses.replace(self.shape, intermediate_size=layout.local_expert_width)
        floor = kernel_floor_ms(self.table)
        ms = predict_op_ms(self.table, "mlp_act", group_routed / layout.expert_parallel_size,
                           self.hardware, shape, 1, m.dtype_bytes)
        for op in ("mlp_up_proj", "mlp_down_proj"):
            one_expert = predict_op_ms(self.table, op, per_expert_tokens, self.hardware, shape, 1,
                                       m.dtype_bytes)
            ms = ms + floor + local_touched * np.maximum(one_expert - floor, 0.0)
        return ms

    def all_to_all_ms(self, tokens: np.ndarray) -> np.ndarray:
        ep = self.layout.expert_parallel_size
        if ep == 1:
            return np.zeros_like(tokens)
        collective = allreduce_cost(self.hardware, ep)
        return 2 * 1e3 * collective.seconds(self.layout.all_to_all_bytes(tokens) / 2)

    def source(self, routing) -> str:
        ep = self.layout.expert_parallel_size
        a2a = ("" if ep == 1 else
               f"; dispatch + combine all-to-all as an all-reduce of half the bytes, "
               f"{allreduce_cost(self.hardware, ep).source}")
        return (f"{self.layout.describe(routing)}: router, shared and routed expert GEMMs "
                f"predicted from {self.table.name} gate+up / down GEMMs by roofline ratio at each "
                f"touched expert's mean tokens (one launch floor per fused kernel, the touched "
                f"experts' weights read){a2a}")
