"""The expert step feature of a mixture of experts: HF's expert layers run one matmul per expert a
token reaches, so a step costs per expert touched; the feature is the expected distinct experts
per layer under uniform routing (docs/calibration.md, `--expert-feature`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from policies.types import StepPlan
from sim.cost.experts import expected_experts_touched, inclusion_probabilities, routing_shares

EXPERT_FEATURES: tuple[str, ...] = (
    "experts_touched",             # expected distinct experts the step's tokens reach per layer
)


@dataclass(frozen=True)
class ExpertRouting:
    """What the feature needs: the layer's experts and how many each token is routed to."""

    num_experts: int
    num_experts_per_tok: int
    inclusion: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "inclusion", inclusion_probabilities(
            routing_shares("uniform", self.num_experts), self.num_experts_per_tok))

    def experts_touched(self, num_tokens: float) -> float:
        """Expected distinct experts `num_tokens` tokens reach, each picking
        num_experts_per_tok distinct experts uniformly."""
        return float(expected_experts_touched(self.inclusion, num_tokens))


def expert_features(plan: StepPlan, routing: ExpertRouting | None) -> tuple[float]:
    """The plan's EXPERT_FEATURES (0 without routing: a dense model's profile)."""
    if routing is None:
        return (0.0,)
    return (routing.experts_touched(plan.num_batched_tokens),)


def sample_expert_features(step: dict, routing: ExpertRouting) -> tuple[float]:
    """EXPERT_FEATURES of a profiler sample (its core features by name): the refit of a
    mixture's samples taken without them."""
    tokens = step["num_prefill_tokens"] + step["num_decode_seqs"] + step["num_draft_tokens"]
    return (routing.experts_touched(tokens),)


def profile_routing(metadata: dict) -> ExpertRouting | None:
    """The routing of the model a profile measured (`metadata.model_config`'s num_experts and
    num_experts_per_tok); None for a dense model. A problem is a ValueError naming the field."""
    model_config = metadata.get("model_config") or {}
    num_experts = model_config.get("num_experts") or 0
    if not num_experts:
        return None
    per_token = model_config.get("num_experts_per_tok")
    if (not isinstance(num_experts, int) or not isinstance(per_token, int)
            or not 1 <= per_token <= num_experts):
        raise ValueError(f"metadata.model_config must have integer num_experts and "
                         f"num_experts_per_tok (1..num_experts), got {num_experts!r} and "
                         f"{per_token!r}")
    return ExpertRouting(num_experts, per_token)
