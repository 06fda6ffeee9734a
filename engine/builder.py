"""Assembles an engine from its config: model, kernels, KV pools, runner, sampler, executor,
drafter, and the policies, named as the simulator names them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from engine.attention import use_paged_attention
from engine.config import EngineConfig
from engine.cuda_graphs import DEFAULT_MAX_CAPTURE_SIZE, DecodeGraphs, capture_sizes
from engine.drafters import DraftModelDrafter, NgramDrafter
from engine.executor import EngineExecutor
from engine.kv_cache import KVCachePool, hardware_spec
from engine.lookahead import LookaheadDrafter
from engine.lora import LoRAAdapters, ServedAdapters, lora_adapters, lora_group
from engine.medusa import MedusaDrafter, MedusaHeads
from engine.model_loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.preflight import requested_device
from engine.sampler import Sampler
from kernels import get_kernel_ops
from policies.capabilities import OffloadingKVCache
from policies.checks import check_policy, has_capability
from policies.lora.spec import lora_config
from policies.protocols import BoundedScheduler, Scheduler
from policies.speculation import drafters
from policies.speculation.drafters import Drafter, TreeSpec
from runtime.assembly import (assemble_scheduler, build_predictor, build_preemption,
                              kv_cache_policy_config)
from runtime.policy_config import names_a_policy, policy_config
from runtime.kv_sizing import kv_cache_num_blocks, kv_cache_num_host_blocks, step_token_budget
from runtime.speculation import sized_policy_config, speculation_policy_config, tree_spec
from runtime.step_shapes import GridPoint, build_plan

# The drafters LLM(speculative_model=...) names (any other name is a draft model).
NGRAM, MEDUSA, LOOKAHEAD = drafters.NGRAM.name, drafters.MEDUSA.name, drafters.LOOKAHEAD.name
# The KV manager the engine builds its pools' block tables with (conf/kv_cache).
KV_CACHE_CONFIG = "paged"


def tree_drafter(tree: TreeSpec, loaded: LoadedModel, seed: int = 0) -> Drafter:
    """The drafter of a token-tree method: lookahead's, or Medusa's heads (trained ones from
    tree.medusa_heads, else seeded) on the target's last hidden states."""
    if tree.method == LOOKAHEAD:
        return LookaheadDrafter(tree.lookahead_window, tree.ngram(), tree.lookahead_guesses,
                                seed)
    lm_head = loaded.model.lm_head
    if tree.medusa_heads is None:
        heads = MedusaHeads.seeded(lm_head, tree.max_depth, seed)
    else:
        heads = MedusaHeads.load(tree.medusa_heads, lm_head.weight.device, lm_head.weight.dtype)
        if (heads.hidden_size, heads.vocab_size) != tuple(lm_head.weight.shape[::-1]):
            raise ValueError(f"medusa_heads={tree.medusa_heads!r} were trained for hidden "
                             f"size {heads.hidden_size} and {heads.vocab_size} tokens; the "
                             f"target has {lm_head.weight.shape[1]} and "
                             f"{lm_head.weight.shape[0]}")
    return MedusaDrafter(heads, tree.medusa_paths())


def tree_speculation(config: EngineConfig) -> TreeSpec | None:
    """The config's token-tree method, or None for a chain drafter (or none)."""
    if config.speculative_model not in drafters.TREE_DRAFTERS:
        if config.medusa_heads is not None:
            raise ValueError("medusa_heads needs speculative_model='medusa'")
        return None
    tree = config.speculation_tree
    if tree is None and names_a_policy(config.speculation):
        tree = policy_config(config.speculation, "speculation").get("tree")
    k = config.num_speculative_tokens
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_speculative_tokens must be a positive integer with "
                         f"speculative_model={config.speculative_model!r}, got {k!r}")
    return tree_spec(config.speculative_model, k, {
        "medusa_heads": config.medusa_heads, "tree": tree,
        "lookahead_window": config.lookahead_window, "lookahead_ngram": config.lookahead_ngram,
        "lookahead_guesses": config.lookahead_guesses})


@dataclass
class Engine:
    loaded: LoadedModel
    scheduler: object
    executor: EngineExecutor
    max_model_len: int
    device: torch.device
    predictor: object = None   # a LengthPredictor, or None: no prediction


def resolve_device(device) -> torch.device:
    return requested_device(device, "device")   # CUDA asked for where there is none: one line


def kv_cache_limit_gb(device, cpu_kv_cache_gb: float,
                      gpu_memory_utilization: float = 0.9) -> float:
    """The most GiB of K/V the engine's pool takes on `device`: a share of a GPU's free memory
    (what is held already is not there to take), or cpu_kv_cache_gb on a CPU, where the
    arithmetic would claim most of host RAM."""
    device = resolve_device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return gpu_memory_utilization * free / 2**30
    return cpu_kv_cache_gb


def build_engine(config: EngineConfig) -> Engine:
    # Built first, so that a bad predictor argument fails before the model loads.
    predictor = build_predictor(config.predictor, config.seed)
    device = resolve_device(config.device)
    loaded = load_model(config.model, device, config.dtype, config.seed)
    spec = loaded.spec
    max_model_len = config.max_model_len or spec.max_model_len
    if max_model_len > spec.max_model_len:
        raise ValueError(f"max_model_len={max_model_len} exceeds {spec.name}'s "
                         f"{spec.max_model_len} positions")
    draft = tree_speculation(config) or load_draft(config.speculative_model, loaded, device,
                                                   config.seed, max_model_len)
    scheduler = config.scheduler
    if names_a_policy(scheduler):
        scheduler = build_scheduler(config, loaded, device, max_model_len, draft)
    elif config.speculative_model is not None and config.num_speculative_tokens:
        raise ValueError("with a scheduler object, speculation is the scheduler's own "
                         "(its speculation=...): leave num_speculative_tokens unset")
    else:
        check_policy(scheduler, Scheduler, "scheduler")
    speculation = scheduler.speculation
    max_k = speculation.max_num_speculative_tokens if speculation is not None else 0
    if max_k and draft is None:
        raise ValueError("the scheduler speculates but no speculative_model was given")
    executor = build_scheduler_executor(config, loaded, scheduler, device, draft, max_k,
                                        lora_adapters(config.lora, config.seed))
    return Engine(loaded, scheduler, executor, max_model_len, device, predictor)


def build_scheduler_executor(config: EngineConfig, loaded: LoadedModel, scheduler,
                             device: torch.device, draft=None,
                             max_num_speculative_tokens: int = 0,
                             lora: LoRAAdapters | None = None) -> EngineExecutor:
    """The executor whose pools match `scheduler`'s KV manager, serving `lora`'s adapters."""
    kv_cache = scheduler.kv_cache
    return build_model_executor(loaded, kv_cache.num_blocks, kv_cache.num_host_blocks,
                                kv_cache.block_size, device, config.seed,
                                config.kernel_backend, draft=draft,
                                max_num_speculative_tokens=max_num_speculative_tokens,
                                num_offload_blocks=num_offload_blocks(kv_cache),
                                cuda_graph_max_batch=0 if config.enforce_eager
                                else scheduler.max_num_seqs
                                if has_capability(scheduler, BoundedScheduler, "scheduler")
                                else DEFAULT_MAX_CAPTURE_SIZE, lora=lora)


def num_offload_blocks(kv_cache) -> int:
    """The blocks of the KV manager's prefix-cache host tier (0: it has none)."""
    return (kv_cache.num_offload_blocks if has_capability(kv_cache, OffloadingKVCache, "kv_cache")
            else 0)


def load_draft(speculative_model: str | None, target: LoadedModel, device: torch.device,
               seed: int = 0, max_model_len: int | None = None) -> LoadedModel | str | None:
    """The draft for `speculative_model`: None, "ngram", or a draft model (a conf/model name or
    an HF checkpoint folder) in the target's dtype and vocabulary."""
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


def build_speculation(config: EngineConfig, tree: TreeSpec | None = None):
    """The config's speculation policy: None without a speculative_model, else the named
    policy (conf/speculation) or the config's own policy object."""
    k = config.num_speculative_tokens
    if config.speculative_model is None:
        if k:
            raise ValueError(f"num_speculative_tokens={k!r} needs a speculative_model "
                             f"({NGRAM!r}, a conf/model name or a checkpoint folder)")
        return None
    speculation = config.speculation
    if not names_a_policy(speculation):
        return speculation  # a SpeculationPolicy object
    policy_cfg = speculation_policy_config(policy_config(speculation, "speculation"))
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"num_speculative_tokens must be a positive integer with a "
                         f"speculative_model, got {k!r}")
    if tree is None:
        return sized_policy_config(policy_cfg, k)
    depth_per_size = tree.depth_per_size()
    return sized_policy_config(policy_cfg, len(depth_per_size) - 1, depth_per_size)


def build_scheduler(config: EngineConfig, loaded: LoadedModel, device: torch.device,
                    max_model_len: int, draft: LoadedModel | TreeSpec | str | None = None):
    """The config's scheduler, its preemption policy and KV manager, assembled as the
    simulator's (runtime/assembly.py), the engine's settings over the groups' defaults."""
    scheduler_cfg = policy_config(config.scheduler, "scheduler")
    preemption = build_preemption(config.preemption, config.swap_space_gb)
    budget = config.max_num_batched_tokens
    if budget is None:
        budget = step_token_budget(scheduler_cfg.get("max_num_batched_tokens"), max_model_len,
                                   "scheduler.max_num_batched_tokens")
    spec = loaded.spec
    draft_spec = draft.spec if isinstance(draft, LoadedModel) else None

    def kv_cache_sizes(preemption) -> dict:
        num_blocks = config.num_gpu_blocks
        if num_blocks is None:
            num_blocks = kv_cache_num_blocks(
                spec, hardware_spec(config.hardware, device), config.block_size,
                gpu_memory_utilization=config.gpu_memory_utilization,
                max_num_batched_tokens=budget, max_num_seqs=config.max_num_seqs,
                draft=draft_spec,
                kv_cache_limit_gb=kv_cache_limit_gb(device, config.cpu_kv_cache_gb,
                                                    config.gpu_memory_utilization),
                max_model_len=max_model_len)
        host_blocks = kv_cache_num_host_blocks(spec, config.block_size, preemption.swap_space_gb,
                                               draft=draft_spec)
        # The host tier, sized as the swap pool is (its bandwidth is the simulator's to charge).
        offload_blocks = kv_cache_num_host_blocks(spec, config.block_size, config.kv_offload_gb,
                                                  draft=draft_spec)
        return dict(num_blocks=num_blocks, block_size=config.block_size,
                    num_host_blocks=host_blocks,
                    enable_prefix_caching=config.enable_prefix_caching,
                    num_offload_blocks=offload_blocks)

    return assemble_scheduler(
        scheduler_cfg, preemption,
        kv_cache_policy_config(policy_config(KV_CACHE_CONFIG, "kv_cache")), kv_cache_sizes,
        max_num_batched_tokens=budget, max_model_len=max_model_len,
        max_num_seqs=config.max_num_seqs,
        speculation=build_speculation(config, draft if isinstance(draft, TreeSpec) else None),
        lora=lora_config(lora_group(config.lora)))


def build_model_executor(loaded: LoadedModel, num_blocks: int, num_host_blocks: int,
                         block_size: int, device: torch.device, seed: int = 0,
                         kernel_backend: str | None = None,
                         draft: LoadedModel | TreeSpec | str | None = None,
                         max_num_speculative_tokens: int = 0,
                         num_offload_blocks: int = 0,
                         cuda_graph_max_batch: int = DEFAULT_MAX_CAPTURE_SIZE,
                         lora: LoRAAdapters | None = None) -> EngineExecutor:
    """The executor of a loaded model with KV pools of these sizes, with `draft`'s drafter and
    `lora`'s adapters. On CUDA the kernels are compiled and the decode CUDA graphs captured now,
    so that no timed step pays for them."""
    ops = get_kernel_ops(device, kernel_backend)
    dtype = next(loaded.model.parameters()).dtype
    draft_model = draft if isinstance(draft, LoadedModel) else None
    pool = KVCachePool(loaded.spec, num_blocks, num_host_blocks, block_size, dtype, device, ops,
                       draft_spec=draft_model.spec if draft_model else None,
                       num_offload_blocks=num_offload_blocks)
    use_paged_attention(loaded.model)
    if ops.warm_up is not None and device.type == "cuda":
        # Every kernel variant compiled now, not in the middle of a timed run.
        for spec in [loaded.spec] + ([draft_model.spec] if draft_model else []):
            ops.warm_up(spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim,
                        block_size, dtype, device)
    served = ServedAdapters(loaded.model, lora, ops) if lora is not None else None
    if served is not None and device.type == "cuda":
        served.warm_up()
    decode_graphs = None
    if cuda_graph_max_batch and device.type == "cuda" and ops.takes_host_lengths:
        decode_graphs = DecodeGraphs(loaded.model, pool.target_caches, ops, device,
                                     capture_sizes(cuda_graph_max_batch),
                                     loaded.spec.max_model_len, block_size)
        decode_graphs.capture_all()
    runner = ModelRunner(loaded.model, pool.target_caches, block_size, ops, device,
                         decode_graphs, served)
    sampler = Sampler(device, seed)
    drafter = None
    if draft == NGRAM:
        drafter = NgramDrafter()
    elif isinstance(draft, TreeSpec):
        drafter = tree_drafter(draft, loaded, seed)
    elif draft_model is not None:
        use_paged_attention(draft_model.model)
        drafter = DraftModelDrafter(
            ModelRunner(draft_model.model, pool.draft_caches, block_size, ops, device), sampler)
    if drafter is not None:
        check_policy(drafter, Drafter, "speculative_model")
    if max_num_speculative_tokens and drafter is None:
        raise ValueError(f"max_num_speculative_tokens={max_num_speculative_tokens} needs a "
                         f"draft (a speculative_model)")
    return EngineExecutor(runner, pool, sampler, loaded.eos_token_id, device, drafter,
                          max_num_speculative_tokens,
                          draft.max_depth if isinstance(draft, TreeSpec) else None,
                          drafter.paths if isinstance(drafter, MedusaDrafter) else None)


def warm_up(executor: EngineExecutor, num_blocks: int, block_size: int, max_tokens: int) -> None:
    """Run an untimed prefill as long as the pool holds and a decode batch, so that a timed run's
    first steps pay no one-time costs (allocator growth, kernel set-up) a profiled step did not."""
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


# Builds another executor on the run's loaded model: (num_blocks, block_size) of its own pool.
NewExecutor = Callable[[int, int], EngineExecutor]


def executor_builder(loaded: LoadedModel, device: torch.device, seed: int = 0,
                     kernel_backend: str | None = None) -> NewExecutor:
    """A builder of plain executors (no drafter, no host tier) on the loaded model."""
    def new_executor(num_blocks: int, block_size: int) -> EngineExecutor:
        return build_model_executor(loaded, num_blocks, 0, block_size, device, seed,
                                    kernel_backend)
    return new_executor


class StepTiming(Protocol):
    """How an engine run's steps are timed (calibration's speed normalisation): given the
    warmed-up executor, a builder of further executors and the seed, the executor the run steps."""

    def __call__(self, executor: EngineExecutor, new_executor: NewExecutor, seed: int): ...


def build_engine_executor(model: str, kv_cache, device=None, dtype=None, seed: int = 0,
                          kernel_backend: str | None = None, speculative_model: str | None = None,
                          max_num_speculative_tokens: int = 0,
                          step_timing: StepTiming | None = None,
                          enforce_eager: bool = False,
                          tree: TreeSpec | None = None, lora=None):
    """An executor whose pools match `kv_cache` (a KV manager), for a simulator replica run on
    the engine (backend=engine); `speculative_model` or `tree` add a drafter, `step_timing` times
    the steps its way, `lora` serves the run's adapters."""
    if (speculative_model in drafters.TREE_DRAFTERS) != (tree is not None) or (
            tree is not None and tree.method != speculative_model):
        raise ValueError(f"speculative_model={speculative_model!r} with tree={tree!r}: medusa "
                         f"and lookahead need their TreeSpec, other drafters none")
    device = resolve_device(device)
    loaded = load_model(model, device, dtype, seed)
    draft = tree or load_draft(speculative_model, loaded, device, seed)
    executor = build_model_executor(loaded, kv_cache.num_blocks, kv_cache.num_host_blocks,
                                    kv_cache.block_size, device, seed, kernel_backend,
                                    draft=draft,
                                    max_num_speculative_tokens=max_num_speculative_tokens,
                                    num_offload_blocks=num_offload_blocks(kv_cache),
                                    cuda_graph_max_batch=0 if enforce_eager
                                    else DEFAULT_MAX_CAPTURE_SIZE,
                                    lora=lora_adapters(lora, seed))
    warm_up(executor, kv_cache.num_blocks, kv_cache.block_size, loaded.spec.max_model_len)
    if step_timing is None:
        return executor
    return step_timing(executor, executor_builder(loaded, device, seed, kernel_backend), seed)
