"""Builds a run's parts from its Hydra config: policies (`_target_` classes, the built-in ones and
a user's own), the router, the length predictor, the step token budget, the KV pools' sizes, the
speculation setup and the replica's executor. The engine (`LLM(...)`) names and builds its
policies with the same functions, from the same conf/ groups."""
from __future__ import annotations

import inspect
import statistics

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from policies.checks import check_policy, has_capability
from policies.lora.spec import lora_config
from policies.protocols import CostModel, ReportsSpeed, StatesExpectedError
from policies.speculation.drafters import drafter_kind
from policies.validators import (boolean, finite_number, non_negative_int, non_negative_number,
                                 positive_int, positive_number)
from sim.core.executor import SimExecutor
from sim.core.experts import check_expert_parallel_size
from runtime.metrics.summary import DEFAULT_FAIRNESS_WINDOW_S
from sim.core.pipeline import (gpu_model, pipeline_cost_model, pipeline_parallel_size,
                               stage_layers, stage_shape)
from runtime.policy_config import CONF_DIR, build_policy, policy_config
from sim.core.say_once import say_once
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


def expert_parallel_size(cfg: DictConfig, model: ModelSpec) -> int:
    """cluster.expert_parallel_size (1 when unset), checked against the model and tp."""
    return check_expert_parallel_size(model, cfg.cluster.get("expert_parallel_size", 1),
                                      cfg.cluster.tensor_parallel_size)


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
        if not _takes_argument(cfg.cost_model, "lora"):
            raise ValueError(f"lora: cost_model={_group_name(cfg.cost_model)} does not cost LoRA "
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


def build_cost_model(cfg: DictConfig, model: ModelSpec, hardware: HardwareSpec, **drafting):
    """The run's cost model (`cost_model`); a GPU cost model whose tables cannot cover the
    hardware (a CPU) falls back to the roofline, and says so in one line (once a process).
    With pipeline stages, the pipeline over each stage's layers (sim/core/pipeline.py)."""
    stages = pipeline_parallel_size(cfg, model)
    if stages == 1:
        return _base_cost_model(cfg, model, hardware, **drafting)
    layers = stage_layers(model.num_layers, stages)
    by_layers = {num_layers: _base_cost_model(cfg, stage_shape(model, num_layers), hardware,
                                              **drafting) for num_layers in set(layers)}
    return pipeline_cost_model([by_layers[num_layers] for num_layers in layers])


def _base_cost_model(cfg: DictConfig, model: ModelSpec, hardware: HardwareSpec, **drafting):
    from sim.gpu.linear import NoGPUTable

    arguments = dict(model=model, hardware=hardware,
                     tensor_parallel_size=cfg.cluster.tensor_parallel_size, **drafting)
    if expert_parallel_size(cfg, model) > 1:   # (a cost model without experts never sees it)
        arguments["expert_parallel_size"] = cfg.cluster.expert_parallel_size
    try:
        cost_model = build_policy(cfg.cost_model, "cost_model", **arguments)
    except NoGPUTable:
        fallback, carried = _roofline_fallback(cfg.cost_model, hardware)
        kept = "".join(f" cost_model.{key}={value}" for key, value in carried.items())
        # Said once per (model, hardware) pair, whatever overrides the later runs carry.
        say_once(f"twinserve: no GPU measurement covers hardware={hardware.name} "
                 f"(cost_model={_group_name(cfg.cost_model)}); using cost_model=roofline, an "
                 f"uncalibrated spec-sheet estimate{' with' + kept if kept else ''}",
                 key=("roofline fallback", model.name, hardware.name))
        cost_model = build_policy(fallback, "cost_model", **arguments)
    check_policy(cost_model, CostModel, "cost_model")
    return cost_model


# Settings every cost model group carries from the run (kv_cache's), not the user's choice.
_RUN_SETTINGS = ("block_size", "offload_bandwidth_gbps")


def _roofline_fallback(group: DictConfig, hardware: HardwareSpec) -> tuple[DictConfig, dict]:
    """The roofline's config for a run whose cost model `group` covers no GPU near `hardware`,
    and the settings carried into it: the run's block size and host-tier bandwidth, and every
    setting the user changed from the group's conf file that the roofline takes (a terms_file
    too, which the roofline loads if it was fitted on the roofline or names no cost model).
    ValueError, in one line, naming those it does not take."""
    fallback = OmegaConf.load(CONF_DIR / "cost_model" / "roofline.yaml")
    for key in _RUN_SETTINGS:   # the run's, as the group had them
        if key in group:
            fallback[key] = group[key]
    changed = _changed_settings(group)   # (a terms_file too: the roofline reads its own)
    refused = [key for key in changed if not _takes_argument(fallback, key)]
    if refused:
        raise ValueError(
            f"{', '.join('cost_model.' + key for key in refused)}: not a setting of "
            f"cost_model=roofline, which the run falls back to (no GPU measurement covers "
            f"hardware={hardware.name}); drop {'it' if len(refused) == 1 else 'them'}, or set "
            f"cost_model=roofline and its own settings (conf/cost_model/roofline.yaml)")
    for key, value in changed.items():
        fallback[key] = value
    return fallback, changed


def _changed_settings(group: DictConfig) -> dict:
    """The settings of a cost model group that differ from its conf file's (all of them for a
    group without one), as given: interpolations unresolved, so the run's own are not counted."""
    path = CONF_DIR / "cost_model" / f"{_group_name(group)}.yaml"
    defaults = OmegaConf.to_container(OmegaConf.load(path), resolve=False) if path.exists() else {}
    given = OmegaConf.to_container(group, resolve=False)
    return {key: value for key, value in given.items()
            if key not in ("_target_", "_convert_", *_RUN_SETTINGS)
            and (key not in defaults or defaults[key] != value)}


def _takes_argument(group: DictConfig, name: str) -> bool:
    """Whether the class the group's `_target_` names takes the keyword argument `name` (True
    where the target does not import: building it reports that)."""
    try:
        parameters = inspect.signature(get_class(str(group.get("_target_")))).parameters
    except Exception:
        return True
    return name in parameters or any(parameter.kind is parameter.VAR_KEYWORD
                                     for parameter in parameters.values())


# The conf/cost_model group of each shipped cost model class.
_COST_MODEL_GROUPS = {"sim.gpu.cost_model.GPUCostModel": "gpu",
                      "sim.profiled.cost_model.ProfiledCostModel": "profiled",
                      "sim.core.roofline.RooflineCostModel": "roofline"}


def _group_name(group: DictConfig) -> str:
    target = str(group.get("_target_", "?"))
    return _COST_MODEL_GROUPS.get(target, target)


def cost_model_group(cost_model) -> str:
    """The conf/cost_model name of a built cost model (its class path where none ships it)."""
    target = f"{type(cost_model).__module__}.{type(cost_model).__qualname__}"
    return _COST_MODEL_GROUPS.get(target, target)


def cost_model_summary(cost_models: list, fixed_in_flight: bool = False) -> dict:
    """The expected error of the run's TTFT, TPOT and E2E where its cost model states one: the
    80th percentile of |error| of leave-out checks of its kind (sim/gpu/expected_errors.py),
    of a closed loop's checks where a fixed number of requests is in flight
    (`fixed_in_flight`: workload=closed_loop), else of open arrivals'."""
    from sim.gpu.expected_errors import expected_errors_for
    for cost_model in cost_models:
        if (has_capability(cost_model, StatesExpectedError, "cost_model")
                and cost_model.expected_error_pct is not None):
            stated = cost_model.expected_error_pct
            kind = getattr(cost_model, "prediction_kind", None)
            if fixed_in_flight and kind is not None:
                stated = expected_errors_for({**kind, "arrivals": "closed"}) or stated
            summary = {f"expected_{metric}_error_pct": float(stated[metric])
                       for metric in ("ttft", "tpot", "e2e")}
            summary["expected_error_basis"] = (f"{stated.get('checks', '?')} leave-out checks: "
                                               f"{stated.get('basis', '?')}")
            if getattr(cost_model, "kernels_used", None):
                summary["cost_model_kernels"] = cost_model.kernels_used
            return summary
    return {}


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
