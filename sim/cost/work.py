"""A step's work on one GPU, the power model's input: the roofline's FLOPs and device-memory bytes
without its efficiencies, from the model's shape and the plan's aggregates (docs/energy.md)."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from policies.types import StepPlan
from sim.cost.experts import ExpertLayout
from sim.cost.token_tables import TABLE_TOKENS, per_token_table
from runtime.specs import ModelSpec


def step_work_one_by_one(step_work: Callable[[StepPlan], tuple[float, float]], plan: StepPlan,
                         num_steps: int) -> tuple[list[float], list[float]]:
    """The FLOPs and bytes of each of `num_steps` repeated decode steps of `plan` from
    `step_work`: the plan's decode context moved a token a decode each step and its copies
    cleared after the first, then restored."""
    context, num_decodes, copies = (plan.decode_context_tokens, plan.num_decode_seqs,
                                    plan.blocks_to_copy)
    flops, bytes_moved = [], []
    try:
        for step in range(num_steps):
            if step == 1 and copies:
                plan.blocks_to_copy = []
            plan.decode_context_tokens = context + step * num_decodes
            step_flops, step_bytes = step_work(plan)
            flops.append(step_flops)
            bytes_moved.append(step_bytes)
    finally:
        plan.decode_context_tokens, plan.blocks_to_copy = context, copies
    return flops, bytes_moved


class ModelStepWork:
    """`step_work` of `model` on `tensor_parallel_size` GPUs."""

    def __init__(self, model: ModelSpec, tensor_parallel_size: int = 1, block_size: int = 16,
                 experts: ExpertLayout | None = None):
        m, tp = model, tensor_parallel_size
        self.model, self.tensor_parallel_size = m, tp
        self._linear_flops_per_token = 2 * m.num_layers * m.active_linear_parameters_per_layer / tp
        # Weights every step reads; a mixture's routed experts as many as its tokens touch
        # (`experts`, the cost model's routing and expert parallelism; uniform routing without).
        self._weight_bytes = ((m.num_layers * m.linear_parameters_per_layer
                               + m.lm_head_parameters) * m.dtype_bytes / tp)
        self._expert_bytes: list[float] | None = None
        if m.is_moe:
            self._weight_bytes = ((m.num_layers * (m.attention_parameters_per_layer
                                                   + m.always_active_mlp_parameters_per_layer)
                                   + m.lm_head_parameters) * m.dtype_bytes / tp)
            layout = experts if experts is not None else ExpertLayout.of(m, "uniform", tp)
            tokens = np.arange(1, TABLE_TOKENS + 1, dtype=float)
            self._expert_bytes, self._expert_bytes_slope = per_token_table(
                m.num_layers * layout.expert_weight_bytes_read(tokens))
        self._lm_head_flops_per_row = 2 * m.lm_head_parameters / tp
        self._decode_flops_per_seq = self._linear_flops_per_token + self._lm_head_flops_per_row
        self._attention_flops_per_pair = (4 * m.num_layers * (m.num_attention_heads // tp)
                                          * m.head_dim)
        self._kv_bytes_per_token = m.kv_bytes_per_token_per_gpu(tp)
        self._copy_bytes_per_block = 2 * block_size * self._kv_bytes_per_token

    def decode_work_terms(self) -> tuple[float, float, float, float] | None:
        """policies.protocols.DecodeWorkCostModel's terms; None for a mixture, whose expert
        reads are not linear in the tokens."""
        if self._expert_bytes is not None:
            return None
        return (self._decode_flops_per_seq, self._attention_flops_per_pair, self._weight_bytes,
                self._kv_bytes_per_token)

    def _weights_read(self, num_tokens: int) -> float:
        """Bytes of weights a step over `num_tokens` tokens reads (a mixture: O(1), a table)."""
        if self._expert_bytes is None:
            return self._weight_bytes
        if num_tokens <= TABLE_TOKENS:
            return self._weight_bytes + self._expert_bytes[num_tokens]
        return (self._weight_bytes + self._expert_bytes[TABLE_TOKENS]
                + (num_tokens - TABLE_TOKENS) * self._expert_bytes_slope)

    def step_work(self, plan: StepPlan) -> tuple[float, float]:
        num_decodes, num_drafts = plan.num_decode_seqs, plan.num_draft_tokens
        num_prefill = plan.num_prefill_tokens
        if num_decodes and not (num_prefill or num_drafts or plan.blocks_to_copy
                                or self._expert_bytes):
            # (Most steps: a dense model's decodes alone, the terms below in fewer operations.)
            context = plan.decode_context_tokens
            return (num_decodes * self._decode_flops_per_seq
                    + context * self._attention_flops_per_pair,
                    self._weight_bytes + (context + num_decodes) * self._kv_bytes_per_token)
        num_tokens = num_prefill + num_decodes + num_drafts
        num_copied = len(plan.blocks_to_copy)
        if not num_tokens:
            return 0.0, num_copied * self._copy_bytes_per_block
        if num_prefill:
            pairs = plan.prefill_attention_work - plan.sum_squared_prefill_chunks / 2
            kv_tokens = plan.prefill_context_tokens + num_prefill
        else:
            pairs = kv_tokens = 0
        if num_decodes:
            context = plan.decode_context_tokens
            pairs += context + num_drafts * context / num_decodes if num_drafts else context
            kv_tokens += context + num_decodes + num_drafts
        num_sampling = num_decodes + plan.num_prefill_seqs + num_drafts
        flops = (num_tokens * self._linear_flops_per_token
                 + num_sampling * self._lm_head_flops_per_row
                 + pairs * self._attention_flops_per_pair)
        bytes_moved = ((self._weight_bytes if self._expert_bytes is None
                        else self._weights_read(num_tokens))
                       + kv_tokens * self._kv_bytes_per_token)
        if num_copied:
            bytes_moved += num_copied * self._copy_bytes_per_block
        return flops, bytes_moved
