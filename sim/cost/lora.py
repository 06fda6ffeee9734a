"""The cost of multi-LoRA serving in a step, for both cost models: the batched adapter matmuls and
the adapter loads over the host link, from the plan's StepLoRA (docs/lora.md derives it)."""
from __future__ import annotations

from collections.abc import Mapping

from policies.lora.spec import MLP_MODULES, LoRASpec
from policies.types import StepLoRA
from runtime.specs import ModelSpec


def lora_parameters_per_rank(spec: LoRASpec, model: ModelSpec) -> int:
    """Adapter parameters of all layers per unit of rank (layers x W); a MoE model's MLP is
    experts, which these adapters do not target."""
    if model.is_moe and any(module in MLP_MODULES for module in spec.target_modules):
        raise ValueError(f"lora.target_modules: {model.name} is a mixture of experts; adapters "
                         f"on its MLP ({', '.join(MLP_MODULES)}) are not modelled, target the "
                         f"attention projections only")
    return model.num_layers * spec.width_per_rank(
        hidden_size=model.hidden_size, q_size=model.q_size, kv_size=model.kv_size,
        intermediate_size=model.intermediate_size)


def lora_adapter_bytes(spec: LoRASpec, model: ModelSpec, lora_id: int) -> int:
    """Bytes of one adapter's A and B in every layer (what a load moves to the device)."""
    return spec.rank(lora_id) * lora_parameters_per_rank(spec, model) * model.dtype_bytes


class LoRAStepCost:
    """Seconds a step's LoRA work adds on one of `tensor_parallel_size` GPUs, at the given
    achieved rates (FLOP/s, device memory bytes/s, host link bytes/s)."""

    __slots__ = ("s_per_token_rank", "s_per_rank_read", "s_per_rank_loaded")

    def __init__(self, spec: LoRASpec, model: ModelSpec, tensor_parallel_size: int,
                 flop_rate: float, byte_rate: float, host_byte_rate: float):
        parameters = lora_parameters_per_rank(spec, model) / tensor_parallel_size
        self.s_per_token_rank = 2 * parameters / flop_rate
        self.s_per_rank_read = parameters * model.dtype_bytes / byte_rate
        self.s_per_rank_loaded = parameters * model.dtype_bytes / host_byte_rate

    def seconds(self, lora: StepLoRA) -> float:
        """A step's adapter matmuls and adapter loads."""
        compute_s = lora.token_rank_sum * self.s_per_token_rank
        memory_s = lora.rank_sum * self.s_per_rank_read
        return (max(compute_s, memory_s)
                + lora.load_rank_sum * self.s_per_rank_loaded)


def lora_step_cost(spec: LoRASpec | Mapping | None, model: ModelSpec, tensor_parallel_size: int,
                   flop_rate: float, byte_rate: float,
                   host_byte_rate: float) -> LoRAStepCost | None:
    """The cost of a LoRA run's steps; None without adapters."""
    if spec is None:
        return None
    return LoRAStepCost(LoRASpec.of(spec), model, tensor_parallel_size, flop_rate, byte_rate,
                        host_byte_rate)
