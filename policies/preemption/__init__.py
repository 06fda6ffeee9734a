"""Preemption policies: which running request gives its KV memory back, and how."""
from policies.preemption.policies import RecomputePreemption, SwapPreemption

__all__ = ["RecomputePreemption", "SwapPreemption"]
