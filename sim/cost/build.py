"""Builds a replica's cost model from its `cost_model` group and sizes, and the summary keys a
cost model states."""
from __future__ import annotations

import inspect

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from policies.checks import check_policy, has_capability
from policies.protocols import CostModel, StatesExpectedError
from runtime.policy_config import CONF_DIR, build_policy
from runtime.specs import HardwareSpec, ModelSpec
from sim.core.say_once import say_once
from sim.cost.pipeline import pipeline_cost_model, stage_layers, stage_shape


def build_cost_model(group: DictConfig, sizes, model: ModelSpec, hardware: HardwareSpec,
                     **drafting):
    """The cost model of the `cost_model` group at a replica's `sizes` (sim/core/settings.py's
    ReplicaSettings); a GPU cost model whose tables cannot cover the hardware (a CPU) falls back
    to the roofline and says so once a process. With pipeline stages, the pipeline over each
    stage's layers (sim/cost/pipeline.py)."""
    arguments = dict(hardware=hardware, tensor_parallel_size=sizes.tensor_parallel_size,
                     **drafting)
    if sizes.expert_parallel_size > 1:   # (a cost model without experts never sees it)
        arguments["expert_parallel_size"] = sizes.expert_parallel_size
    stages = sizes.pipeline_parallel_size
    if stages == 1:
        return _base_cost_model(group, model, arguments)
    layers = stage_layers(model.num_layers, stages)
    by_layers = {num_layers: _base_cost_model(group, stage_shape(model, num_layers), arguments)
                 for num_layers in set(layers)}
    return pipeline_cost_model([by_layers[num_layers] for num_layers in layers])


def _base_cost_model(group: DictConfig, model: ModelSpec, arguments: dict):
    from sim.cost.gpu.linear import NoGPUTable

    hardware = arguments["hardware"]
    try:
        cost_model = build_policy(group, "cost_model", model=model, **arguments)
    except NoGPUTable:
        fallback, carried = _roofline_fallback(group, hardware)
        kept = "".join(f" cost_model.{key}={value}" for key, value in carried.items())
        # Said once per (model, hardware) pair, whatever overrides the later runs carry.
        say_once(f"twinserve: no GPU measurement covers hardware={hardware.name} "
                 f"(cost_model={group_name(group)}); using cost_model=roofline, an "
                 f"uncalibrated spec-sheet estimate{' with' + kept if kept else ''}",
                 key=("roofline fallback", model.name, hardware.name))
        cost_model = build_policy(fallback, "cost_model", model=model, **arguments)
    check_policy(cost_model, CostModel, "cost_model")
    return cost_model


# Settings every cost model group carries from the run (kv_cache's), not the user's choice.
_RUN_SETTINGS = ("block_size", "offload_bandwidth_gbps")


def _roofline_fallback(group: DictConfig, hardware: HardwareSpec) -> tuple[DictConfig, dict]:
    """The roofline's config for a run whose cost model `group` covers no GPU near `hardware`,
    with the run's settings and the user's changes carried in (one line naming any it lacks)."""
    fallback = OmegaConf.load(CONF_DIR / "cost_model" / "roofline.yaml")
    for key in _RUN_SETTINGS:   # the run's, as the group had them
        if key in group:
            fallback[key] = group[key]
    changed = _changed_settings(group)   # (a terms_file too: the roofline reads its own)
    refused = [key for key in changed if not takes_argument(fallback, key)]
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
    """The group's settings that differ from its conf file's, interpolations unresolved so that
    the run's own are not counted."""
    path = CONF_DIR / "cost_model" / f"{group_name(group)}.yaml"
    defaults = OmegaConf.to_container(OmegaConf.load(path), resolve=False) if path.exists() else {}
    given = OmegaConf.to_container(group, resolve=False)
    return {key: value for key, value in given.items()
            if key not in ("_target_", "_convert_", *_RUN_SETTINGS)
            and (key not in defaults or defaults[key] != value)}


def takes_argument(group: DictConfig, name: str) -> bool:
    """Whether the group's `_target_` takes the keyword `name` (True where it does not import:
    building it says why)."""
    try:
        parameters = inspect.signature(get_class(str(group.get("_target_")))).parameters
    except Exception:
        return True
    return name in parameters or any(parameter.kind is parameter.VAR_KEYWORD
                                     for parameter in parameters.values())


# The conf/cost_model group of each shipped cost model class.
_COST_MODEL_GROUPS = {"sim.cost.gpu.cost_model.GPUCostModel": "gpu",
                      "sim.cost.profiled.cost_model.ProfiledCostModel": "profiled",
                      "sim.cost.roofline.RooflineCostModel": "roofline"}


def group_name(group: DictConfig) -> str:
    target = str(group.get("_target_", "?"))
    return _COST_MODEL_GROUPS.get(target, target)


def cost_model_group(cost_model) -> str:
    """The conf/cost_model name of a built cost model (its class path where none ships it)."""
    target = f"{type(cost_model).__module__}.{type(cost_model).__qualname__}"
    return _COST_MODEL_GROUPS.get(target, target)


def cost_model_summary(cost_models: list, fixed_in_flight: bool = False) -> dict:
    """The expected TTFT, TPOT and E2E error where the cost model states one (its leave-out
    checks' 80th percentile; a closed loop's checks with `fixed_in_flight`)."""
    from sim.cost.gpu.expected_errors import expected_errors_for
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
