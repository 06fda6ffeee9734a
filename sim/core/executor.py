"""The simulator's executor: a step takes as long as the cost model says and produces no token ids
(the scheduler counts one new token for every sequence that reached its last token, plus the
accepted drafts of a speculating one)."""
from __future__ import annotations

from policies.types import StepPlan, StepResult
from sim.core.acceptance import AcceptanceModel


class SimExecutor:
    """Satisfies `policies.protocols.Executor` with any object that has `step_time(plan)`; with an
    acceptance model it also draws how many drafts each speculating sequence keeps.

    A cost model whose `step_time` reads only the plan's aggregate features says so
    (`reads_only_aggregates = True`): then a decode batch repeated over several steps is costed
    step by step from its aggregates alone (`repeated_step_times`), and the step loop may run
    those steps as one event."""

    def __init__(self, cost_model, acceptance_model: AcceptanceModel | None = None,
                 depth_per_size: list[int] | None = None):
        self.cost_model = cost_model
        self.acceptance_model = acceptance_model
        # Token trees (Medusa, lookahead): a plan's spec_lens are the tokens a step verifies,
        # depth_per_size[k] the most it can accept, over which acceptances are drawn per depth
        # (per node instead where the acceptance model has the fixed tree: Medusa's).
        self.depth_per_size = depth_per_size
        self.repeats_steps = getattr(cost_model, "reads_only_aggregates", False)

    def repeated_step_times(self, plan: StepPlan, num_steps: int):
        """The durations of `num_steps` steps of the decode batch `plan`, one at a time (each
        draws its own noise, as separate steps would): in step j every decode reads j more
        tokens of context. Stop iterating early (and close it) to draw no more."""
        repeated_step_times = getattr(self.cost_model, "repeated_step_times", None)
        if repeated_step_times is not None:   # the cost model's own, faster, same numbers
            return repeated_step_times(plan, num_steps)
        return self._step_times_one_by_one(plan, num_steps)

    def _step_times_one_by_one(self, plan: StepPlan, num_steps: int):
        """repeated_step_times from `step_time`, the plan's decode context moved each step."""
        context = plan.decode_context_tokens
        try:
            for step in range(num_steps):
                plan.decode_context_tokens = context + step * plan.num_decode_seqs
                yield self.cost_model.step_time(plan)
        finally:
            plan.decode_context_tokens = context

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
