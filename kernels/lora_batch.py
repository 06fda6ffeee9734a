"""One step's LoRA batch: which adapter slot each flattened token uses, grouped by slot.

Every LoRA kernel (kernels/naive.py's loop, kernels/torch_lora.py, kernels/triton_lora.py) takes
the same arguments: `add_lora(out, x, lora_a, lora_b, scalings, batch)` adds, for every token t
whose slot s = batch.token_slots[t] is not -1, scalings[s] * lora_b[s] @ (lora_a[s] @ x[t]) to
out[t], in place. Layout of one target module's adapter slots:
- lora_a [num_slots, max_rank, in_features]: A of the adapter in slot s in rows :rank; rows past
  its rank are zero (so an adapter of lower rank than the slots' needs no mask),
- lora_b [num_slots, out_features, max_rank]: B in columns :rank, zero past it,
- scalings [num_slots] fp32: PEFT's lora_alpha / rank of the adapter in slot s.

The grouping is built once per step on the host (the runner knows every sequence's adapter) and
shared by every layer and target module: the tokens with an adapter, sorted by slot (stable, so
a sequence's tokens stay in order), the start of each slot's run, and on the host the group count
and longest group, which size the Triton grid without reading anything back from the device.
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
