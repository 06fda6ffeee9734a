"""Builds a run's parts from its Hydra config: policies (`_target_` classes, the built-in ones and
a user's own), the router, the length predictor, the step token budget, the KV pools' sizes, the
speculation setup and the replica's executor. The engine (`LLM(...)`) names and builds its
policies with the same functions, from the same conf/ groups."""
from __future__ import annotations

import statistics

from omegaconf import DictConfig

from policies.checks import has_capability
from policies.lora.spec import lora_config
from policies.protocols import ReportsSpeed
from policies.speculation.drafters import drafter_kind
from policies.validators import (boolean, finite_number, non_negative_int, non_negative_number,
                                 positive_int, positive_number)
from sim.core.executor import SimExecutor
from runtime.metrics.summary import DEFAULT_FAIRNESS_WINDOW_S
from sim.cost.build import build_cost_model, expert_parallel_size, group_name, takes_argument
from sim.cost.pipeline import gpu_model
from runtime.policy_config import build_policy, policy_config
from runtime.specs import (HardwareSpec, ModelSpec, kv_cache_num_blocks,
                            kv_cache_num_host_blocks, step_token_budget)
from sim.core.speculation_setup import SpeculationSetup, speculation_setup


def build_router(router_cfg):
    """`cluster.router`: a conf/router name, a dotted class path, or a {_target_: ...} mapping."""
    return build_policy(policy_config(router_cfg, "router", "cluster.router"), "cluster.router")


def check_run_settings(cfg: DictConfig) -> None:
    """The run's own settings, checked before anything is built."""
    non_negative_int("seed", cfg.seed)
    if cfg.get("sim_seed") is not None:
        non_negative_int("sim_seed", cfg.sim_seed)
    positive_int("cluster.num_replicas", cfg.cluster.num_replicas)
    positive_int("cluster.tensor_parallel_size", cfg.cluster.tensor_parallel_size)
    if cfg.backend.get("preflight") is not None:   # the backend's own check (engine/preflight.py)
        build_policy(cfg.backend.preflight, "backend.preflight")


def max_num_batched_tokens(cfg: DictConfig, model: ModelSpec) -> int:
    """The step token budget (null: big enough for any prompt the model allows)."""
    return step_token_budget(cfg.scheduler.get("max_num_batched_tokens"), model.max_model_len,
                             "scheduler.max_num_batched_tokens")


def num_kv_blocks(cfg: DictConfig, model: ModelSpec, hardware: HardwareSpec) -> int:
    """`kv_cache.num_blocks` when set (to force preemption), else the memory arithmetic, with a
    draft model's K/V in every block and the backend's own sizing (`backend.kv_cache_sizing`:
    the run's max_num_seqs, and the engine's cap on a CPU)."""
    block_size = positive_int("kv_cache.block_size", cfg.kv_cache.block_size)
    if cfg.kv_cache.get("num_blocks") is not None:
        return positive_int("kv_cache.num_blocks", cfg.kv_cache.num_blocks)
    sizing = cfg.backend.get("kv_cache_sizing")
    sizing = {} if sizing is None else build_policy(sizing, "backend.kv_cache_sizing",
                                                    _convert_="all")
    if "max_num_seqs" in sizing:
        # The backends size with the scheduler's setting: a bad one is named as the user set it.
        positive_int("scheduler.max_num_seqs", sizing["max_num_seqs"])
    speculation = speculation_setup(cfg)
    return kv_cache_num_blocks(
        gpu_model(cfg, model), hardware, block_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=cfg.cluster.tensor_parallel_size,
        max_num_batched_tokens=max_num_batched_tokens(cfg, model),
        draft=speculation.draft_kv if speculation is not None else None,
        expert_parallel_size=expert_parallel_size(cfg, model), **sizing)


def num_host_kv_blocks(cfg: DictConfig, model: ModelSpec, preemption,
                       speculation: SpeculationSetup | None) -> int:
    """Blocks of each replica's host swap pool: the preemption policy's swap_space_gb (0
    without swap) over one block's K/V, a draft model's included."""
    return kv_cache_num_host_blocks(
        gpu_model(cfg, model), cfg.kv_cache.block_size, preemption.swap_space_gb,
        cfg.cluster.tensor_parallel_size,
        draft=speculation.draft_kv if speculation is not None else None)


def kv_cache_sizes(cfg: DictConfig, model: ModelSpec, num_blocks: int, preemption,
                   speculation: SpeculationSetup | None) -> dict:
    """A replica's KV manager's pool sizes: `num_blocks`, its host swap pool
    (num_host_kv_blocks) and, with `kv_cache.offload_gb`, the prefix cache's host tier of that
    many GiB, sized as the swap pool is (kv_cache_num_host_blocks)."""
    group = cfg.kv_cache
    offload = {}
    offload_gb = group.get("offload_gb")
    if offload_gb:
        non_negative_number("kv_cache.offload_gb", offload_gb)
        if group.get("offload_bandwidth_gbps") is not None:
            positive_number("kv_cache.offload_bandwidth_gbps", group.offload_bandwidth_gbps)
        offload["num_offload_blocks"] = kv_cache_num_host_blocks(
            gpu_model(cfg, model), group.block_size, offload_gb,
            cfg.cluster.tensor_parallel_size,
            draft=speculation.draft_kv if speculation is not None else None)
    return dict(num_blocks=num_blocks,
                num_host_blocks=num_host_kv_blocks(cfg, model, preemption, speculation), **offload)


def fairness_window_s(cfg: DictConfig) -> float:
    """metrics.fairness_window_s, checked (the summary's default when the config has none)."""
    window_s = (cfg.get("metrics") or {}).get("fairness_window_s")
    if window_s is None:
        return DEFAULT_FAIRNESS_WINDOW_S
    return float(positive_number("metrics.fairness_window_s",
                                 finite_number("metrics.fairness_window_s", window_s)))


def slos_ms(cfg: DictConfig) -> dict[str, float] | None:
    """The `slo.<metric>_ms` limits that are set, as MetricsCollector.summary takes them."""
    limits = {}
    for key, value in (cfg.get("slo") or {}).items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"slo.{key} must be a positive number of ms or null, got {value!r}")
        limits[key.removesuffix("_ms")] = float(value)
    return limits or None


def build_replica_executor(cfg: DictConfig, model: ModelSpec, hardware: HardwareSpec, kv_cache,
                           speculation: SpeculationSetup | None = None, replica_id: int = 0):
    """Who runs a step: the executor the backend's config names (`backend.executor`, e.g. the
    real engine, whose pools match the replica's KV manager), else the cost model (sim)."""
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
    cost_model = build_cost_model(cfg, model, hardware, **drafting)
    repeated_steps = boolean("backend.repeated_steps", cfg.backend.get("repeated_steps", True))
    if speculation is None:
        return SimExecutor(cost_model, repeated_steps=repeated_steps)
    # Each replica draws its own acceptances, reproducibly.
    sim_seed = cfg.get("sim_seed", cfg.seed)
    return SimExecutor(cost_model, speculation.acceptance_model([sim_seed, replica_id]),
                       speculation.depth_per_size, repeated_steps=repeated_steps)


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
