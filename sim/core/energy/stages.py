"""A pipelined replica's energy: one EnergyMeter per pipeline stage, charged the seconds its stage
works on each step at that stage's work, and idle power the rest of the run.
"""
from __future__ import annotations

from policies.types import StepPlan
from sim.core.energy.meter import EnergyMeter


class StagesEnergyMeter:
    """A pipelined replica's energy: one EnergyMeter per stage (its tp boards, its work)."""

    def __init__(self, stages: list[EnergyMeter]):
        self.stages = stages
        self.power_model = stages[0].power_model
        self.num_boards = sum(meter.num_boards for meter in stages)

    def add_stages(self, plan: StepPlan, stage_times: list[float]) -> None:
        for meter, duration in zip(self.stages, stage_times):
            meter.add_step(plan, duration)

    def energy_j(self, span_s: float) -> float:
        """Every stage's joules over a run of `span_s` seconds, idle time included."""
        return sum(meter.energy_j(span_s) for meter in self.stages)
