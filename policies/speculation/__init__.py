"""Speculation policies: how many draft tokens each decode proposes per step."""
from policies.speculation.policies import (AcceptanceCounts, AdaptiveSpeculation,
                                           FixedSpeculation, NoSpeculation,
                                           expected_tokens_per_step, max_speculative_tokens)

__all__ = ["AcceptanceCounts", "AdaptiveSpeculation", "FixedSpeculation", "NoSpeculation",
           "expected_tokens_per_step", "max_speculative_tokens"]
