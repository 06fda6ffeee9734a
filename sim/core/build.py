"""Builds a run's parts from its Hydra config: policies (`_target_` classes, the built-in ones and
a user's own), the router, the length predictor, the step token budget, the KV pools' sizes, the
speculation setup and the replica's executor. The engine (`LLM(...)`) names and builds its
policies with the same functions, from the same conf/ groups."""
from __future__ import annotations

import statistics
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, MissingMandatoryValue, OmegaConf

import conf
from policies.prediction import check_predictor
from policies.speculation import max_speculative_tokens
from policies.speculation.trees import (MAX_TREE_TOKENS, lookahead_depth_per_size,
                                        lookahead_tokens, medusa_depth_per_size, tree_paths)
from policies.validators import (non_negative_int, non_negative_number, positive_int,
                                 positive_number)
from sim.core.acceptance import AcceptanceModel
from sim.core.executor import SimExecutor
from sim.core.specs import (HardwareSpec, ModelSpec, kv_cache_num_blocks,
                            kv_cache_num_host_blocks, step_token_budget)

CONF_DIR = Path(conf.__file__).parent
MODEL_CONFIG_DIR = CONF_DIR / "model"
# Keys of the speculation group that describe the run, not the policy: popped before it is built.
SPECULATION_RUN_KEYS = ("draft_model", "acceptance_rate", "acceptance_profile", "tree",
                        "medusa_heads", "lookahead_window", "lookahead_ngram",
                        "lookahead_guesses")
# Drafters that propose token trees: the policy's size is the tokens a step verifies.
TREE_DRAFTERS = ("medusa", "lookahead")
# Keys of the kv_cache group that the run turns into the manager's arguments (offload_gb into
# num_offload_blocks) or that the cost models read (offload_bandwidth_gbps).
KV_CACHE_RUN_KEYS = ("offload_gb", "offload_bandwidth_gbps")


def config_names(group: str) -> list[str]:
    """The configs of a conf/ group, by name."""
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def policy_config(choice, group: str, field: str | None = None) -> DictConfig:
    """The config of a policy as a user names it: a conf/<group> name (that file: its `_target_`
    and defaults), a dotted class path, or a {_target_: ...} mapping. `field` is the setting as
    the user wrote it (default: the group), for the error."""
    field = field or group
    if isinstance(choice, (DictConfig, Mapping)):
        config = choice if isinstance(choice, DictConfig) else OmegaConf.create(dict(choice))
        if "_target_" not in config:
            raise ValueError(f"{field}: a mapping must name its class in _target_, got "
                             f"{dict(choice) if isinstance(choice, Mapping) else choice!r}")
        return config
    if isinstance(choice, str):
        config_file = CONF_DIR / group / f"{choice}.yaml"
        if config_file.is_file():
            return OmegaConf.load(config_file)
        if "." in choice:
            return OmegaConf.create({"_target_": choice})
    raise ValueError(f"{field} must be one of {', '.join(config_names(group))} (conf/{group}), a "
                     f"dotted class path or a {{_target_: ...}} mapping; got {choice!r}")


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
    """`cluster.router`: a conf/router name, a dotted class path, or a {_target_: ...} mapping."""
    return build_policy(policy_config(router_cfg, "router", "cluster.router"), "cluster.router")


def build_predictor(choice, seed: int, field: str = "predictor"):
    """The run's length predictor (built once per run): None for none, else a conf/predictor
    name, a dotted class path, a {_target_: ...} mapping or an object with predict(request). A
    config's `seed: null` becomes the run's `seed`."""
    if choice is None:
        return None
    if not isinstance(choice, (str, Mapping, DictConfig)):
        return check_predictor(choice, field)
    config = policy_config(choice, "predictor", field)
    # Only a predictor that asks for a seed gets one: a user's own need not take it.
    seeded = {"seed": seed} if "seed" in config and config.seed is None else {}
    return check_predictor(build_policy(config, field, **seeded), field)


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
    the engine's activations for the run's max_num_seqs and its cap on a CPU)."""
    block_size = positive_int("kv_cache.block_size", cfg.kv_cache.block_size)
    if cfg.kv_cache.get("num_blocks") is not None:
        return positive_int("kv_cache.num_blocks", cfg.kv_cache.num_blocks)
    sizing = cfg.backend.get("kv_cache_sizing")
    sizing = {} if sizing is None else build_policy(sizing, "backend.kv_cache_sizing",
                                                    _convert_="all")
    speculation = speculation_setup(cfg)
    return kv_cache_num_blocks(
        model, hardware, block_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        tensor_parallel_size=cfg.cluster.tensor_parallel_size,
        max_num_batched_tokens=max_num_batched_tokens(cfg, model),
        draft=speculation.draft_kv if speculation is not None else None, **sizing)


def num_host_kv_blocks(cfg: DictConfig, model: ModelSpec, preemption,
                       speculation: SpeculationSetup | None) -> int:
    """Blocks of each replica's host swap pool: the preemption policy's swap_space_gb (0
    without swap) over one block's K/V, a draft model's included."""
    return kv_cache_num_host_blocks(
        model, cfg.kv_cache.block_size, getattr(preemption, "swap_space_gb", 0.0),
        cfg.cluster.tensor_parallel_size,
        draft=speculation.draft_kv if speculation is not None else None)


def kv_cache_policy_config(group: DictConfig) -> DictConfig:
    """A kv_cache group's policy config: the group less KV_CACHE_RUN_KEYS."""
    if not any(key in group for key in KV_CACHE_RUN_KEYS):
        return group
    # Resolved first: the copy has no root to resolve interpolations such as
    # ${model.max_model_len} against.
    return OmegaConf.create({key: value
                             for key, value in OmegaConf.to_container(group, resolve=True).items()
                             if key not in KV_CACHE_RUN_KEYS})


def build_kv_cache(cfg: DictConfig, model: ModelSpec, num_blocks: int, preemption,
                   speculation: SpeculationSetup | None):
    """A replica's KV manager: the kv_cache group with the pool sizes of the run, its host swap
    pool (num_host_kv_blocks) and, with `kv_cache.offload_gb`, the prefix cache's host tier of
    that many GiB, sized as the swap pool is (kv_cache_num_host_blocks)."""
    group = cfg.kv_cache
    offload = {}
    offload_gb = group.get("offload_gb")
    if offload_gb:
        non_negative_number("kv_cache.offload_gb", offload_gb)
        if group.get("offload_bandwidth_gbps") is not None:
            positive_number("kv_cache.offload_bandwidth_gbps", group.offload_bandwidth_gbps)
        offload["num_offload_blocks"] = kv_cache_num_host_blocks(
            model, group.block_size, offload_gb, cfg.cluster.tensor_parallel_size,
            draft=speculation.draft_kv if speculation is not None else None)
    return build_policy(kv_cache_policy_config(group), "kv_cache", num_blocks=num_blocks,
                        num_host_blocks=num_host_kv_blocks(cfg, model, preemption, speculation),
                        **offload)


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
    # The draft model whose K/V shares the KV pool's blocks: None for ngram (no K/V), or for a
    # checkpoint folder the engine loads (its shape is not in conf/model).
    draft_kv: ModelSpec | None = None
    # Token trees (medusa, lookahead): per size the policy may choose, the depth it reaches.
    depth_per_size: list[int] | None = None

    def acceptance_model(self, seed) -> AcceptanceModel:
        """The acceptance statistics with a generator of their own (one per replica)."""
        return self.acceptance.reseeded(seed)


def draft_model_spec(name: str) -> ModelSpec | str:
    """What the roofline costs the drafts with: "ngram", "medusa", "lookahead" or the draft
    model's spec."""
    if name in ("ngram",) + TREE_DRAFTERS:
        return name
    config_file = MODEL_CONFIG_DIR / f"{name}.yaml"
    if not config_file.is_file():
        raise ValueError(f"speculation.draft_model must be ngram, medusa, lookahead or a "
                         f"conf/model name ({', '.join(config_names('model'))}) for the "
                         f"simulator; got {name!r}")
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


def speculation_policy_config(group: DictConfig) -> DictConfig:
    """A speculation group's policy config: the group less the keys that describe the run."""
    return OmegaConf.masked_copy(group, [key for key in group if key not in SPECULATION_RUN_KEYS])


def speculation_setup(cfg: DictConfig) -> SpeculationSetup | None:
    """The run's speculation, checked before anything runs; None when it does not draft (no
    speculation group, or a policy whose max_num_speculative_tokens is 0: speculation=none)."""
    group = cfg.get("speculation")
    if group is None:
        return None
    policy_cfg = speculation_policy_config(group)
    max_k = max_speculative_tokens(build_policy(policy_cfg, "speculation"))
    if max_k == 0:
        return None
    draft_model = group.get("draft_model")
    if not isinstance(draft_model, str) or not draft_model:
        raise ValueError(f"speculation.draft_model must be ngram or a model name, got "
                         f"{draft_model!r}")
    depth_per_size = None
    max_depth = max_k   # a token tree's k: the most tokens a step accepts
    if draft_model in TREE_DRAFTERS:
        # k bounds the tokens a step accepts; the policy chooses how many it verifies.
        depth_per_size = tree_depth_per_size(group, draft_model, max_k)
        policy_cfg = tree_policy_config(policy_cfg, depth_per_size)
        max_k = len(depth_per_size) - 1
    if cfg.backend.get("executor") is not None:  # a real backend drafts, verifies and counts
        draft_kv = None
        if (MODEL_CONFIG_DIR / f"{draft_model}.yaml").is_file():
            draft_kv = draft_model_spec(draft_model)
        return SpeculationSetup(policy_cfg, max_k, draft_model, None, None, draft_kv,
                                depth_per_size)
    draft_spec = draft_model_spec(draft_model)
    acceptance = acceptance_statistics(group)
    if draft_model == "medusa":   # a fixed tree: per node where the statistics measured it
        acceptance = acceptance.for_tree(medusa_tree_paths(group, max_depth))
    return SpeculationSetup(policy_cfg, max_k, draft_model, draft_spec, acceptance,
                            draft_spec if isinstance(draft_spec, ModelSpec) else None,
                            depth_per_size)


def tree_depth_per_size(group: DictConfig, draft_model: str, k: int) -> list[int]:
    """For a token-tree drafter, the depth each size reaches: Medusa's `tree` (k heads, at most
    k deep) or lookahead's window, n-gram (k + 1 by default) and guesses."""
    if draft_model == "medusa":
        return medusa_depth_per_size(medusa_tree_paths(group, k))
    ngram = group.get("lookahead_ngram")
    ngram = k + 1 if ngram is None else ngram
    window, guesses = group.get("lookahead_window", 4), group.get("lookahead_guesses", 4)
    if lookahead_tokens(window, ngram, guesses) > MAX_TREE_TOKENS:
        raise ValueError(f"lookahead runs (lookahead_window + lookahead_guesses) x "
                         f"(lookahead_ngram - 1) = ({window} + {guesses}) x {ngram - 1} tokens "
                         f"per sequence; at most {MAX_TREE_TOKENS} fit a tree mask")
    return lookahead_depth_per_size(window, ngram, guesses)


def medusa_tree_paths(group: DictConfig, k: int) -> list[tuple[int, ...]]:
    """The Medusa tree of a speculation group (`tree`; k heads, at most k deep) as paths."""
    tree = group.get("tree")
    tree = OmegaConf.to_container(tree) if isinstance(tree, ListConfig) else tree
    return tree_paths(tree, num_heads=k, max_depth=k)


def tree_policy_config(policy_cfg: DictConfig, depth_per_size: list[int]) -> DictConfig:
    """The policy config of a token-tree run: its size is the tokens a step verifies (fixed:
    the whole tree; adaptive: at most that, choosing by the depth each size reaches)."""
    size = len(depth_per_size) - 1
    policy_cfg = policy_cfg.copy()
    if "num_speculative_tokens" in policy_cfg:
        policy_cfg.num_speculative_tokens = size
    elif "max_num_speculative_tokens" in policy_cfg:
        policy_cfg.max_num_speculative_tokens = size
        policy_cfg.depth_per_size = depth_per_size
    return policy_cfg


def build_replica_executor(cfg: DictConfig, model: ModelSpec, hardware: HardwareSpec, kv_cache,
                           speculation: SpeculationSetup | None = None, replica_id: int = 0):
    """Who runs a step: the executor the backend's config names (`backend.executor`, e.g. the
    real engine, whose pools match the replica's KV manager), else the cost model (sim)."""
    executor_cfg = cfg.backend.get("executor")
    if executor_cfg is not None:
        drafting = {} if speculation is None else {
            "speculative_model": speculation.draft_model,
            "max_num_speculative_tokens": speculation.max_num_speculative_tokens}
        if speculation is not None and speculation.draft_model in TREE_DRAFTERS:
            group = cfg.speculation
            drafting["tree"] = {
                "_target_": "engine.builder.TreeSpeculation",
                "method": speculation.draft_model,
                "max_depth": max(speculation.depth_per_size),
                "medusa_heads": group.get("medusa_heads"),
                "tree": group.get("tree"),
                "lookahead_window": group.get("lookahead_window", 4),
                "lookahead_ngram": group.get("lookahead_ngram"),
                "lookahead_guesses": group.get("lookahead_guesses", 4)}
        return build_policy(executor_cfg, "backend.executor", model=model.name,
                            kv_cache=kv_cache, **drafting)
    if cfg.backend.name != "sim":
        raise ValueError(f"backend must be sim or name its executor (backend.executor); got "
                         f"backend.name={cfg.backend.name!r}")
    drafting = {} if speculation is None else {"draft_model": speculation.draft_spec}
    if speculation is not None and speculation.draft_model == "medusa":
        drafting["medusa_num_heads"] = max(speculation.depth_per_size)
    cost_model = build_cost_model(cfg, model, hardware, **drafting)
    if speculation is None:
        return SimExecutor(cost_model)
    # Each replica draws its own acceptances, reproducibly.
    sim_seed = cfg.get("sim_seed", cfg.seed)
    return SimExecutor(cost_model, speculation.acceptance_model([sim_seed, replica_id]),
                       speculation.depth_per_size)


def build_cost_model(cfg: DictConfig, model: ModelSpec, hardware: HardwareSpec, **drafting):
    """The run's cost model (`cost_model`); a GPU cost model whose tables cannot cover the
    hardware (a CPU) falls back to the roofline, and says so in one line (once a process)."""
    from sim.gpu.linear import NoGPUTable

    arguments = dict(model=model, hardware=hardware,
                     tensor_parallel_size=cfg.cluster.tensor_parallel_size, **drafting)
    try:
        return build_policy(cfg.cost_model, "cost_model", **arguments)
    except NoGPUTable:
        fallback = OmegaConf.load(CONF_DIR / "cost_model" / "roofline.yaml")
        for key in ("block_size", "offload_bandwidth_gbps"):   # the run's, as the group had them
            if key in cfg.cost_model:
                fallback[key] = cfg.cost_model[key]
        if (model.name, hardware.name) not in _FELL_BACK:
            _FELL_BACK.add((model.name, hardware.name))
            print(f"twinserve: no GPU measurement covers hardware={hardware.name} "
                  f"(cost_model={_group_name(cfg.cost_model)}); using cost_model=roofline, an "
                  f"uncalibrated spec-sheet estimate", file=sys.stderr)
        return build_policy(fallback, "cost_model", **arguments)


# (model, hardware) pairs whose fallback to the roofline has been said.
_FELL_BACK: set[tuple[str, str]] = set()


def _group_name(group: DictConfig) -> str:
    target = str(group.get("_target_", "?"))
    return {"sim.gpu.cost_model.GPUCostModel": "gpu"}.get(target, target)


def cost_model_summary(executors: list) -> dict:
    """The expected error of the run's kernel times where its cost model states one: the
    leave-one-out error of the kind of transfer it made (data/gpu/transfer_errors.json). It is
    the kernels' error alone; how whole runs compare with real ones is in
    docs/validation-results.md ("Real GPUs")."""
    for executor in executors:
        expected = getattr(getattr(executor, "cost_model", None), "expected_error_pct", None)
        if expected is not None:
            return {"kernel_time_expected_error_pct": float(expected)}
    return {}


def speed_summary(executors: list) -> dict:
    """An engine run normalised to a profile's machine speed (backend.speed_reference): the
    speed factors its probes saw, over every replica, and the wall time they took."""
    summaries = [executor.speed_summary() for executor in executors
                 if hasattr(executor, "speed_summary")]
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
