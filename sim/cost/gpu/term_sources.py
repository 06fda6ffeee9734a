"""Where each term of a GPUCostModel comes from (its `describe()`), in words."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sim.cost.gpu.cost_model import GPUCostModel


def term_sources(cost: GPUCostModel, linear_source: str) -> dict[str, str]:
    """Per term, what it was taken from."""
    m, tp, hardware = cost.model, cost.tensor_parallel_size, cost.hardware
    attention = cost._attention
    sources = {
        "linear": (cost._linear_source or linear_source)
                  + " (QKV, O, gate+up, down, norms, rope, act, add per layer; "
                    "embedding and final norm per step)"
                  + ("" if hardware.compute_efficiency == 1.0 or cost.kernels else
                     f"; the board's compute_efficiency {hardware.compute_efficiency:g}"),
        "lm_head": (f"{cost.kernel_source}: the hidden x vocab/tp GEMM over the sampling rows"
                    + (", logits all-gathered (NCCL)" if tp > 1 else "")
                    if cost.kernels is not None else
                    f"predicted from {cost.op_table.name} gate+up GEMM by the LM head's "
                    f"roofline ratio"),
        "attention": (attention.source + f"; decode: the measured (batch, context) grid of "
                      f"heads q/kv/d {cost._decode_grid.heads}, looked up at the batch and its "
                      f"mean context" if cost._decode_grid else attention.source),
        "allreduce": cost._allreduce_source,
        "engine": (("fitted: " + str(cost.terms_file) if cost.terms_file
                    else cost.engine_terms_source) + ": "
                   f"step_overhead_s={cost.step_overhead_s:g}, per_sequence_overhead_s="
                   f"{cost.per_sequence_overhead_s:g}, eager_launch_overhead_s_per_layer="
                   f"{cost.eager_launch_overhead_s_per_layer:g}, cuda_graph_max_tokens="
                   f"{cost.cuda_graph_max_tokens}"
                   + ("" if hardware.board != "workstation" or cost.kernels else
                      f", workstation_bandwidth_efficiency="
                      f"{cost.workstation_bandwidth_efficiency:g}")),
        "swaps_copies_offload_drafting": "RooflineCostModel arithmetic (spec-sheet rates)",
    }
    if m.is_moe:
        sources["experts"] = (
            f"{cost.kernel_source}: fused MoE layer table (moe_tp {cost.kernels.moe_tp_size}, "
            f"moe_ep {cost.kernels.moe_ep_size}, the measured routing nearest "
            f"{cost.routing!r})"
            + ("" if cost.kernels.moe_ep_size <= tp else
               f"; dispatch + combine per layer: vLLM's all-gather and reduce-scatter over the "
               f"data-parallel group, {cost.kernels.system} NCCL tables")
            if cost.kernels is not None else cost._expert_kernels.source(cost.routing))
    return sources
