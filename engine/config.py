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
    # None: sized by the simulator's memory arithmetic (runtime.specs.kv_cache_num_blocks).
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 256
    # None: the scheduler config's (conf/scheduler: 2048 for chunked prefill), else
    # max(max_model_len, 2048) so that a whole prompt fits one step.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None   # None: the model's
    # The policies, each as the simulator names them: a conf/<group> name (that file's class and
    # defaults: scheduler static | continuous | chunked_prefill, preemption recompute | swap,
    # speculation fixed | adaptive | none), a dotted class path, a {_target_: ...} mapping, or an
    # object used as is (a scheduler object's kv_cache sizes the pools).
    scheduler: Any = "continuous"
    preemption: Any = "recompute"
    # Host pool when preempting by swap (vLLM's --swap-space); None: the preemption config's.
    swap_space_gb: float | None = None
    enable_prefix_caching: bool = False
    # GiB of host memory for the prefix cache's host tier (kv_cache.offload_gb): evicted cached
    # blocks' K/V go there and come back on a hit. 0: off; needs enable_prefix_caching.
    kv_offload_gb: float = 0.0
    seed: int = 0                       # weights of a random model, and unseeded sampling
    device: str | None = None           # None: cuda when there is one, else cpu
    # None: a conf/model entry's dtype_bytes (4: fp32, 2: bf16) on every device; a checkpoint
    # folder's: fp32 on CPU, bf16 for 2-byte weights on CUDA.
    dtype: Any = None
    # On CUDA the KV pool takes at most this share of the device's free memory, and no more than
    # max_num_seqs sequences of max_model_len tokens need.
    gpu_memory_utilization: float = 0.9
    # The KV arithmetic assumes a whole device; on CPU the pool is capped at what
    # max_num_seqs sequences of max_model_len tokens need and at this many GiB.
    cpu_kv_cache_gb: float = 0.5
    hardware: str | None = None         # conf/hardware name for the arithmetic; None: measured
    kernel_backend: str | None = None   # None: triton on CUDA, torch on CPU
    # On CUDA, decode steps of up to max_num_seqs sequences replay CUDA graphs captured at
    # start (engine/cuda_graphs.py); True runs every step eagerly (vLLM's enforce_eager).
    enforce_eager: bool = False
    # Speculative decoding: "ngram" (prompt lookup), "medusa" (heads on the target), "lookahead"
    # (Jacobi lookahead decoding, greedy only), a conf/model name or a local HF checkpoint
    # folder (a draft model with the target's vocabulary); None: off.
    speculative_model: str | None = None
    # k: the most tokens a step may accept beyond the one it always gains. For a chain of
    # drafts it is the speculation config's num_speculative_tokens (fixed) or
    # max_num_speculative_tokens (adaptive: the most); a Medusa tree is at most k deep,
    # lookahead's n-grams k + 1 long (unless lookahead_ngram is given). For trees and lookahead
    # the policy's size is the tokens a step verifies (tree nodes; (W + G) x (N - 1)).
    num_speculative_tokens: int = 0
    speculation: Any = "fixed"
    # Medusa: a folder of trained heads (scripts/train_medusa.py); None: seeded random heads,
    # k of them. The tree: a list of paths of head ranks ([[0], [0, 0], [1]]) or top-k per head
    # ([3, 2, 1]); None: the speculation config's `tree`, else the default
    # (policies/speculation/trees.py).
    medusa_heads: str | None = None
    speculation_tree: Any = None
    # Lookahead decoding: window W, n-gram size N (None: k + 1), guesses G verified per step.
    lookahead_window: int = DEFAULT_LOOKAHEAD_WINDOW
    lookahead_ngram: int | None = None
    lookahead_guesses: int = DEFAULT_LOOKAHEAD_GUESSES
    # Output-length predictor, asked once per request in generate (predicted_output_len): a
    # conf/predictor name (none | oracle | noisy | bucket), a dotted class path, a mapping or an
    # object; None: no prediction. The engine's oracle knows max_tokens, not where EOS stops.
    predictor: Any = None
    # Multi-LoRA serving (engine/lora.py): the lora config group's keys as a mapping
    # (num_adapters, ranks, alpha, target_modules, max_loras, ...) or a conf/lora name; None:
    # the base model alone. generate(lora_id=...) picks each request's adapter.
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
