"""Preemption policies: which running request gives its KV memory back, and how."""
from policies.preemption.recompute_swap import RecomputePreemption, SwapPreemption

__all__ = ["RecomputePreemption", "SwapPreemption"]
