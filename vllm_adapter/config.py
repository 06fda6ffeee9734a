"""The plug-in's config: composed from conf/ with the simulator's Hydra names in twinserve's venv
(`plugin_config`), handed to vLLM's process as JSON in an environment variable
(`PLUGIN_ENV`), and built there into a `PluginHost` (`build_host`)."""
from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping

from vllm_adapter.host import KVCacheView, PluginHost

# The environment variable that carries the plug-in's config (JSON) into vLLM's process.
PLUGIN_ENV = "TWINSERVE_VLLM_PLUGIN"
# The config groups the adapter hosts; every other setting is vLLM's own (a `vllm serve` flag).
HOSTED_GROUPS = ("scheduler", "preemption", "predictor")
HOSTED_KEYS = (*HOSTED_GROUPS, "seed")


def override_key(override: str) -> str:
    """The config key an override sets: `++scheduler.max_wait_s=5` -> scheduler."""
    return override.split("=", 1)[0].lstrip("+~").split(".", 1)[0]


def plugin_config(overrides: list[str]) -> dict:
    """{scheduler, preemption, predictor: their resolved configs, seed} from conf/ and the
    overrides. A key the adapter does not host, or a group name conf/ lacks, raises ValueError in
    one line naming it."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from runtime.policy_config import CONF_DIR, config_names

    for override in overrides:
        key = override_key(override)
        if key not in HOSTED_KEYS:
            raise ValueError(f"{override.split('=', 1)[0]}: twinserve-vllm hosts only "
                             f"{', '.join(HOSTED_GROUPS)} (and seed) in vLLM; set vLLM's own "
                             f"settings as vllm serve flags (e.g. --block-size, "
                             f"--kv-cache-memory-bytes)")
        name, _, value = override.partition("=")
        if name == key and key in HOSTED_GROUPS and value not in config_names(key):
            raise ValueError(f"{key}={value}: not one of {', '.join(config_names(key))} "
                             f"(conf/{key}); a class of your own is {key}._target_=module.Class")
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            cfg = compose("config", overrides=list(overrides))
        config = {group: OmegaConf.to_container(cfg[group], resolve=True)
                  for group in HOSTED_GROUPS}
    except (HydraException, OmegaConfBaseException) as error:
        raise ValueError(f"bad override: {str(error).splitlines()[0]}") from None
    config["seed"] = cfg.seed
    return config


def plugin_env(config: Mapping) -> dict[str, str]:
    """The environment entry that hands `config` to vLLM's process."""
    return {PLUGIN_ENV: json.dumps(config)}


def config_from_env() -> dict:
    """The plug-in's config in vLLM's process; one line when it was not handed over."""
    text = os.environ.get(PLUGIN_ENV)
    if not text:
        raise ValueError(f"{PLUGIN_ENV} is not set: start vLLM with twinserve-vllm, or set it to "
                         f"the JSON of vllm_adapter.config.plugin_config([...overrides])")
    return json.loads(text)


def build_host(config: Mapping, *, block_size: int, num_blocks: int, max_model_len: int,
               num_free_blocks: Callable[[], int] | None = None) -> PluginHost:
    """The plug-in scheduler (built as the simulator builds it, over a view of vLLM's KV cache),
    its preemption policy and length predictor, checked for what vLLM can host."""
    from omegaconf import OmegaConf

    from policies.checks import check_policy
    from policies.protocols import Scheduler
    from runtime.assembly import build_predictor, build_preemption
    from runtime.policy_config import build_policy
    from runtime.kv_sizing import step_token_budget

    preemption = build_preemption(OmegaConf.create(dict(config["preemption"])))
    scheduler_cfg = OmegaConf.create(dict(config["scheduler"]))
    budget = step_token_budget(scheduler_cfg.get("max_num_batched_tokens"), max_model_len,
                               "scheduler.max_num_batched_tokens")
    scheduler = build_policy(scheduler_cfg, "scheduler",
                             kv_cache=KVCacheView(block_size, num_blocks, num_free_blocks),
                             preemption=preemption, max_model_len=max_model_len,
                             max_num_batched_tokens=budget)
    check_policy(scheduler, Scheduler, "scheduler")
    predictor = config.get("predictor")
    predictor = build_predictor(OmegaConf.create(dict(predictor)), config.get("seed", 0)) \
        if predictor else None
    return PluginHost(scheduler, predictor)
