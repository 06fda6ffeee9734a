"""The grouped LoRA kernel of the engine's CPU path (kernels/lora_batch.py's API).

Tokens are grouped by adapter slot (the step's LoRABatch): per group one gather of its rows of
x, two small matmuls (x A^T, then B^T, each a GEMM over the whole group) and one scatter-add into
out. A padded batched matmul (a copy of each token's A and B gathered per token, then bmm) does
the same arithmetic but gathers num_tokens x rank x (in + out) weights: for a prefill of
thousands of tokens that is thousands of copies of one adapter, where grouping reads each
adapter once. The groups are at most max_loras (the distinct adapters of a step), so the
Python loop over them is short; the product order is PEFT's (lora_B(lora_A(x)) * scaling).
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
