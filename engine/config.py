"""The engine's settings, one plain dataclass: what `LLM(...)` takes, checked when it is made, each
bad value named as the user wrote it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.speculation.drafters import DEFAULT_LOOKAHEAD_GUESSES, DEFAULT_LOOKAHEAD_WINDOW
from policies.validators import (boolean, non_negative_int, non_negative_number, number_in,
                                 positive_int, positive_number)


@dataclass
class EngineConfig:
    # "tiny-llama" (any conf/model name: random weights from its shape) or a local HF folder.
    model: str = "tiny-llama"
    block_size: int = 16
    # None: sized by the simulator's memory arithmetic (runtime.kv_sizing.kv_cache_num_blocks).
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 256
    # None: the scheduler config's, else max(max_model_len, 2048) so that a prompt fits one step.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None   # None: the model's
    # Each policy as the simulator names it (conf/<group> name, dotted class path, {_target_: ...})
    # or an object used as is.
    scheduler: Any = "continuous"
    preemption: Any = "recompute"
    # Host pool when preempting by swap (vLLM's --swap-space); None: the preemption config's.
    swap_space_gb: float | None = None
    enable_prefix_caching: bool = False
    # GiB of host memory for evicted prefix-cache blocks (kv_cache.offload_gb); 0: off.
    kv_offload_gb: float = 0.0
    seed: int = 0                       # weights of a random model, and unseeded sampling
    device: str | None = None           # None: cuda when there is one, else cpu
    # None: a conf/model entry's dtype_bytes (4: fp32, 2: bf16) on every device; a checkpoint
    # folder's: fp32 on CPU, bf16 for 2-byte weights on CUDA.
    dtype: Any = None
    # On CUDA the KV pool's share of the device's free memory.
    gpu_memory_utilization: float = 0.9
    # The KV arithmetic assumes a whole device, which on CPU would claim most of host RAM.
    cpu_kv_cache_gb: float = 0.5
    hardware: str | None = None         # conf/hardware name for the arithmetic; None: measured
    kernel_backend: str | None = None   # None: triton on CUDA, torch on CPU
    # True: no CUDA graphs for decode steps (engine/cuda_graphs.py), as vLLM's enforce_eager.
    enforce_eager: bool = False
    # "ngram", "medusa", "lookahead", or a draft model (conf/model name or HF checkpoint folder).
    speculative_model: str | None = None
    # The most tokens a step may accept beyond the one it always gains (for trees and lookahead,
    # the policy's size counts the tokens verified instead).
    num_speculative_tokens: int = 0
    speculation: Any = "fixed"
    # A folder of trained heads (scripts/train_medusa.py); None: seeded random heads.
    medusa_heads: str | None = None
    # Medusa's tree: paths of head ranks ([[0], [0, 0], [1]]) or top-k per head ([3, 2, 1]).
    speculation_tree: Any = None
    # Lookahead decoding: window W, n-gram size N (None: k + 1), guesses G verified per step.
    lookahead_window: int = DEFAULT_LOOKAHEAD_WINDOW
    lookahead_ngram: int | None = None
    lookahead_guesses: int = DEFAULT_LOOKAHEAD_GUESSES
    # Asked once per request in generate; the engine's oracle knows max_tokens, not where EOS stops.
    predictor: Any = None
    # The lora config group's keys or a conf/lora name (engine/lora.py); None: the base model alone.
    lora: Any = None

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a conf/model name or a checkpoint folder, got "
                             f"{self.model!r}")
        positive_int("block_size", self.block_size)
        positive_int("max_num_seqs", self.max_num_seqs)
        for name in ("num_gpu_blocks", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) is not None:
                positive_int(name, getattr(self, name))
        if self.swap_space_gb is not None:
            non_negative_number("swap_space_gb", self.swap_space_gb)
        boolean("enable_prefix_caching", self.enable_prefix_caching)
        non_negative_number("kv_offload_gb", self.kv_offload_gb)
        if self.kv_offload_gb and not self.enable_prefix_caching:
            raise ValueError("kv_offload_gb needs enable_prefix_caching=True: the host tier holds "
                             "evicted prefix-cache blocks")
        boolean("enforce_eager", self.enforce_eager)
        non_negative_int("seed", self.seed)
        number_in("gpu_memory_utilization", self.gpu_memory_utilization, 0, 1, low_open=True)
        positive_number("cpu_kv_cache_gb", self.cpu_kv_cache_gb)
        non_negative_int("num_speculative_tokens", self.num_speculative_tokens)
        for name in ("hardware", "kernel_backend"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a name (a string) or None, got {value!r}")
