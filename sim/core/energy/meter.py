"""Each replica's energy as its steps go: the step recorder hands every step, or run of repeated
steps, to the replica's `EnergyMeter`, which adds the busy joules in O(1); idle time is charged
once, at the summary.
"""
from __future__ import annotations

from functools import reduce
from operator import add

from omegaconf import DictConfig, OmegaConf

from policies.checks import check_policy, has_capability
from policies.protocols import DecodeWorkCostModel, StepWorkCostModel
from policies.types import StepPlan
from sim.core.energy.power import DecodeRunPowerModel, PowerModel, UtilisationPowerModel
from sim.cost.work import ModelStepWork, step_work_one_by_one
from runtime.specs import HardwareSpec, ModelSpec


class EnergyMeter:
    """The busy seconds and joules of one replica of `num_boards` GPUs (tensor_parallel_size:
    each board draws the power model's watts), the work of each step from `work`."""

    __slots__ = ("power_model", "num_boards", "busy_s", "busy_j", "_step_work",
                 "_busy_energy_j", "_decode_work_terms")

    def __init__(self, power_model: PowerModel, work: StepWorkCostModel, num_boards: int = 1):
        self.power_model = power_model
        self.num_boards = num_boards
        self.busy_s = 0.0
        self.busy_j = 0.0   # all boards' joules during steps, their idle power included
        # Bound once: add_step runs every step.
        self._step_work, self._busy_energy_j = work.step_work, power_model.busy_energy_j
        # A run of decodes costs one call where the work is linear and the power model takes it.
        self._decode_work_terms = None
        if (has_capability(work, DecodeWorkCostModel, "cost_model")
                and has_capability(power_model, DecodeRunPowerModel, "power")):
            self._decode_work_terms = work.decode_work_terms()

    def add_step(self, plan: StepPlan, duration: float) -> None:
        flops, bytes_moved = self._step_work(plan)
        self.busy_s += duration
        self.busy_j += self.num_boards * self._busy_energy_j(duration, flops, bytes_moved)

    def add_repeated_steps(self, plan: StepPlan, durations: list[float]) -> None:
        """A run of len(durations) repeated decode steps of `plan`: add_step's sums, so a run's
        joules do not depend on how its steps were grouped."""
        num_decodes, busy_s, busy_j = plan.num_decode_seqs, self.busy_s, self.busy_j
        if (self._decode_work_terms is not None and num_decodes and not plan.blocks_to_copy
                and not plan.num_prefill_tokens and not plan.num_draft_tokens):
            busy_j = self.power_model.add_decode_run_j(
                busy_j, self.num_boards, durations, self._decode_work_terms, num_decodes,
                plan.decode_context_tokens)
            busy_s = reduce(add, durations, busy_s)   # (busy_s += each, in one C loop)
        else:
            flops, bytes_moved = step_work_one_by_one(self._step_work, plan, len(durations))
            for duration, step_j in zip(durations, map(self._busy_energy_j, durations, flops,
                                                       bytes_moved)):
                busy_s += duration
                busy_j += self.num_boards * step_j
        self.busy_s, self.busy_j = busy_s, busy_j

    def energy_j(self, span_s: float) -> float:
        """All boards' joules over a run of `span_s` seconds: the steps', and idle power the
        rest of the time (a replica is powered for the whole run)."""
        idle_s = max(span_s - self.busy_s, 0.0)
        return self.busy_j + self.num_boards * self.power_model.idle_power_w * idle_s


def build_power_model(power_cfg: DictConfig | None, hardware: HardwareSpec) -> PowerModel:
    """The run's power model for `hardware` from its `power` group (None: the default
    UtilisationPowerModel); its `_target_` is any class taking `hardware` and the group's keys."""
    if power_cfg is None:
        return UtilisationPowerModel(hardware)
    fields = OmegaConf.to_container(power_cfg, resolve=True) if isinstance(
        power_cfg, DictConfig) else dict(power_cfg)
    if not isinstance(fields, dict):
        raise ValueError(f"power must be a mapping with a _target_, got {power_cfg!r}")
    target = fields.pop("_target_", None)
    if target is None:
        return UtilisationPowerModel(hardware, **_checked_keys(fields))
    from hydra.utils import get_class
    model = get_class(target)(hardware, **fields)
    check_policy(model, PowerModel, "power")
    return model


def _checked_keys(fields: dict) -> dict:
    allowed = ("compute_saturation", "memory_weight")
    unknown = sorted(set(fields) - set(allowed))
    if unknown:
        raise ValueError(f"power: unknown key(s) {unknown}; UtilisationPowerModel takes "
                         f"{', '.join(allowed)}")
    return fields


def build_energy_meter(power_cfg: DictConfig | None, model: ModelSpec, hardware: HardwareSpec,
                       tensor_parallel_size: int, block_size: int,
                       cost_model=None,
                       meter_class: type[EnergyMeter] = EnergyMeter) -> EnergyMeter:
    """A replica's meter: its work from `cost_model` where it says (StepWorkCostModel), else from
    the model's shape."""
    if cost_model is not None and has_capability(cost_model, StepWorkCostModel, "cost_model"):
        work = cost_model
    else:
        work = ModelStepWork(model, tensor_parallel_size, block_size)
    return meter_class(build_power_model(power_cfg, hardware), work, tensor_parallel_size)
