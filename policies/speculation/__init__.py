"""Speculation policies: how many draft tokens each decode proposes per step."""
from policies.speculation.draft_length import (AcceptanceCounts, AdaptiveSpeculation,
                                           FixedSpeculation, NoSpeculation,
                                           expected_tokens_per_step, max_speculative_tokens)

__all__ = ["AcceptanceCounts", "AdaptiveSpeculation", "FixedSpeculation", "NoSpeculation",
           "expected_tokens_per_step", "max_speculative_tokens"]
