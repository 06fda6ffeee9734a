"""The simulator's executor: a step takes as long as the cost model says and produces no token
ids (the scheduler counts the tokens).
"""
from __future__ import annotations

from policies.checks import has_capability
from policies.types import StepPlan, StepResult
from sim.core.acceptance import AcceptanceModel
from sim.core.repeated_steps import RepeatedStepsCostModel


class SimExecutor:
    """Satisfies `policies.protocols.Executor` with any object that has `step_time(plan)`; with an
    acceptance model it also draws how many drafts each speculating sequence keeps."""

    def __init__(self, cost_model, acceptance_model: AcceptanceModel | None = None,
                 depth_per_size: list[int] | None = None, *, repeated_steps: bool = True):
        self.cost_model = cost_model
        self.acceptance_model = acceptance_model
        # Token trees verify spec_lens tokens but accept at most depth_per_size[k] of them.
        self.depth_per_size = depth_per_size
        self.runs_repeated_steps = (
            repeated_steps and has_capability(cost_model, RepeatedStepsCostModel, "cost_model")
            and cost_model.costs_repeated_steps)

    def repeated_step_times(self, plan: StepPlan, num_steps: int):
        """The durations of `num_steps` steps of the decode batch `plan`, one at a time, each
        drawing its own noise; close it early to draw no more."""
        return self.cost_model.repeated_step_times(plan, num_steps)

    def execute(self, plan: StepPlan) -> StepResult:
        duration = self.cost_model.step_time(plan)
        if not plan.spec_lens:
            return StepResult(duration=duration)
        if self.acceptance_model is None:
            raise ValueError("the plan speculates but the simulator has no acceptance model "
                             "(set speculation.acceptance_rate or speculation.acceptance_profile)")
        if self.acceptance_model.tree is not None:   # a fixed tree measured per node
            accepted = self.acceptance_model.draw_tree(plan.spec_lens)
        else:
            depths = plan.spec_lens if self.depth_per_size is None else {
                seq_id: self.depth_per_size[size] for seq_id, size in plan.spec_lens.items()}
            accepted = self.acceptance_model.draw(
                depths, fresh_each_step=self.depth_per_size is not None)
        return StepResult(duration=duration, num_accepted=dict(zip(plan.spec_lens, accepted)))
