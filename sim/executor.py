"""The simulator's executor: a step takes as long as the cost model says and produces no token ids
(the scheduler counts one new token for every sequence that reached its last token)."""
from __future__ import annotations

from policies.types import StepPlan, StepResult


class SimExecutor:
    """Satisfies `policies.protocols.Executor` with any object that has `step_time(plan)`."""

    def __init__(self, cost_model):
        self.cost_model = cost_model

    def execute(self, plan: StepPlan) -> StepResult:
        return StepResult(duration=self.cost_model.step_time(plan))
