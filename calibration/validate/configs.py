"""The two runs' configs: composed from the repo's conf/ and the same overrides, identical but for
the backend (`engine`, and `sim` with the profiled cost model), over the same KV pool."""
from __future__ import annotations

from calibration.validate.compare import ValidationInputError
from runtime.policy_config import CONF_DIR



def compose_configs(overrides: list[str]):
    """(engine config, sim config) from conf/ plus `overrides`, identical but for the backend and
    sized by the engine's memory arithmetic, so that both schedule over the same KV pool."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    reserved = [o for o in overrides
                if o.split("=", 1)[0].lstrip("+~") in ("backend", "cost_model")]
    if reserved:
        raise ValidationInputError(f"{reserved}: validation sets the backend (engine and sim) "
                                   f"and the cost model (profiled) itself; pass "
                                   f"cost_model.profile=<path> or --profile")
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
            base = ["progress=false", "cost_model=profiled", *overrides]
            engine_cfg = compose("config", overrides=[*base, "backend=engine"])
            sim_cfg = compose("config", overrides=[*base, "backend=sim"])
    except (HydraException, OmegaConfBaseException) as error:
        raise ValidationInputError(f"bad override: {error}") from None
    if OmegaConf.is_missing(sim_cfg.cost_model, "profile"):
        raise ValidationInputError("no profile: pass cost_model.profile=<path> or --profile <path> "
                                   "(profiles/<device>/<model>.json from twinserve-profile)")
    if not sim_cfg.workload.get("with_token_ids", False):
        raise ValidationInputError("the engine needs token ids: add workload.with_token_ids=true")
    return engine_cfg, sim_cfg


def pin_kv_pool(engine_cfg, sim_cfg) -> int:
    """Set kv_cache.num_blocks of both configs to the engine's pool size."""
    from omegaconf import open_dict

    from sim.core.build import num_kv_blocks
    from sim.core.settings import replica_settings
    from runtime.specs import HardwareSpec, ModelSpec

    model = ModelSpec.from_config(engine_cfg.model)
    hardware = HardwareSpec.from_config(engine_cfg.hardware)
    blocks = num_kv_blocks(replica_settings(engine_cfg, model), hardware)
    for cfg in (engine_cfg, sim_cfg):
        with open_dict(cfg):
            cfg.kv_cache.num_blocks = blocks
    return blocks
