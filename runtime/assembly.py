"""One policy assembly for both backends: a replica's preemption policy, KV manager, KV retention
policy, speculation policy and scheduler, built in that order from their configs (or taken as the caller's objects),
each checked against its protocol (policies/protocols.py) as it is built, so that a plug-in
missing a member fails here in one line naming it, not mid-run. The simulator
(sim/core/experiment.py) and the engine (engine/builder.py) differ only in the pool sizes and
settings they pass."""
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
    """The preemption policy: a conf/preemption name, dotted class path or mapping (built, with
    `swap_space_gb` over the group's own when given and the group has one), or the object."""
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
    """A replica's scheduler over its own KV manager: the KV manager built from `kv_cache_cfg`
    with the keyword arguments `kv_cache_sizes(preemption)` gives (its pools: the host one is
    sized by the preemption policy's swap space), then the speculation policy (a config built
    here, the caller's object, or None: the run does not speculate), then the scheduler with the
    keyword arguments of the contract (policies.protocols.Scheduler). `max_num_seqs` None: the
    scheduler group's own. `kv_retention` (a conf/kv_retention name or mapping; None: evict) is
    built over the KV manager and passed to the scheduler only when it keeps blocks; then also
    appended to `retention_policies` (the run's summary reads their logs). With `lora` (the run's
    LoRA config; None: off) the scheduler gets a LoRA manager of its own (`lora=`), also appended
    to `lora_managers`."""
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
    """The KV retention policy over `kv_cache`: a conf/kv_retention name, dotted class path or
    mapping, checked against its protocol; None when it keeps no blocks (evict, or no choice):
    the scheduler is then built as without one."""
    if choice is None:
        return None
    retention = build_policy(policy_config(choice, "kv_retention"), "kv_retention",
                             kv_cache=kv_cache)
    check_policy(retention, KVRetentionPolicy, "kv_retention")
    return retention if retention.keeps_blocks else None


def build_lora_manager(lora: LoRAConfig) -> LoRAManager:
    """A replica's LoRA manager: `lora.policy` lru (LRULoRAManager), or a dotted class path or
    {_target_: ...} mapping built with the same arguments, checked against its protocol."""
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


# Keys of the kv_cache group that the run turns into the manager's arguments (offload_gb into
# num_offload_blocks) or that the cost models read (offload_bandwidth_gbps).
KV_CACHE_RUN_KEYS = ("offload_gb", "offload_bandwidth_gbps")


def build_predictor(choice, seed: int, field: str = "predictor"):
    """The run's length predictor (built once per run): None for none, else a conf/predictor
    name, a dotted class path, a {_target_: ...} mapping or an object with predict(request). A
    config's `seed: null` becomes the run's `seed`."""
    if choice is None:
        return None
    if isinstance(choice, (str, Mapping, DictConfig)):
        config = policy_config(choice, "predictor", field)
        # Only a predictor that asks for a seed gets one: a user's own need not take it.
        seeded = {"seed": seed} if "seed" in config and config.seed is None else {}
        choice = build_policy(config, field, **seeded)
    check_policy(choice, LengthPredictor, field)
    return choice


def kv_cache_policy_config(group: DictConfig) -> DictConfig:
    """A kv_cache group's policy config: the group less KV_CACHE_RUN_KEYS."""
    if not any(key in group for key in KV_CACHE_RUN_KEYS):
        return group
    # Resolved first: the copy has no root to resolve interpolations such as
    # ${model.max_model_len} against.
    return OmegaConf.create({key: value
                             for key, value in OmegaConf.to_container(group, resolve=True).items()
                             if key not in KV_CACHE_RUN_KEYS})
