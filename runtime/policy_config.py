"""Policies named in config (a conf/ group name, a dotted class path or a {_target_: ...}
mapping), built so a bad name or argument is one clear line."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf

import conf

CONF_DIR = Path(conf.__file__).parent
MODEL_CONFIG_DIR = CONF_DIR / "model"


def config_names(group: str) -> list[str]:
    """The configs of a conf/ group, by name."""
    return sorted(path.stem for path in (CONF_DIR / group).glob("*.yaml"))


def policy_config(choice, group: str, field: str | None = None) -> DictConfig:
    """The config of a policy as a user names it; `field` names the setting in errors."""
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


def names_a_policy(choice) -> bool:
    """Whether a policy setting names its policy rather than being the object itself."""
    return isinstance(choice, (str, Mapping, DictConfig))
