"""How much of a device's memory the KV cache gets, as vLLM sizes it (weights, the profile run's
activation peak, the rest in blocks), and what moving a block to the host costs: the arithmetic
both backends and all cost models share."""
from __future__ import annotations

import math

from policies.validators import number_in, positive_int, positive_number
from runtime.specs import GB, GIB, HardwareSpec, ModelSpec

# vLLM V1's sampler warm-up bytes per sequence and vocabulary entry, fitted to measured H100 peaks
# (docs/gpu-cost-model.md, "The KV pool").
SAMPLER_PROFILE_BYTES_PER_LOGIT = 38.4


def activation_peak_bytes(model: ModelSpec, max_num_batched_tokens: int, max_num_seqs: int,
                          tensor_parallel_size: int = 1) -> int:
    """Peak activation memory of vLLM's profile run per GPU: the larger of its forward pass
    (alive at the MLP, its widest point; flash attention keeps no score matrix) and its sampler
    warm-up over the whole vocabulary, since the logits are gathered first."""
    tp = tensor_parallel_size
    num_mlp_outputs = 2 if model.mlp == "gated" else 1
    per_token = (
        2 * model.hidden_size
        + (model.q_size + 2 * model.kv_size) // tp + model.hidden_size
        + (num_mlp_outputs + 1) * model.intermediate_size // tp
    ) * model.dtype_bytes
    forward = max_num_batched_tokens * per_token
    hidden_states = max_num_batched_tokens * model.hidden_size * model.dtype_bytes
    sampled_sequences = min(max_num_seqs, max_num_batched_tokens)
    sampler = sampled_sequences * model.vocab_size * SAMPLER_PROFILE_BYTES_PER_LOGIT
    return math.ceil(max(forward, hidden_states + sampler))


def step_token_budget(max_num_batched_tokens: int | None, max_model_len: int,
                      name: str = "max_num_batched_tokens") -> int:
    """Tokens one step may compute: `max_num_batched_tokens`, else vLLM's default without chunked
    prefill, max(max_model_len, 2048), so any allowed prompt fits one step."""
    if max_num_batched_tokens is None:
        return max(max_model_len, 2048)
    return positive_int(name, max_num_batched_tokens)


def kv_bytes_per_block_per_gpu(model: ModelSpec, block_size: int, tensor_parallel_size: int = 1,
                               draft: ModelSpec | None = None) -> int:
    """Bytes of one block of the pool on one GPU: the target's K/V split over the GPUs, and a
    draft model's whole, since it runs unsplit."""
    block_bytes = block_size * model.kv_bytes_per_token_per_gpu(tensor_parallel_size)
    if draft is not None:
        block_bytes += draft.kv_bytes_per_block(block_size)
    return block_bytes


def weight_bytes_per_gpu(model: ModelSpec, tensor_parallel_size: int = 1,
                         expert_parallel_size: int = 1) -> float:
    """The weights one GPU holds: all over tp, a mixture's routed experts over
    max(tp, expert_parallel_size)."""
    tp = tensor_parallel_size
    if expert_parallel_size == 1 or not model.is_moe:
        return model.weight_bytes / tp
    experts = (model.num_layers * model.num_experts * model.expert_parameters
               * model.linear_weight_bytes)
    return (model.weight_bytes - experts) / tp + experts / max(tp, expert_parallel_size)


def kv_cache_num_blocks(model: ModelSpec, hardware: HardwareSpec, block_size: int,
                        gpu_memory_utilization: float = 0.9, tensor_parallel_size: int = 1,
                        max_num_batched_tokens: int | None = None, max_num_seqs: int = 256, *,
                        draft: ModelSpec | None = None, kv_cache_limit_gb: float | None = None,
                        max_model_len: int | None = None, expert_parallel_size: int = 1) -> int:
    """How many KV blocks each GPU's device pool holds, as vLLM sizes its cache:

        (memory × utilisation − reserved − weights per GPU − activation peak) / (KV bytes per block / tp)

    `kv_cache_limit_gb` caps it for the engine on a CPU, where the arithmetic would claim most of
    host RAM.
    """
    positive_int("block_size", block_size)
    number_in("gpu_memory_utilization", gpu_memory_utilization, 0, 1, low_open=True)
    model.check_tensor_parallel_size(tensor_parallel_size)
    max_num_batched_tokens = step_token_budget(max_num_batched_tokens, model.max_model_len)
    positive_int("max_num_seqs", max_num_seqs)

    tp = tensor_parallel_size
    reserved = hardware.reserved_bytes(tp)
    budget = hardware.memory_bytes * gpu_memory_utilization - reserved
    weights = weight_bytes_per_gpu(model, tp, expert_parallel_size)
    activations = activation_peak_bytes(model, max_num_batched_tokens, max_num_seqs, tp)
    free_for_kv = budget - weights - activations
    block_bytes = kv_bytes_per_block_per_gpu(model, block_size, tp)
    num_blocks = int(free_for_kv // block_bytes)
    if num_blocks < 1:
        raise ValueError(
            f"{model.name} does not fit on {hardware.name} at tensor_parallel_size={tp}: "
            f"{gpu_memory_utilization:.0%} of {hardware.memory_gb:g} GiB minus "
            f"{reserved / GIB:g} GiB reserved leaves {budget / GIB:.1f} GiB per GPU, "
            f"weights need {weights / GIB:.1f} GiB and activations {activations / GIB:.1f} GiB, "
            f"leaving no room for one {block_bytes / 2**20:.1f} MiB KV block. "
            f"Raise tensor_parallel_size or gpu_memory_utilization, use a larger device, or "
            f"shrink the activations: they grow with the step's token budget "
            f"({max_num_batched_tokens:,} tokens; scheduler=chunked_prefill or a smaller "
            f"model.max_model_len lowers it) and with the sequences the sampler is profiled "
            f"over (max_num_seqs={max_num_seqs}).")
    if draft is not None:
        block_bytes = kv_bytes_per_block_per_gpu(model, block_size, tp, draft)
        num_blocks = int((free_for_kv - draft.weight_bytes) // block_bytes)
        if num_blocks < 1:
            raise ValueError(f"the draft model {draft.name} leaves no memory for one KV block "
                             f"next to {model.name} on {hardware.name}")
    if kv_cache_limit_gb is not None:
        max_model_len = max_model_len or model.max_model_len
        enough = max_num_seqs * -(-max_model_len // block_size)
        limit = int(kv_cache_limit_gb * GIB // block_bytes)
        num_blocks = max(1, min(num_blocks, enough, limit))
    return num_blocks


def kv_cache_num_host_blocks(model: ModelSpec, block_size: int, swap_space_gb: float,
                             tensor_parallel_size: int = 1, draft: ModelSpec | None = None) -> int:
    """How many blocks each GPU's host swap pool of swap_space_gb GiB holds."""
    block_bytes = model.kv_bytes_per_block(block_size) / tensor_parallel_size
    if draft is not None:
        block_bytes += draft.kv_bytes_per_block(block_size)
    return int(swap_space_gb * GIB // block_bytes)


def offload_seconds_per_block(model: ModelSpec, hardware: HardwareSpec, block_size: int,
                              tensor_parallel_size: int = 1,
                              bandwidth_gbps: float | None = None) -> float:
    """Seconds one block takes between the device and the prefix cache's host tier, at
    `bandwidth_gbps` as achieved or else the spec sheet's host link."""
    if bandwidth_gbps is None:
        bandwidth = hardware.host_to_device_bandwidth
    else:
        bandwidth = positive_number("kv_cache.offload_bandwidth_gbps", bandwidth_gbps) * GB
    return block_size * model.kv_bytes_per_token_per_gpu(tensor_parallel_size) / bandwidth
