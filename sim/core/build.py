"""Builds a replica's parts from its settings (sim/core/settings.py) and policy groups: the
router, the KV pools' sizes and the executor."""
from __future__ import annotations

import statistics

from omegaconf import DictConfig

from policies.checks import has_capability
from policies.lora.spec import lora_config
from policies.protocols import ReportsSpeed
from policies.speculation.drafters import drafter_kind
from sim.core.executor import SimExecutor
from sim.cost.build import build_cost_model, group_name, takes_argument
from runtime.policy_config import build_policy, policy_config
from runtime.specs import HardwareSpec, ModelSpec
from runtime.kv_sizing import kv_cache_num_blocks, kv_cache_num_host_blocks
from sim.core.settings import ReplicaSettings


def build_router(router_cfg):
    """`cluster.router`: a conf/router name, a dotted class path, or a {_target_: ...} mapping."""
    return build_policy(policy_config(router_cfg, "router", "cluster.router"), "cluster.router")


def num_kv_blocks(settings: ReplicaSettings, hardware: HardwareSpec) -> int:
    """`kv_cache.num_blocks` when set (to force preemption), else the memory arithmetic, with a
    draft model's K/V in every block and the backend's own sizing (`backend.kv_cache_sizing`)."""
    if settings.num_blocks is not None:
        return settings.num_blocks
    return kv_cache_num_blocks(
        settings.gpu_model, hardware, settings.block_size,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        tensor_parallel_size=settings.tensor_parallel_size,
        max_num_batched_tokens=settings.max_num_batched_tokens, draft=_draft_kv(settings),
        expert_parallel_size=settings.expert_parallel_size, **settings.kv_cache_sizing)


def kv_cache_sizes(settings: ReplicaSettings, num_blocks: int, preemption) -> dict:
    """A replica's KV manager's pool sizes: `num_blocks`, its host swap pool (the preemption
    policy's swap_space_gb) and, with `kv_cache.offload_gb`, the prefix cache's host tier of
    that many GiB, each over one block's K/V, a draft model's included."""
    def host_blocks(gib: float) -> int:
        return kv_cache_num_host_blocks(settings.gpu_model, settings.block_size, gib,
                                        settings.tensor_parallel_size, draft=_draft_kv(settings))

    offload = {}
    if settings.offload_gb:
        offload["num_offload_blocks"] = host_blocks(settings.offload_gb)
    return dict(num_blocks=num_blocks, num_host_blocks=host_blocks(preemption.swap_space_gb),
                **offload)


def _draft_kv(settings: ReplicaSettings) -> ModelSpec | None:
    return None if settings.speculation is None else settings.speculation.draft_kv


def build_replica_executor(cfg: DictConfig, settings: ReplicaSettings, model: ModelSpec,
                           hardware: HardwareSpec, kv_cache, replica_id: int = 0):
    """Who runs a step: the executor the backend's config names (`backend.executor`, e.g. the
    real engine, whose pools match the replica's KV manager), else the cost model (sim)."""
    speculation = settings.speculation
    executor_cfg = cfg.backend.get("executor")
    if executor_cfg is not None:
        drafting = {} if speculation is None else {
            "speculative_model": speculation.draft_model,
            "max_num_speculative_tokens": speculation.max_num_speculative_tokens}
        if speculation is not None and speculation.tree is not None:
            drafting["tree"] = speculation.executor_tree()
        return build_policy(executor_cfg, "backend.executor", model=model.name,
                            kv_cache=kv_cache, **drafting)
    if cfg.backend.name != "sim":
        raise ValueError(f"backend must be sim or name its executor (backend.executor); got "
                         f"backend.name={cfg.backend.name!r}")
    drafting = {} if speculation is None else {"draft_model": speculation.draft_spec}
    lora = lora_config(cfg.get("lora"))
    if lora is not None:   # only a LoRA run passes `lora`: a cost model of its own need not know
        if not takes_argument(cfg.cost_model, "lora"):
            raise ValueError(f"lora: cost_model={group_name(cfg.cost_model)} does not cost LoRA "
                             f"adapters (it takes no `lora` argument); use cost_model=gpu or "
                             f"cost_model=roofline, or lora=none")
        drafting["lora"] = lora.spec
    if speculation is not None and drafter_kind(speculation.draft_model).draft_cost == "heads":
        drafting["medusa_num_heads"] = max(speculation.depth_per_size)
    cost_model = build_cost_model(cfg.cost_model, settings, model, hardware, **drafting)
    if speculation is None:
        return SimExecutor(cost_model, repeated_steps=settings.repeated_steps)
    # Each replica draws its own acceptances, reproducibly.
    return SimExecutor(cost_model, speculation.acceptance_model([settings.sim_seed, replica_id]),
                       speculation.depth_per_size, repeated_steps=settings.repeated_steps)


def speed_summary(executors: list) -> dict:
    """An engine run normalised to a profile's machine speed (backend.speed_reference): the
    speed factors its probes saw, over every replica, and the wall time they took."""
    summaries = [executor.speed_summary() for executor in executors
                 if has_capability(executor, ReportsSpeed, "executor")]
    if not summaries:
        return {}
    summary = {"speed_factor_median": statistics.median(s["speed_factor_median"]
                                                        for s in summaries),
               "speed_factor_p05": min(s["speed_factor_p05"] for s in summaries),
               "speed_factor_p95": max(s["speed_factor_p95"] for s in summaries),
               "speed_probes": sum(s["speed_probes"] for s in summaries),
               "speed_probe_s": sum(s["speed_probe_s"] for s in summaries)}
    prefill = [s for s in summaries if "prefill_speed_factor_medians" in s]
    if prefill:   # the profile's reference has prefill probes (and prompts ran)
        summary["prefill_speed_factor_medians"] = [
            statistics.median(medians) for medians in zip(*(s["prefill_speed_factor_medians"]
                                                             for s in prefill))]
        summary["prefill_speed_probes"] = sum(s["prefill_speed_probes"] for s in prefill)
    return summary


def lora_summary(managers: list) -> dict:
    """The replicas' LoRA managers' counts, summed (the most adapters in a step: the largest);
    {} when the run serves no adapters."""
    summaries = [manager.summary() for manager in managers]
    if not summaries:
        return {}
    return {key: (max if key.startswith("lora_max") else sum)(s[key] for s in summaries)
            for key in summaries[0]}
