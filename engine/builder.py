"""Assembles an engine from its config: model, kernels, KV pools, runner, sampler, executor, and
the policies' scheduler (by name, or the caller's own object)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import use_paged_attention
from engine.config import EngineConfig
from engine.executor import EngineExecutor
from engine.kv_cache import KVCachePool, hardware_spec, num_device_blocks, num_host_blocks
from engine.model_loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from kernels import get_kernel_ops
from policies.batching import (ChunkedPrefillScheduler, ContinuousBatchingScheduler,
                               StaticBatchingScheduler)
from policies.memory import PagedBlockManager
from policies.preemption import RecomputePreemption, SwapPreemption

SCHEDULERS = {"static": StaticBatchingScheduler, "continuous": ContinuousBatchingScheduler,
              "chunked_prefill": ChunkedPrefillScheduler}
PREEMPTIONS = {"recompute": RecomputePreemption, "swap": SwapPreemption}
CHUNKED_PREFILL_TOKEN_BUDGET = 2048  # conf/scheduler/chunked_prefill.yaml's


@dataclass
class Engine:
    loaded: LoadedModel
    scheduler: object
    executor: EngineExecutor
    max_model_len: int
    device: torch.device


def resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def build_engine(config: EngineConfig) -> Engine:
    device = resolve_device(config.device)
    loaded = load_model(config.model, device, config.dtype, config.seed)
    spec = loaded.spec
    max_model_len = config.max_model_len or spec.max_model_len
    if max_model_len > spec.max_model_len:
        raise ValueError(f"max_model_len={max_model_len} exceeds {spec.name}'s "
                         f"{spec.max_model_len} positions")
    scheduler = config.scheduler
    if isinstance(scheduler, str):
        scheduler = build_scheduler(config, loaded, device, max_model_len)
    kv_cache = scheduler.kv_cache
    executor = build_executor(loaded, kv_cache.num_blocks, kv_cache.num_host_blocks,
                              kv_cache.block_size, device, config.seed, config.kernel_backend)
    return Engine(loaded, scheduler, executor, max_model_len, device)


def build_scheduler(config: EngineConfig, loaded: LoadedModel, device: torch.device,
                    max_model_len: int):
    if config.scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {', '.join(SCHEDULERS)} or a scheduler "
                         f"object, got {config.scheduler!r}")
    preemption = config.preemption
    if isinstance(preemption, str):
        if preemption not in PREEMPTIONS:
            raise ValueError(f"preemption must be one of {', '.join(PREEMPTIONS)} or a "
                             f"PreemptionPolicy object, got {preemption!r}")
        preemption = (SwapPreemption(config.swap_space_gb) if preemption == "swap"
                      else RecomputePreemption())
    budget = config.max_num_batched_tokens
    if budget is None:
        budget = (CHUNKED_PREFILL_TOKEN_BUDGET if config.scheduler == "chunked_prefill"
                  else max(max_model_len, 2048))
    spec = loaded.spec
    num_blocks = config.num_gpu_blocks
    if num_blocks is None:
        num_blocks = num_device_blocks(
            spec, hardware_spec(config.hardware, device), device, config.block_size,
            max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            gpu_memory_utilization=config.gpu_memory_utilization,
            cpu_kv_cache_gb=config.cpu_kv_cache_gb)
    host_blocks = num_host_blocks(spec, config.block_size,
                                  getattr(preemption, "swap_space_gb", 0.0))
    kv_cache = PagedBlockManager(num_blocks, config.block_size, num_host_blocks=host_blocks,
                                 enable_prefix_caching=config.enable_prefix_caching)
    return SCHEDULERS[config.scheduler](kv_cache, preemption, max_num_seqs=config.max_num_seqs,
                                        max_num_batched_tokens=budget,
                                        max_model_len=max_model_len)


def build_executor(loaded: LoadedModel, num_blocks: int, num_host_blocks: int, block_size: int,
                   device: torch.device, seed: int = 0,
                   kernel_backend: str | None = None) -> EngineExecutor:
    """The executor for pools of these sizes (the KV manager's): also what a simulator run with
    backend=engine needs."""
    ops = get_kernel_ops(device, kernel_backend)
    dtype = next(loaded.model.parameters()).dtype
    pool = KVCachePool(loaded.spec, num_blocks, num_host_blocks, block_size, dtype, device, ops)
    use_paged_attention(loaded.model)
    runner = ModelRunner(loaded.model, pool, ops, device)
    return EngineExecutor(runner, pool, Sampler(device, seed), loaded.eos_token_id, device)


def build_engine_executor(model: str, kv_cache, device=None, dtype=None, seed: int = 0,
                          kernel_backend: str | None = None) -> EngineExecutor:
    """An executor whose pools match `kv_cache` (a KV manager: num_blocks, num_host_blocks,
    block_size), for a simulator replica run on the engine (backend=engine)."""
    device = resolve_device(device)
    loaded = load_model(model, device, dtype, seed)
    return build_executor(loaded, kv_cache.num_blocks, kv_cache.num_host_blocks,
                          kv_cache.block_size, device, seed, kernel_backend)
