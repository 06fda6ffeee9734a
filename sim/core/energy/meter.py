"""Each replica's energy as its steps go: the step recorder (runtime/metrics/recorder.py) hands
every step, or run of repeated decode steps, to the replica's `EnergyMeter`, which adds the busy
joules in O(1); the idle time between steps is charged once, at the summary."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from policies.checks import check_policy, has_capability
from policies.types import StepPlan
from sim.core.energy.power import PowerModel, UtilisationPowerModel
from sim.cost.work import ModelStepWork, StepWorkCostModel
from sim.cost.roofline import RooflineCostModel
from runtime.specs import HardwareSpec, ModelSpec


class EnergyMeter:
    """The busy seconds and joules of one replica of `num_boards` GPUs (tensor_parallel_size:
    each board draws the power model's watts), the work of each step from `work`."""

    __slots__ = ("power_model", "num_boards", "busy_s", "busy_j", "_step_work",
                 "_busy_energy_j", "_decode_constants")

    def __init__(self, power_model: PowerModel, work: StepWorkCostModel, num_boards: int = 1):
        self.power_model = power_model
        self.num_boards = num_boards
        self.busy_s = 0.0
        self.busy_j = 0.0   # all boards' joules during steps, their idle power included
        # (Bound once: add_step runs every step.)
        self._step_work, self._busy_energy_j = work.step_work, power_model.busy_energy_j
        # With the built-in work and power models, a run of repeated decode steps repeats their
        # arithmetic inline (the same operations in the same order: bit for bit add_step's sums)
        # rather than calling both every step (a third of the meter's time in decode runs).
        self._decode_constants = None
        work_terms = (work.decode_terms() if isinstance(work, ModelStepWork) else None)
        if work_terms is not None and type(power_model) is UtilisationPowerModel:
            self._decode_constants = work_terms + power_model.linear_terms()

    def add_step(self, plan: StepPlan, duration: float) -> None:
        flops, bytes_moved = self._step_work(plan)
        self.busy_s += duration
        self.busy_j += self.num_boards * self._busy_energy_j(duration, flops, bytes_moved)

    def add_repeated_steps(self, plan: StepPlan, durations: list[float]) -> None:
        """A run of len(durations) repeated decode steps of `plan`, each as add_step would
        count it on its own (every decode's context a token longer each step; the first step's
        block copies, if any, only in it): the same sums, so a run's joules come out bit for bit
        as when its steps run one by one."""
        step_work, busy_energy_j, num_boards = self._step_work, self._busy_energy_j, self.num_boards
        context, num_decodes, copies = (plan.decode_context_tokens, plan.num_decode_seqs,
                                        plan.blocks_to_copy)
        if (self._decode_constants is not None and num_decodes and not copies
                and not plan.num_prefill_tokens and not plan.num_draft_tokens):
            (flops_per_seq, flops_per_context, weight_bytes, bytes_per_token,
             idle_w, dynamic_w, s_per_flop, s_per_byte) = self._decode_constants
            decode_flops = num_decodes * flops_per_seq
            busy_s, busy_j = self.busy_s, self.busy_j
            # As floats (exact: counts far below 2**53), sparing each step's products
            # the int-to-float conversions.
            context, num_decodes, num_boards = float(context), float(num_decodes), float(num_boards)
            for duration in durations:   # ModelStepWork.step_work, busy_energy_j, add_step
                work_s = ((decode_flops + context * flops_per_context) * s_per_flop
                          + (weight_bytes + (context + num_decodes) * bytes_per_token) * s_per_byte)
                busy_s += duration
                busy_j += num_boards * (idle_w * duration
                                        + dynamic_w * (work_s if work_s < duration else duration))
                context += num_decodes
            self.busy_s, self.busy_j = busy_s, busy_j
            return
        try:
            for step, duration in enumerate(durations):
                if step == 1 and copies:
                    plan.blocks_to_copy = []
                plan.decode_context_tokens = context + step * num_decodes
                flops, bytes_moved = step_work(plan)
                self.busy_s += duration
                self.busy_j += num_boards * busy_energy_j(duration, flops, bytes_moved)
        finally:
            plan.decode_context_tokens, plan.blocks_to_copy = context, copies

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
    """A replica's meter (a `meter_class`): its work from `cost_model` where it says
    (StepWorkCostModel), else from the model's shape (the engine's executor, a profiled or a
    user's cost model)."""
    if isinstance(cost_model, RooflineCostModel):   # (and the GPU cost model: its own work)
        work = cost_model.work
    elif cost_model is not None and has_capability(cost_model, StepWorkCostModel, "cost_model"):
        work = cost_model
    else:
        work = ModelStepWork(model, tensor_parallel_size, block_size)
    return meter_class(build_power_model(power_cfg, hardware), work, tensor_parallel_size)
