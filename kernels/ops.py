"""KernelOps: what a kernel backend module provides, apart from the dispatcher so that the
backends import it without importing their package."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class KernelOps:
    """The operations the engine calls, from one implementation: each backend module describes
    itself with one (its KERNEL_OPS), checked when it is made."""

    name: str
    write_kv_cache: Callable
    paged_attention: Callable
    copy_blocks: Callable
    swap_blocks: Callable
    # Optional: work shared by every layer of a step, made once per step and passed to
    # paged_attention(..., plan=...) (the torch path's tiling). None: nothing to share.
    plan_attention: Callable | None = None
    # Whether paged_attention takes the step's max_query_len and max_seq_len (host ints, from
    # the runner) so that it reads nothing back from the device (the Triton path).
    takes_host_lengths: bool = False
    # Optional: warm_up(num_heads, num_kv_heads, head_dim, block_size, dtype, device) compiles
    # every kernel variant a run launches, before the run (the Triton path).
    warm_up: Callable | None = None
    # Optional: add_lora(out, x, lora_a, lora_b, scalings, batch) adds each token's adapter
    # delta to a target module's output (kernels/lora_batch.py). None: no multi-LoRA serving.
    add_lora: Callable | None = None

    def __post_init__(self):
        required = {"write_kv_cache": self.write_kv_cache,
                    "paged_attention": self.paged_attention,
                    "copy_blocks": self.copy_blocks, "swap_blocks": self.swap_blocks}
        optional = {"plan_attention": self.plan_attention, "warm_up": self.warm_up,
                    "add_lora": self.add_lora}
        for name, value in (*required.items(), *optional.items()):
            if not callable(value) and not (value is None and name in optional):
                raise ValueError(f"kernel backend {self.name}: {name} is not callable, got "
                                 f"{type(value).__name__}")
        if not isinstance(self.takes_host_lengths, bool):
            raise ValueError(f"kernel backend {self.name}: takes_host_lengths must be a bool, "
                             f"got {self.takes_host_lengths!r}")
