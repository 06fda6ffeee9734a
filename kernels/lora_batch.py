"""One step's LoRA batch: which adapter slot each flattened token uses, grouped by slot.

Every LoRA kernel's `add_lora(out, x, lora_a, lora_b, scalings, batch)` adds, for every token t
with a slot s = batch.token_slots[t] (-1: none), scalings[s] * lora_b[s] @ (lora_a[s] @ x[t]) to
out[t] in place. Slots: lora_a [num_slots, max_rank, in], lora_b [num_slots, out, max_rank],
zero past an adapter's rank so that lower ranks need no mask; scalings: alpha / rank.

The grouping is built once per step on the host and shared by every layer; its host-side group
count and longest group size the Triton grid without reading back from the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

NO_ADAPTER = -1


@dataclass
class LoRABatch:
    token_slots: torch.Tensor    # [num_tokens] int64: slot of each token, NO_ADAPTER for none
    sorted_tokens: torch.Tensor  # [num_lora_tokens] int64: tokens with an adapter, by slot
    group_starts: torch.Tensor   # [num_groups + 1] int32: group g is sorted_tokens[starts[g]:]
    group_slots: torch.Tensor    # [num_groups] int32: the slot of group g
    host_group_starts: list[int]
    host_group_slots: list[int]
    max_group_len: int

    @property
    def num_groups(self) -> int:
        return len(self.host_group_slots)

    @property
    def num_lora_tokens(self) -> int:
        return self.host_group_starts[-1]

    @classmethod
    def build(cls, token_slots: np.ndarray, device: torch.device | str) -> "LoRABatch":
        """The batch of a step whose flattened token t uses slot token_slots[t] (NO_ADAPTER:
        the base model alone)."""
        token_slots = np.asarray(token_slots, dtype=np.int64)
        with_adapter = np.flatnonzero(token_slots != NO_ADAPTER)
        order = with_adapter[np.argsort(token_slots[with_adapter], kind="stable")]
        slots, counts = np.unique(token_slots[order], return_counts=True)
        starts = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])

        def to(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)

        return cls(to(token_slots, torch.int64), to(order, torch.int64),
                   to(starts, torch.int32), to(slots, torch.int32),
                   starts.tolist(), slots.tolist(), int(counts.max()) if len(counts) else 0)
