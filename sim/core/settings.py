"""A run's settings, read from its Hydra config and checked once, before anything is built:
builders take these, not the config. Policy groups (`_target_` configs) stay configs, since Hydra
builds them."""
from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from policies.validators import (boolean, finite_number, non_negative_int, non_negative_number,
                                 positive_int, positive_number)
from runtime.metrics.summary import DEFAULT_FAIRNESS_WINDOW_S
from runtime.policy_config import build_policy
from runtime.specs import ModelSpec
from runtime.kv_sizing import step_token_budget
from sim.core.speculation_setup import SpeculationSetup, speculation_setup
from sim.cost.experts import check_expert_parallel_size
from sim.cost.pipeline import KEY as PIPELINE_KEY
from sim.cost.pipeline import check_pipeline_parallel_size, stage_model


@dataclass(frozen=True)
class RunSettings:
    """What the whole run shares: seeds, the summary's SLOs and fairness window, the frontend's
    latency and the speculation setup."""

    seed: int
    sim_seed: int | None          # each replica's acceptance draws (the config: seed's)
    slos_ms: dict[str, float] | None
    fairness_window_s: float
    frontend_latency_s: float
    speculation: SpeculationSetup | None


@dataclass(frozen=True)
class ReplicaSettings:
    """A pool's replica sizes (the run's config with the pool's overrides)."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    expert_parallel_size: int
    max_num_batched_tokens: int
    block_size: int
    gpu_model: ModelSpec          # the shape one GPU holds: a pipeline stage's layers
    num_blocks: int | None        # kv_cache.num_blocks; None: sized from memory
    kv_cache_sizing: dict         # backend.kv_cache_sizing, built (used only to size from memory)
    gpu_memory_utilization: float | None
    offload_gb: float | None      # kv_cache.offload_gb: the prefix cache's host tier
    repeated_steps: bool
    speculation: SpeculationSetup | None
    sim_seed: int | None


def run_settings(cfg: DictConfig) -> RunSettings:
    """The run's settings, checked, with the backend's own check (`backend.preflight`)."""
    non_negative_int("seed", cfg.seed)
    if cfg.get("sim_seed") is not None:
        non_negative_int("sim_seed", cfg.sim_seed)
    positive_int("cluster.num_replicas", cfg.cluster.num_replicas)
    positive_int("cluster.tensor_parallel_size", cfg.cluster.tensor_parallel_size)
    if cfg.backend.get("preflight") is not None:   # (engine/preflight.py)
        build_policy(cfg.backend.preflight, "backend.preflight")
    return RunSettings(cfg.seed, cfg.get("sim_seed", cfg.seed), slos_ms(cfg),
                       fairness_window_s(cfg), frontend_latency_s(cfg), speculation_setup(cfg))


def replica_settings(cfg: DictConfig, model: ModelSpec, run: RunSettings | None = None,
                     pipeline_key: str = PIPELINE_KEY) -> ReplicaSettings:
    """The replica sizes of `cfg` (a pool's config), checked; errors name `pipeline_key` for the
    pipeline stages (a pool's own setting, where it has one). `run` defaults to cfg's speculation
    and seed."""
    block_size = positive_int("kv_cache.block_size", cfg.kv_cache.block_size)
    num_blocks, sizing, memory_share = cfg.kv_cache.get("num_blocks"), {}, None
    if num_blocks is not None:
        positive_int("kv_cache.num_blocks", num_blocks)
    else:
        if cfg.backend.get("kv_cache_sizing") is not None:
            sizing = build_policy(cfg.backend.kv_cache_sizing, "backend.kv_cache_sizing",
                                  _convert_="all")
        if "max_num_seqs" in sizing:   # named as the user set it
            positive_int("scheduler.max_num_seqs", sizing["max_num_seqs"])
        memory_share = cfg.gpu_memory_utilization
    speculation = run.speculation if run is not None else speculation_setup(cfg)
    stages = check_pipeline_parallel_size(
        cfg.cluster.get("pipeline_parallel_size", 1), model, pipeline_key,
        engine=cfg.backend.get("executor") is not None,
        draft_model=None if speculation is None else speculation.draft_model)
    max_num_batched_tokens = step_token_budget(cfg.scheduler.get("max_num_batched_tokens"),
                                               model.max_model_len,
                                               "scheduler.max_num_batched_tokens")
    tensor_parallel_size = cfg.cluster.tensor_parallel_size
    expert_parallel_size = check_expert_parallel_size(
        model, cfg.cluster.get("expert_parallel_size", 1), tensor_parallel_size)
    offload_gb = cfg.kv_cache.get("offload_gb")
    if offload_gb:
        non_negative_number("kv_cache.offload_gb", offload_gb)
        if cfg.kv_cache.get("offload_bandwidth_gbps") is not None:
            positive_number("kv_cache.offload_bandwidth_gbps", cfg.kv_cache.offload_bandwidth_gbps)
    repeated_steps = (cfg.backend.get("executor") is not None   # (sim only: not read otherwise)
                      or boolean("backend.repeated_steps", cfg.backend.get("repeated_steps", True)))
    sim_seed = run.sim_seed if run is not None else cfg.get("sim_seed", cfg.seed)
    return ReplicaSettings(tensor_parallel_size, stages, expert_parallel_size,
                           max_num_batched_tokens, block_size, stage_model(model, stages),
                           num_blocks, sizing, memory_share, offload_gb or None, repeated_steps,
                           speculation, sim_seed)


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


def frontend_latency_s(cfg: DictConfig) -> float:
    """cluster.frontend_latency_s, checked (0 when the config has none)."""
    key = "cluster.frontend_latency_s"
    return float(non_negative_number(key, finite_number(
        key, cfg.cluster.get("frontend_latency_s", 0.0))))
