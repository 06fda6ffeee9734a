"""A validation grid is a Hydra sweep, parsed with Hydra's public override parser; the jobs come
in the order Hydra's basic sweeper runs a multirun, so that job numbers match a `--multirun`'s."""
from __future__ import annotations

import itertools

from calibration.validate.compare import ValidationInputError


def expand_sweep(overrides: list[str]) -> list[list[str]]:
    """Every combination of the overrides' values, the last swept key varying fastest (a key
    given twice keeps its first place and its last values); `overrides` alone when nothing
    sweeps."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as error:
        raise ValidationInputError(f"bad override: {error}") from None
    if not any(override.is_sweep_override() for override in parsed):
        return [list(overrides)]
    axes: dict[str, list[str]] = {}   # one axis per key, in the order keys first appear
    for override in parsed:
        key = override.get_key_element()
        if not override.is_sweep_override():
            axes[key] = [f"{key}={override.get_value_element_as_str()}"]
        elif not override.is_discrete_sweep():
            raise ValidationInputError(f"bad override {override.input_line!r}: a validation grid "
                                       f"sweeps lists of values; interval() needs a sweeper "
                                       f"that samples")
        else:
            try:
                axes[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
            except HydraException:   # glob(), which needs the config groups of a Hydra app
                raise ValidationInputError(f"bad override {override.input_line!r}: a validation "
                                           f"grid cannot expand glob(); list the values "
                                           f"instead") from None
    return [list(job) for job in itertools.product(*axes.values())]


def swept_values(jobs: list[list[str]]) -> list[dict[str, str]]:
    """Per job, {key: value} of the overrides that differ between jobs."""
    parsed = [dict(o.split("=", 1) if "=" in o else (o, "") for o in job) for job in jobs]
    keys = [key for key in parsed[0] if len({p.get(key) for p in parsed}) > 1]
    return [{key: p.get(key, "") for key in keys} for p in parsed]
