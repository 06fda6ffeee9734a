"""What a step costs besides its forward pass, shared by the roofline and the GPU cost model: the
engine's fixed and per-sequence work, block swaps and copies, the prefix cache's host-tier moves
and the LoRA adapters (sim/cost/lora.py)."""
from __future__ import annotations

from policies.types import StepPlan
from sim.cost.lora import LoRAStepCost


class StepOverheads:
    """Seconds of a step's overheads and memory operations, each block move at its own rate."""

    __slots__ = ("step_overhead_s", "per_sequence_overhead_s", "swap_s_per_block",
                 "copy_s_per_block", "offload_s_per_block", "lora")

    def __init__(self, step_overhead_s: float, per_sequence_overhead_s: float,
                 swap_s_per_block: float, copy_s_per_block: float, offload_s_per_block: float,
                 lora: LoRAStepCost | None):
        self.step_overhead_s = step_overhead_s
        self.per_sequence_overhead_s = per_sequence_overhead_s
        self.swap_s_per_block = swap_s_per_block
        self.copy_s_per_block = copy_s_per_block
        self.offload_s_per_block = offload_s_per_block
        self.lora = lora

    def seconds(self, plan: StepPlan, num_swapped: int, num_copied: int) -> float:
        """The overheads, `num_swapped` blocks swapped, `num_copied` copied, the plan's host-tier
        stores and loads and its adapters."""
        time = self.step_overhead_s + self.per_sequence_overhead_s * (plan.num_prefill_seqs
                                                                      + plan.num_decode_seqs)
        time += num_swapped * self.swap_s_per_block + num_copied * self.copy_s_per_block
        num_offload_moves = len(plan.blocks_to_offload) + len(plan.blocks_to_load)
        if num_offload_moves:
            time += num_offload_moves * self.offload_s_per_block
        if plan.lora is not None and plan.lora.num_adapters:
            time += self.lora.seconds(plan.lora)
        return time

    def step_start(self, plan: StepPlan) -> tuple[int, float]:
        """(the step's batched tokens, its overheads and memory operations): 0 and 0 for an empty
        plan; the cost model adds the forward pass when there are tokens."""
        num_tokens = plan.num_prefill_tokens + plan.num_decode_seqs + plan.num_draft_tokens
        num_swapped = len(plan.blocks_to_swap_out) + len(plan.blocks_to_swap_in)
        num_copied = len(plan.blocks_to_copy)
        if not (num_tokens or num_swapped or num_copied or plan.blocks_to_offload
                or plan.blocks_to_load or plan.preempted_recompute):
            return 0, 0.0   # a step that only preempts still costs the overhead
        return num_tokens, self.seconds(plan, num_swapped, num_copied)

    def repeated_start(self, plan: StepPlan) -> tuple[int, float]:
        """(the decodes of the batch `plan`, its overheads and memory operations), computed once
        for a run of repeated steps; a ValueError unless the plan is decodes only."""
        if plan.num_prefill_tokens or plan.spec_lens or not plan.num_decode_seqs:
            raise ValueError("repeated_step_times takes a plan of decodes only, without drafts")
        num_swapped = len(plan.blocks_to_swap_out) + len(plan.blocks_to_swap_in)
        return plan.num_decode_seqs, self.seconds(plan, num_swapped, len(plan.blocks_to_copy))
