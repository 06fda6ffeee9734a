"""The grouped LoRA kernel of the engine's CPU path (kernels/lora_batch.py's API): per adapter
slot one gather of its tokens, two GEMMs and one scatter-add, so that a long prefill reads each
adapter once instead of copying its weights per token; the product order is PEFT's.
"""
from __future__ import annotations

import torch

from kernels.lora_batch import LoRABatch


def add_lora(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             scalings: torch.Tensor, batch: LoRABatch) -> None:
    """out[t] += scalings[s] * lora_b[s] @ (lora_a[s] @ x[t]) for each token t of slot s."""
    starts = batch.host_group_starts
    for group, slot in enumerate(batch.host_group_slots):
        tokens = batch.sorted_tokens[starts[group]:starts[group + 1]]
        shrunk = x.index_select(0, tokens) @ lora_a[slot].t()
        delta = (shrunk @ lora_b[slot].t()) * scalings[slot]
        out.index_add_(0, tokens, delta.to(out.dtype))
