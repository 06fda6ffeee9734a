"""Model and hardware specs as HF configs and spec sheets state them (conf/model, conf/hardware);
the memory arithmetic over them is runtime/kv_sizing.py."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from policies.validators import (boolean, non_negative_int, non_negative_number, number_in,
                                 positive_int, positive_number)

GIB = 1024 ** 3
GB = 1000 ** 3  # bandwidths and FLOP rates on spec sheets are decimal

MLP_KINDS = ("gated", "plain")
BOARDS = ("datacenter", "workstation")
DTYPE_BYTES = (1, 2, 4)  # fp8/int8, fp16/bf16, fp32
QUANTIZATIONS = (None, "fp8", "fp8_block")   # vLLM --quantization of the linear layers' weights
KV_CACHE_DTYPES = ("auto", "fp8")            # vLLM --kv-cache-dtype (auto: the model's dtype)


def _fields_from_config(cls: type, config: Mapping | DictConfig) -> dict[str, Any]:
    """The mapping as plain keyword arguments for `cls`, or a ValueError naming the bad keys."""
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)
    if not isinstance(config, Mapping):
        raise ValueError(f"{cls.__name__}: expected a mapping of fields, got {type(config).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; allowed fields: {sorted(fields)}")
    missing = sorted(name for name, f in fields.items()
                     if name not in config
                     and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
    if missing:
        raise ValueError(f"{cls.__name__}: missing required field(s) {missing}")
    return dict(config)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer's shape. Field names follow the HF Llama config."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    num_key_value_heads: int | None = None  # None: multi-head attention (= num_attention_heads)
    head_dim: int | None = None             # None: hidden_size // num_attention_heads
    dtype_bytes: int = 2
    mlp: str = "gated"                      # "gated": SwiGLU, 3 matrices; "plain": OPT, 2 matrices
    tie_word_embeddings: bool = False
    bias: bool = False                      # biases on every linear layer and LayerNorm (OPT)
    num_position_embeddings: int = 0        # rows of a learned position table (OPT: 2050); 0 = RoPE
    hf_repo: str | None = None              # where the engine finds the weights; unused here
    checkpoint: str | None = None           # a local HF folder the engine loads, else seeded weights
    # Mixture of experts, HF's Mixtral / Qwen-MoE names; 0 experts is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    quantization: str | None = None         # fp8 linear layers; embeddings and LM head keep dtype
    kv_cache_dtype: str = "auto"

    def __post_init__(self):
        owner = f"ModelSpec({self.name!r})"
        for name in ("num_layers", "hidden_size", "num_attention_heads", "intermediate_size",
                     "vocab_size", "max_model_len"):
            positive_int(f"{owner}.{name}", getattr(self, name))
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        positive_int(f"{owner}.num_key_value_heads", self.num_key_value_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{owner}.num_key_value_heads={self.num_key_value_heads} must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"{owner}: hidden_size={self.hidden_size} is not a multiple of "
                                 f"num_attention_heads={self.num_attention_heads}; set head_dim")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        positive_int(f"{owner}.head_dim", self.head_dim)
        if self.dtype_bytes not in DTYPE_BYTES:
            raise ValueError(f"{owner}.dtype_bytes must be one of {DTYPE_BYTES}, got {self.dtype_bytes!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"{owner}.quantization must be one of {list(QUANTIZATIONS)}, "
                             f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"{owner}.kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"{owner}.mlp must be one of {MLP_KINDS}, got {self.mlp!r}")
        for name in ("tie_word_embeddings", "bias"):
            boolean(f"{owner}.{name}", getattr(self, name))
        non_negative_int(f"{owner}.num_position_embeddings", self.num_position_embeddings)
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size"):
            non_negative_int(f"{owner}.{name}", getattr(self, name))
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"{owner}.num_experts_per_tok={self.num_experts_per_tok} must be "
                                 f"between 1 and num_experts={self.num_experts}")
            positive_int(f"{owner}.moe_intermediate_size", self.moe_intermediate_size)
            if self.mlp != "gated" or self.bias:
                raise ValueError(f"{owner}: experts are gated MLPs without biases (mlp: gated, "
                                 f"bias: false)")
        elif self.num_experts_per_tok or self.moe_intermediate_size \
                or self.shared_expert_intermediate_size:
            raise ValueError(f"{owner}: num_experts_per_tok, moe_intermediate_size and "
                             f"shared_expert_intermediate_size need num_experts > 0")

    @classmethod
    def from_config(cls, config: Mapping | DictConfig) -> ModelSpec:
        return cls(**_fields_from_config(cls, config))

    # --- parameter counts -------------------------------------------------------------------

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_parameters_per_layer(self) -> int:
        """q, k, v and o projections, biases included."""
        h = self.hidden_size
        attention = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.bias:
            attention += self.q_size + 2 * self.kv_size + h
        return attention

    @property
    def expert_parameters(self) -> int:
        """One routed expert's gate, up and down matrices (0 for a dense model)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def always_active_mlp_parameters_per_layer(self) -> int:
        """The MLP weights every token runs through (a mixture's router and shared experts)."""
        h = self.hidden_size
        if self.is_moe:
            return h * self.num_experts + 3 * h * self.shared_expert_intermediate_size
        num_mlp_matrices = 3 if self.mlp == "gated" else 2
        mlp = num_mlp_matrices * h * self.intermediate_size
        if self.bias:
            mlp += (num_mlp_matrices - 1) * self.intermediate_size + h
        return mlp

    @property
    def linear_parameters_per_layer(self) -> int:
        """What one layer's matrix multiplies hold in memory, every expert counted."""
        return (self.attention_parameters_per_layer + self.always_active_mlp_parameters_per_layer
                + self.num_experts * self.expert_parameters)

    @property
    def active_linear_parameters_per_layer(self) -> int:
        """The weights one token's matrix multiplies run through (`num_experts_per_tok` experts)."""
        return (self.attention_parameters_per_layer + self.always_active_mlp_parameters_per_layer
                + self.num_experts_per_tok * self.expert_parameters)

    @property
    def norm_parameters_per_layer(self) -> int:
        # Two norms per layer; LayerNorm (OPT) has a bias, RMSNorm (Llama) has not.
        return 2 * self.hidden_size * (2 if self.bias else 1)

    @property
    def lm_head_parameters(self) -> int:
        """The output projection's size, read every step even when tied to the embedding."""
        return self.vocab_size * self.hidden_size

    @property
    def num_parameters(self) -> int:
        """As `model.num_parameters()` counts them in transformers (tied weights counted once)."""
        embeddings = (self.vocab_size + self.num_position_embeddings) * self.hidden_size
        layers = self.num_layers * (self.linear_parameters_per_layer + self.norm_parameters_per_layer)
        final_norm = self.hidden_size * (2 if self.bias else 1)
        lm_head = 0 if self.tie_word_embeddings else self.lm_head_parameters
        return embeddings + layers + final_norm + lm_head

    @property
    def linear_weight_bytes(self) -> int:
        """Bytes of one parameter of a linear layer (q, k, v, o, MLP, experts)."""
        return 1 if self.quantization else self.dtype_bytes

    @property
    def kv_dtype_bytes(self) -> int:
        return 1 if self.kv_cache_dtype == "fp8" else self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        linear = self.num_layers * self.linear_parameters_per_layer
        return ((self.num_parameters - linear) * self.dtype_bytes
                + linear * self.linear_weight_bytes)

    # --- KV cache -----------------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """Key and value for every layer: 2 × layers × kv_heads × head_dim × dtype bytes."""
        return 2 * self.num_layers * self.num_key_value_heads * self.head_dim * self.kv_dtype_bytes

    def kv_bytes_per_block(self, block_size: int) -> int:
        positive_int("block_size", block_size)
        return block_size * self.kv_bytes_per_token

    def kv_heads_per_gpu(self, tensor_parallel_size: int) -> int:
        """KV heads each GPU stores, at least one since vLLM replicates them when tp exceeds their
        number."""
        return max(1, math.ceil(self.num_key_value_heads / tensor_parallel_size))

    def kv_bytes_per_token_per_gpu(self, tensor_parallel_size: int) -> int:
        return (2 * self.num_layers * self.kv_heads_per_gpu(tensor_parallel_size)
                * self.head_dim * self.kv_dtype_bytes)

    def check_tensor_parallel_size(self, tensor_parallel_size: int) -> None:
        """vLLM's rule: attention heads split evenly over the GPUs."""
        positive_int("tensor_parallel_size", tensor_parallel_size)
        if self.num_attention_heads % tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must divide "
                             f"{self.name}'s num_attention_heads={self.num_attention_heads}")


@dataclass(frozen=True)
class HardwareSpec:
    """One accelerator (or a CPU socket) as its spec sheet states it."""

    name: str
    memory_gb: float              # device memory in GiB, as the driver reports its total
    peak_tflops: float            # dense fp16/bf16 tensor-core TFLOP/s (fp32 for a CPU)
    memory_bandwidth_gbps: float  # device memory bandwidth, GB/s
    host_to_device_gbps: float    # one direction of the host link (PCIe), GB/s: swap traffic
    interconnect_gbps: float      # one direction of the GPU-GPU link (NVLink), GB/s: TP all-reduce
    reserved_memory_gb: float = 0.0    # held outside torch (cuBLAS), off vLLM's pool
    collective_memory_gb: float = 0.0  # more outside torch at tp > 1 (NCCL, custom all-reduce)
    # A workstation board (GDDR, boost clocks) reaches a different share of its spec-sheet rates
    # than the datacenter boards the GPU cost model's tables come from.
    board: str = "datacenter"
    compute_efficiency: float = 1.0    # GEMM share of spec FLOP/s, relative to the tables' boards
    # Watts (docs/energy.md); 0 and 0: not stated, energy reads 0.
    idle_power_w: float = 0.0
    max_power_w: float = 0.0

    def __post_init__(self):
        owner = f"HardwareSpec({self.name!r})"
        positive_number(f"{owner}.compute_efficiency", self.compute_efficiency)
        non_negative_number(f"{owner}.max_power_w", self.max_power_w)
        number_in(f"{owner}.idle_power_w", self.idle_power_w, 0, self.max_power_w)
        for name in ("memory_gb", "peak_tflops", "memory_bandwidth_gbps", "host_to_device_gbps",
                     "interconnect_gbps"):
            positive_number(f"{owner}.{name}", getattr(self, name))
        # What the runtime holds must leave some memory.
        number_in(f"{owner}.reserved_memory_gb", self.reserved_memory_gb, 0, self.memory_gb,
                  high_open=True)
        number_in(f"{owner}.collective_memory_gb", self.collective_memory_gb, 0,
                  self.memory_gb - self.reserved_memory_gb, high_open=True)
        if self.board not in BOARDS:
            raise ValueError(f"{owner}.board must be one of {BOARDS}, got {self.board!r}")

    @classmethod
    def from_config(cls, config: Mapping | DictConfig) -> HardwareSpec:
        return cls(**_fields_from_config(cls, config))

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * GIB

    def reserved_bytes(self, tensor_parallel_size: int = 1) -> float:
        """What vLLM takes off one GPU's pool for memory held outside torch at this tp."""
        collective = self.collective_memory_gb if tensor_parallel_size > 1 else 0.0
        return (self.reserved_memory_gb + collective) * GIB

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    @property
    def memory_bandwidth(self) -> float:
        return self.memory_bandwidth_gbps * GB

    @property
    def host_to_device_bandwidth(self) -> float:
        return self.host_to_device_gbps * GB

    @property
    def interconnect_bandwidth(self) -> float:
        return self.interconnect_gbps * GB
