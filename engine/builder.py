"""Assembles an engine from its config: model, kernels, KV pools, runner, sampler, executor, and
the policies' scheduler (by name, or the caller's own object); with speculative decoding also
the drafter (a draft model or n-gram lookup) and the speculation policy."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import use_paged_attention
from engine.config import EngineConfig
from engine.drafters import DraftModelDrafter, NgramDrafter
from engine.executor import EngineExecutor
from engine.kv_cache import KVCachePool, hardware_spec, num_device_blocks, num_host_blocks
from engine.model_loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from engine.speed import (DEFAULT_INTERVAL_S, PROBE_POINT, PROBE_POOL_BLOCKS,
                          SpeedNormalizedExecutor, SpeedProbe, SpeedReference)
from engine.step_shapes import GridPoint, build_plan
from kernels import get_kernel_ops
from policies.batching import (ChunkedPrefillScheduler, ContinuousBatchingScheduler,
                               StaticBatchingScheduler)
from policies.memory import PagedBlockManager
from policies.preemption import RecomputePreemption, SwapPreemption
from policies.speculation import AdaptiveSpeculation, FixedSpeculation

SCHEDULERS = {"static": StaticBatchingScheduler, "continuous": ContinuousBatchingScheduler,
              "chunked_prefill": ChunkedPrefillScheduler}
PREEMPTIONS = {"recompute": RecomputePreemption, "swap": SwapPreemption}
SPECULATIONS = {"fixed": FixedSpeculation, "adaptive": AdaptiveSpeculation}
NGRAM = "ngram"
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
    draft = load_draft(config.speculative_model, loaded, device, config.seed, max_model_len)
    scheduler = config.scheduler
    if isinstance(scheduler, str):
        scheduler = build_scheduler(config, loaded, device, max_model_len, draft)
    elif config.speculative_model is not None and config.num_speculative_tokens:
        raise ValueError("with a scheduler object, speculation is the scheduler's own "
                         "(its speculation=...): leave num_speculative_tokens unset")
    speculation = getattr(scheduler, "speculation", None)
    max_k = speculation.max_num_speculative_tokens if speculation is not None else 0
    if max_k and draft is None:
        raise ValueError("the scheduler speculates but no speculative_model was given")
    kv_cache = scheduler.kv_cache
    executor = build_executor(loaded, kv_cache.num_blocks, kv_cache.num_host_blocks,
                              kv_cache.block_size, device, config.seed, config.kernel_backend,
                              draft=draft, max_num_speculative_tokens=max_k)
    return Engine(loaded, scheduler, executor, max_model_len, device)


def load_draft(speculative_model: str | None, target: LoadedModel, device: torch.device,
               seed: int = 0, max_model_len: int | None = None) -> LoadedModel | str | None:
    """The draft for `speculative_model`: None, "ngram", or a model (a conf/model name with
    seeded random weights, or a local HF checkpoint folder) loaded in the target's dtype, with
    the target's vocabulary."""
    if speculative_model is None or speculative_model == NGRAM:
        return speculative_model
    if not isinstance(speculative_model, str):
        raise ValueError(f"speculative_model must be None, {NGRAM!r}, a conf/model name or a "
                         f"checkpoint folder, got {speculative_model!r}")
    dtype = next(target.model.parameters()).dtype
    draft = load_model(speculative_model, device, dtype, seed)
    if draft.spec.vocab_size != target.spec.vocab_size:
        raise ValueError(f"speculative_model={speculative_model!r} has a vocabulary of "
                         f"{draft.spec.vocab_size} tokens, the target {target.spec.vocab_size}: "
                         f"a draft model must share the target's vocabulary")
    max_model_len = max_model_len or target.spec.max_model_len
    if draft.spec.max_model_len < max_model_len:
        raise ValueError(f"speculative_model={speculative_model!r} has "
                         f"{draft.spec.max_model_len} positions, fewer than max_model_len="
                         f"{max_model_len}")
    return draft


def build_speculation(config: EngineConfig):
    """The speculation policy of the config: None without a speculative_model; else "fixed"
    or "adaptive" up to num_speculative_tokens, or the config's own policy object."""
    k = config.num_speculative_tokens
    if config.speculative_model is None:
        if k:
            raise ValueError(f"num_speculative_tokens={k!r} needs a speculative_model "
                             f"({NGRAM!r}, a conf/model name or a checkpoint folder)")
        return None
    speculation = config.speculation
    if not isinstance(speculation, str):
        return speculation  # a SpeculationPolicy object
    if speculation not in SPECULATIONS:
        raise ValueError(f"speculation must be one of {', '.join(SPECULATIONS)} or a "
                         f"SpeculationPolicy object, got {speculation!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_speculative_tokens must be a positive integer with a "
                         f"speculative_model, got {k!r}")
    return SPECULATIONS[speculation](k)


def build_scheduler(config: EngineConfig, loaded: LoadedModel, device: torch.device,
                    max_model_len: int, draft: LoadedModel | str | None = None):
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
    draft_spec = draft.spec if isinstance(draft, LoadedModel) else None
    num_blocks = config.num_gpu_blocks
    if num_blocks is None:
        num_blocks = num_device_blocks(
            spec, hardware_spec(config.hardware, device), device, config.block_size,
            max_num_seqs=config.max_num_seqs, max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            gpu_memory_utilization=config.gpu_memory_utilization,
            cpu_kv_cache_gb=config.cpu_kv_cache_gb, draft_spec=draft_spec)
    host_blocks = num_host_blocks(spec, config.block_size,
                                  getattr(preemption, "swap_space_gb", 0.0), draft_spec)
    kv_cache = PagedBlockManager(num_blocks, config.block_size, num_host_blocks=host_blocks,
                                 enable_prefix_caching=config.enable_prefix_caching)
    return SCHEDULERS[config.scheduler](kv_cache, preemption, max_num_seqs=config.max_num_seqs,
                                        max_num_batched_tokens=budget,
                                        max_model_len=max_model_len,
                                        speculation=build_speculation(config))


def build_executor(loaded: LoadedModel, num_blocks: int, num_host_blocks: int, block_size: int,
                   device: torch.device, seed: int = 0, kernel_backend: str | None = None,
                   draft: LoadedModel | str | None = None,
                   max_num_speculative_tokens: int = 0) -> EngineExecutor:
    """The executor for pools of these sizes (the KV manager's): also what a simulator run with
    backend=engine needs. `draft` (load_draft's): the drafter of speculative decoding, for
    plans of up to max_num_speculative_tokens drafts per sequence."""
    ops = get_kernel_ops(device, kernel_backend)
    dtype = next(loaded.model.parameters()).dtype
    draft_model = draft if isinstance(draft, LoadedModel) else None
    pool = KVCachePool(loaded.spec, num_blocks, num_host_blocks, block_size, dtype, device, ops,
                       draft_spec=draft_model.spec if draft_model else None)
    use_paged_attention(loaded.model)
    runner = ModelRunner(loaded.model, pool.target_caches, block_size, ops, device)
    sampler = Sampler(device, seed)
    drafter = None
    if draft == NGRAM:
        drafter = NgramDrafter()
    elif draft_model is not None:
        use_paged_attention(draft_model.model)
        drafter = DraftModelDrafter(
            ModelRunner(draft_model.model, pool.draft_caches, block_size, ops, device), sampler)
    if max_num_speculative_tokens and drafter is None:
        raise ValueError(f"max_num_speculative_tokens={max_num_speculative_tokens} needs a "
                         f"draft (a speculative_model)")
    return EngineExecutor(runner, pool, sampler, loaded.eos_token_id, device, drafter,
                          max_num_speculative_tokens)


def warm_up(executor: EngineExecutor, num_blocks: int, block_size: int, max_tokens: int) -> None:
    """Run an untimed prefill as long as the pool holds (up to max_tokens) and a decode batch, so
    that a timed run's first steps do not pay one-time costs (allocator growth, kernel set-up)
    that no profiled step paid: measured, a cold first step of 13 prompts took 250-290 ms where
    it takes ~210 ms warm. The blocks it writes hold nothing a sequence reads: each one writes
    its own K/V before attending to it."""
    chunk = min(max_tokens, (num_blocks - 1) * block_size)
    if chunk < 1:
        return
    rng = np.random.default_rng(0)
    executor.execute(build_plan(GridPoint(0, "prefill", block_size, prefills=((chunk, 0),)),
                                rng, num_blocks, 0))
    batch = min(32, (num_blocks - 1) // 2)
    if batch:
        executor.execute(build_plan(GridPoint(0, "decode", block_size,
                                              decodes=(block_size,) * batch), rng, num_blocks, 0))


def build_speed_probe(loaded: LoadedModel, device: torch.device, seed: int = 0,
                      kernel_backend: str | None = None,
                      interval_s: float = DEFAULT_INTERVAL_S) -> SpeedProbe:
    """A speed probe (engine/speed.py) of the loaded model, on an executor of its own."""
    executor = build_executor(loaded, PROBE_POOL_BLOCKS, 0, PROBE_POINT.block_size, device,
                              seed, kernel_backend)
    return SpeedProbe(executor, interval_s, seed)


def build_engine_executor(model: str, kv_cache, device=None, dtype=None, seed: int = 0,
                          kernel_backend: str | None = None, speculative_model: str | None = None,
                          max_num_speculative_tokens: int = 0,
                          speed_reference: SpeedReference | None = None):
    """An executor whose pools match `kv_cache` (a KV manager: num_blocks, num_host_blocks,
    block_size), for a simulator replica run on the engine (backend=engine); with a
    speculative_model ("ngram", a conf/model name or a checkpoint folder) it verifies plans of
    up to max_num_speculative_tokens drafts per sequence. With a speed_reference (a profile's
    speed reference) its step durations are normalised to the profile's machine speed."""
    device = resolve_device(device)
    loaded = load_model(model, device, dtype, seed)
    draft = load_draft(speculative_model, loaded, device, seed)
    executor = build_executor(loaded, kv_cache.num_blocks, kv_cache.num_host_blocks,
                              kv_cache.block_size, device, seed, kernel_backend, draft=draft,
                              max_num_speculative_tokens=max_num_speculative_tokens)
    warm_up(executor, kv_cache.num_blocks, kv_cache.block_size, loaded.spec.max_model_len)
    if speed_reference is None:
        return executor
    return SpeedNormalizedExecutor(executor, build_speed_probe(loaded, device, seed,
                                                               kernel_backend), speed_reference)
