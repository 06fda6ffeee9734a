"""Typed reads of the `workload` config whose errors name the field's dotted path, the random
streams and the per-request arrays each kind hands back."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from omegaconf import OmegaConf

from policies import validators

# Request's tenant where a class or a trace row names none.
DEFAULT_TENANT = "default"

REQUIRED = object()


class Streams(NamedTuple):
    """One independent generator per drawn quantity (build_workload's spawn order)."""

    arrival: np.random.Generator
    prompt: np.random.Generator
    output: np.random.Generator
    token: np.random.Generator
    classes: np.random.Generator
    turns: np.random.Generator
    think: np.random.Generator
    tool: np.random.Generator   # the agent kind's tool results


@dataclass
class RequestArrays:
    """What one workload kind drew, as parallel per-request arrays and settings."""

    arrival_times: np.ndarray
    prompt_lens: np.ndarray
    output_lens: np.ndarray
    n: int
    token_spec: tuple[int, int] | None   # (vocab_size, shared_prefix_len) with token ids
    token_ids: list[list[int]] | None = None
    metadata: dict[str, list] = field(default_factory=dict)


def as_plain_dict(cfg: Any) -> dict:
    if OmegaConf.is_config(cfg):
        # resolve=True so interpolations such as ${oc.env:...} in trace_path become strings.
        cfg = OmegaConf.to_container(cfg, resolve=True)
    if not isinstance(cfg, Mapping):
        raise ValueError(f"workload config must be a mapping, got {type(cfg).__name__}")
    return dict(cfg)


class Fields:
    """Typed reads from one config mapping; errors name the field by its full dotted path."""

    def __init__(self, values: Mapping[str, Any], path: str):
        self.values = values
        self.path = path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}"

    def get(self, key: str, default: Any) -> Any:
        value = self.values.get(key, default)
        if value is REQUIRED:
            raise ValueError(f"{self.name(key)} is required")
        return value

    def reject_unknown(self, known: Sequence[str]) -> None:
        # Catches typos (`num_request=1000`) that would otherwise be silently ignored.
        for key in self.values:
            if key not in known:
                raise ValueError(f"{self.name(key)} is not a known field; known fields: "
                                 f"{', '.join(known)}")

    def choice(self, key: str, options: Sequence[str], default: Any = REQUIRED) -> str:
        value = self.get(key, default)
        if value not in options:
            raise ValueError(f"{self.name(key)} must be one of {', '.join(options)}; got {value!r}")
        return value

    def integer(self, key: str, *, default: Any = REQUIRED, minimum: int | None) -> int | None:
        value = self.get(key, default)
        if value is None and default is None:
            return None
        # bool is an int subclass; `n: true` is a mistake, not 1. Integral floats (1e4) are fine.
        is_integral = (isinstance(value, (int, np.integer)) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
        if not is_integral:
            raise ValueError(f"{self.name(key)} must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise ValueError(f"{self.name(key)} must be >= {minimum}, got {value!r}")
        return int(value)

    def number(self, key: str, *, default: Any = REQUIRED, greater_than: float | None = None,
               allow_inf: bool = False) -> float | None:
        value = self.get(key, default)
        if value is None and default is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise ValueError(f"{self.name(key)} must be a number, got {value!r}")
        if math.isnan(value) or (math.isinf(value) and not allow_inf):
            raise ValueError(f"{self.name(key)} must be a finite number, got {value!r}")
        # Written as `not >` so NaN fails too.
        if greater_than is not None and not value > greater_than:
            raise ValueError(f"{self.name(key)} must be > {greater_than:g}, got {value!r}")
        return float(value)

    def rate(self, key: str) -> float:
        # A YAML `inf` (without the dot) or a plain-dict "inf" arrives as a string.
        value = self.get(key, REQUIRED)
        if isinstance(value, str) and value.strip().lower() in ("inf", ".inf", "infinity"):
            return math.inf
        return self.number(key, greater_than=0.0, allow_inf=True)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, (bool, np.bool_)):
            raise ValueError(f"{self.name(key)} must be true or false, got {value!r}")
        return bool(value)

    def string(self, key: str) -> str:
        value = self.get(key, REQUIRED)
        if not isinstance(value, (str, Path)) or not str(value):
            raise ValueError(f"{self.name(key)} must be a non-empty path string, got {value!r}")
        return str(value)

    def section(self, key: str) -> "Fields":
        value = self.get(key, REQUIRED)
        if not isinstance(value, Mapping):
            raise ValueError(f"{self.name(key)} must be a mapping such as "
                             f"{{dist: lognormal, mean: 512, sigma: 1.0}}, got {value!r}")
        return Fields(value, self.name(key))


def parse_common(fields: Fields, vocab_size: int | None, *,
                  with_token_ids_default: bool = False) -> tuple[int, tuple[int, int] | None]:
    """`n` and the token-id settings every kind shares; token spec is (vocab_size, prefix_len)."""
    n = fields.integer("n", default=1, minimum=1)
    with_token_ids = fields.boolean("with_token_ids", default=with_token_ids_default)
    shared_prefix_len = fields.integer("shared_prefix_len", default=0, minimum=0)
    if not with_token_ids:
        if shared_prefix_len:
            # A shared prefix only exists in token ids; without them it would silently do nothing.
            raise ValueError(f"{fields.name('shared_prefix_len')}={shared_prefix_len} needs "
                             f"{fields.name('with_token_ids')}=true")
        return n, None
    if vocab_size is None:
        raise ValueError(f"{fields.name('with_token_ids')}=true needs a vocab_size: call "
                         f"build_workload(cfg, seed=..., vocab_size=...)")
    # A model config's numpy integer is as good as an int.
    vocab_size = validators.positive_int(
        "vocab_size", int(vocab_size) if isinstance(vocab_size, np.integer) else vocab_size)
    return n, (vocab_size, shared_prefix_len)
