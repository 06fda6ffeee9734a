"""Builds a run's parts from its Hydra config: policies (`_target_` classes, the built-in ones and
a user's own), the router, the step token budget, the KV pool's size, the speculation setup and
the replica's executor."""
from __future__ import annotations

import importlib
import statistics
from dataclasses import dataclass
from pathlib import Path

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf

import conf
from policies.routing import LeastOutstandingRouter, RoundRobinRouter
from policies.speculation import max_speculative_tokens
from sim.core.acceptance import AcceptanceModel
from sim.core.executor import SimExecutor
from sim.core.specs import HardwareSpec, ModelSpec, kv_cache_num_blocks

ROUTERS = {"round_robin": RoundRobinRouter, "least_outstanding": LeastOutstandingRouter}
GIB = 1 << 30
MODEL_CONFIG_DIR = Path(conf.__file__).parent / "model"
# Keys of the speculation group that describe the run, not the policy: popped before it is built.
SPECULATION_RUN_KEYS = ("draft_model", "acceptance_rate", "acceptance_profile")


def build_policy(cfg: DictConfig, group: str, **kwargs):
    """Instantiate a policy config group; a bad `_target_` or argument is one clear line."""
    try:
        return instantiate(cfg, **kwargs)
    except MissingMandatoryValue as error:
        raise ValueError(f"{group}.{error.key} is required (set it on the command line, "
                         f"e.g. {group}.{error.key}=...)") from None
    except InstantiationException as error:
        cause = error.__cause__
        if isinstance(cause, ValueError):
            raise cause from None
        target = cfg.get("_target_", "?") if isinstance(cfg, DictConfig) else "?"
        raise ValueError(f"{group}._target_={target}: {cause or error}") from None


def build_router(router_cfg):
    """`cluster.router` is a built-in name, a dotted class path, or a {_target_: ...} mapping."""
    if isinstance(router_cfg, DictConfig):
        return build_policy(router_cfg, "cluster.router")
    name = str(router_cfg)
    if name in ROUTERS:
        return ROUTERS[name]()
    if "." in name:
        module_name, _, class_name = name.rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), class_name)()
        except (ImportError, AttributeError) as error:
            raise ValueError(f"cluster.router={name}: cannot import it ({error})") from None
    raise ValueError(f"cluster.router must be one of {', '.join(ROUTERS)} or a dotted class "
                     f"path; got {name!r}")


def positive_int(value, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{field} must be a positive integer, got {value!r}")
    return value


def max_num_batched_tokens(cfg: DictConfig, model: ModelSpec) -> int:
    """The step token budget; null means vLLM's default without chunking, big enough for any
    prompt the model allows."""
    value = cfg.scheduler.get("max_num_batched_tokens")
    if value is None:
        return max(model.max_model_len, 2048)
    return positive_int(value, "scheduler.max_num_batched_tokens")


def num_kv_blocks(cfg: DictConfig, model: ModelSpec, hardware: HardwareSpec) -> int:
    """`kv_cache.num_blocks` when set (to force preemption), else the memory arithmetic (the
    engine's, which caps a CPU pool, when the engine runs the steps)."""
    block_size = positive_int(cfg.kv_cache.block_size, "kv_cache.block_size")
    if cfg.kv_cache.get("num_blocks") is not None:
        return positive_int(cfg.kv_cache.num_blocks, "kv_cache.num_blocks")
    if cfg.backend.name == "engine":
        from engine.builder import resolve_device
        from engine.kv_cache import num_device_blocks
        return num_device_blocks(
            model, hardware, resolve_device(cfg.backend.device), block_size,
            max_num_seqs=cfg.scheduler.max_num_seqs, max_model_len=model.max_model_len,
            max_num_batched_tokens=max_num_batched_tokens(cfg, model),
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            cpu_kv_cache_gb=cfg.backend.cpu_kv_cache_gb)
    return kv_cache_num_blocks(
        model, hardware, block_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=cfg.cluster.tensor_parallel_size,
        max_num_batched_tokens=max_num_batched_tokens(cfg, model))


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


@dataclass
class SpeculationSetup:
    """The speculation group of a run whose policy drafts: the policy's own config (built once
    per replica: a policy may keep state), the drafter and, for the simulator, what the drafts
    cost and how often they are accepted."""

    policy_cfg: DictConfig
    max_num_speculative_tokens: int
    draft_model: str                      # "ngram", a conf/model name or (engine) a folder
    draft_spec: ModelSpec | str | None    # sim: "ngram" or the draft model's shape
    acceptance: AcceptanceModel | None    # sim: the acceptance statistics

    def acceptance_model(self, seed) -> AcceptanceModel:
        """The acceptance statistics with a generator of their own (one per replica)."""
        return self.acceptance.reseeded(seed)


def draft_model_spec(name: str) -> ModelSpec | str:
    """What the roofline costs the drafts with: "ngram" or the draft model's spec."""
    if name == "ngram":
        return name
    config_file = MODEL_CONFIG_DIR / f"{name}.yaml"
    if not config_file.is_file():
        known = ", ".join(sorted(path.stem for path in MODEL_CONFIG_DIR.glob("*.yaml")))
        raise ValueError(f"speculation.draft_model must be ngram or a conf/model name ({known}) "
                         f"for the simulator; got {name!r}")
    return ModelSpec.from_config(OmegaConf.load(config_file))


def acceptance_statistics(group: DictConfig) -> AcceptanceModel:
    """The simulator's acceptance model: the measured profile when given, else i.i.d."""
    if group.get("acceptance_profile") is not None:
        return AcceptanceModel.from_file(group.acceptance_profile)
    if group.get("acceptance_rate") is None:
        raise ValueError("speculation.acceptance_rate (a probability) or "
                         "speculation.acceptance_profile (a JSON file) is required to simulate "
                         "speculative decoding")
    return AcceptanceModel.iid(group.acceptance_rate)


def speculation_setup(cfg: DictConfig) -> SpeculationSetup | None:
    """The run's speculation, checked before anything runs; None when it does not draft (no
    speculation group, or a policy whose max_num_speculative_tokens is 0: speculation=none)."""
    group = cfg.get("speculation")
    if group is None:
        return None
    policy_cfg = OmegaConf.masked_copy(group, [key for key in group
                                               if key not in SPECULATION_RUN_KEYS])
    max_k = max_speculative_tokens(build_policy(policy_cfg, "speculation"))
    if max_k == 0:
        return None
    draft_model = group.get("draft_model")
    if not isinstance(draft_model, str) or not draft_model:
        raise ValueError(f"speculation.draft_model must be ngram or a model name, got "
                         f"{draft_model!r}")
    if cfg.backend.name != "sim":  # the engine drafts, verifies and counts for real
        return SpeculationSetup(policy_cfg, max_k, draft_model, None, None)
    return SpeculationSetup(policy_cfg, max_k, draft_model, draft_model_spec(draft_model),
                            acceptance_statistics(group))


def build_replica_executor(cfg: DictConfig, model: ModelSpec, hardware: HardwareSpec, kv_cache,
                   speculation: SpeculationSetup | None = None, replica_id: int = 0):
    """Who runs a step: the cost model (sim) or the real engine, whose KV pools match the
    replica's KV manager."""
    backend = cfg.backend.name
    if backend == "engine":
        from engine import build_engine_executor  # torch and transformers: only when asked
        drafting = {} if speculation is None else {
            "speculative_model": speculation.draft_model,
            "max_num_speculative_tokens": speculation.max_num_speculative_tokens}
        from engine.speed import load_reference
        speed_profile = cfg.backend.get("speed_reference")
        return build_engine_executor(
            model.name, kv_cache, device=cfg.backend.device, dtype=cfg.backend.dtype,
            seed=cfg.seed, speed_reference=load_reference(speed_profile) if speed_profile else None,
            **drafting)
    if backend == "sim":
        drafting = {} if speculation is None else {"draft_model": speculation.draft_spec}
        cost_model = build_policy(cfg.cost_model, "cost_model", model=model, hardware=hardware,
                                  tensor_parallel_size=cfg.cluster.tensor_parallel_size,
                                  **drafting)
        if speculation is None:
            return SimExecutor(cost_model)
        # Each replica draws its own acceptances, reproducibly.
        sim_seed = cfg.get("sim_seed", cfg.seed)
        return SimExecutor(cost_model, speculation.acceptance_model([sim_seed, replica_id]))
    raise ValueError(f"backend must be one of sim, engine; got {backend!r}")


def speed_summary(executors: list) -> dict:
    """An engine run normalised to a profile's machine speed (backend.speed_reference): the
    speed factors its probes saw, over every replica, and the wall time they took."""
    summaries = [executor.speed_summary() for executor in executors
                 if hasattr(executor, "speed_summary")]
    if not summaries:
        return {}
    return {"speed_factor_median": statistics.median(s["speed_factor_median"] for s in summaries),
            "speed_factor_p05": min(s["speed_factor_p05"] for s in summaries),
            "speed_factor_p95": max(s["speed_factor_p95"] for s in summaries),
            "speed_probes": sum(s["speed_probes"] for s in summaries),
            "speed_probe_s": sum(s["speed_probe_s"] for s in summaries)}
