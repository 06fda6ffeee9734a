"""The engine's settings, one plain dataclass: what `LLM(...)` takes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class EngineConfig:
    # "tiny-llama" (any conf/model name: random weights from its shape) or a local HF folder.
    model: str = "tiny-llama"
    block_size: int = 16
    # None: sized by the simulator's memory arithmetic (sim.core.specs.kv_cache_num_blocks).
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 256
    # None: max(max_model_len, 2048) (a whole prompt fits one step), 2048 for chunked prefill.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None   # None: the model's
    # "static" | "continuous" | "chunked_prefill", or a scheduler object (its kv_cache sizes
    # the pools).
    scheduler: Any = "continuous"
    # "recompute" | "swap", or a PreemptionPolicy object.
    preemption: Any = "recompute"
    swap_space_gb: float = 4.0         # host pool when preempting by swap (vLLM's --swap-space)
    enable_prefix_caching: bool = False
    seed: int = 0                       # weights of a random model, and unseeded sampling
    device: str | None = None           # None: cuda when there is one, else cpu
    dtype: Any = None                   # None: fp32 on CPU, the model's (bf16 for 2-byte) on CUDA
    gpu_memory_utilization: float = 0.9
    # The KV arithmetic assumes a whole device; on CPU the pool is capped at what
    # max_num_seqs sequences of max_model_len tokens need and at this many GiB.
    cpu_kv_cache_gb: float = 0.5
    hardware: str | None = None         # conf/hardware name for the arithmetic; None: measured
    kernel_backend: str | None = None   # None: triton on CUDA, torch on CPU
    # Speculative decoding: "ngram" (prompt lookup), a conf/model name or a local HF checkpoint
    # folder (a draft model with the target's vocabulary); None: off.
    speculative_model: str | None = None
    num_speculative_tokens: int = 0     # k (the most, for "adaptive")
    # "fixed" | "adaptive", or a SpeculationPolicy object.
    speculation: Any = "fixed"
