"""One policy assembly for both backends: a replica's policies built from their configs and each
checked against its protocol as it is built, so a plug-in missing a member fails here in one line,
not mid-run."""
from __future__ import annotations

from collections.abc import Callable, Mapping

from omegaconf import DictConfig, OmegaConf

from policies.checks import check_policy
from policies.lora.manager import LRULoRAManager
from policies.lora.spec import LoRAConfig
from policies.protocols import (KVCacheManager, KVRetentionPolicy, LengthPredictor, LoRAManager,
                                PreemptionPolicy, Scheduler, SpeculationPolicy)
from runtime.policy_config import build_policy, names_a_policy, policy_config


def build_preemption(choice, swap_space_gb: float | None = None):
    """The preemption policy from its config (`swap_space_gb` over the group's) or the object."""
    if names_a_policy(choice):
        config = policy_config(choice, "preemption")
        overrides = ({"swap_space_gb": swap_space_gb}
                     if swap_space_gb is not None and "swap_space_gb" in config else {})
        choice = build_policy(config, "preemption", **overrides)
    check_policy(choice, PreemptionPolicy, "preemption")
    return choice


def assemble_scheduler(scheduler_cfg: DictConfig, preemption, kv_cache_cfg: DictConfig,
                       kv_cache_sizes: Callable[[object], Mapping], *,
                       max_num_batched_tokens: int, max_model_len: int,
                       max_num_seqs: int | None = None, speculation=None, kv_retention=None,
                       retention_policies: list | None = None, lora: LoRAConfig | None = None,
                       lora_managers: list | None = None):
    """A replica's scheduler over its own KV manager, speculation, retention and LoRA policies;
    the retention policy and LoRA manager are also appended to the lists the summary reads."""
    kv_cache = build_policy(kv_cache_cfg, "kv_cache", **kv_cache_sizes(preemption))
    check_policy(kv_cache, KVCacheManager, "kv_cache")
    arguments = dict(kv_cache=kv_cache, preemption=preemption, max_model_len=max_model_len,
                     max_num_batched_tokens=max_num_batched_tokens)
    if max_num_seqs is not None:
        arguments["max_num_seqs"] = max_num_seqs
    # Only a drafting run passes `speculation`: a scheduler of its own need not know it.
    if speculation is not None:
        if isinstance(speculation, DictConfig):
            speculation = build_policy(speculation, "speculation")
        check_policy(speculation, SpeculationPolicy, "speculation")
        arguments["speculation"] = speculation
    retention = build_kv_retention(kv_retention, kv_cache)
    if retention is not None:
        arguments["kv_retention"] = retention
        if retention_policies is not None:
            retention_policies.append(retention)
    if lora is not None:
        arguments["lora"] = build_lora_manager(lora)
        if lora_managers is not None:
            lora_managers.append(arguments["lora"])
    scheduler = build_policy(scheduler_cfg, "scheduler", **arguments)
    check_policy(scheduler, Scheduler, "scheduler")
    return scheduler


def build_kv_retention(choice, kv_cache):
    """The KV retention policy over `kv_cache`; None when it keeps no blocks, so the scheduler is
    built as without one."""
    if choice is None:
        return None
    retention = build_policy(policy_config(choice, "kv_retention"), "kv_retention",
                             kv_cache=kv_cache)
    check_policy(retention, KVRetentionPolicy, "kv_retention")
    return retention if retention.keeps_blocks else None


def build_lora_manager(lora: LoRAConfig) -> LoRAManager:
    """A replica's LoRA manager: `lora.policy` lru, a dotted class path or a mapping."""
    arguments = dict(ranks=list(lora.spec.ranks), max_loras=lora.max_loras,
                     max_cpu_loras=lora.max_cpu_loras)
    if lora.policy == "lru":
        manager = LRULoRAManager(**arguments)
    elif isinstance(lora.policy, (str, Mapping, DictConfig)) and (
            not isinstance(lora.policy, str) or "." in lora.policy):
        manager = build_policy(policy_config(lora.policy, "lora", "lora.policy"), "lora.policy",
                               **arguments)
    else:
        raise ValueError(f"lora.policy must be lru, a dotted class path or a {{_target_: ...}} "
                         f"mapping; got {lora.policy!r}")
    check_policy(manager, LoRAManager, "lora.policy")
    return manager


# Keys of the kv_cache group the run reads itself rather than pass to the manager.
KV_CACHE_RUN_KEYS = ("offload_gb", "offload_bandwidth_gbps")


def build_predictor(choice, seed: int, field: str = "predictor"):
    """The run's length predictor, None for none; a config's `seed: null` becomes the run's."""
    if choice is None:
        return None
    if isinstance(choice, (str, Mapping, DictConfig)):
        config = policy_config(choice, "predictor", field)
        # Only a predictor that asks for a seed gets one, so a user's own need not take it.
        seeded = {"seed": seed} if "seed" in config and config.seed is None else {}
        choice = build_policy(config, field, **seeded)
    check_policy(choice, LengthPredictor, field)
    return choice


def kv_cache_policy_config(group: DictConfig) -> DictConfig:
    """A kv_cache group's policy config: the group less KV_CACHE_RUN_KEYS."""
    if not any(key in group for key in KV_CACHE_RUN_KEYS):
        return group
    # Resolved first, since the copy has no root to resolve interpolations against.
    return OmegaConf.create({key: value
                             for key, value in OmegaConf.to_container(group, resolve=True).items()
                             if key not in KV_CACHE_RUN_KEYS})
