"""Recompute and swap preemption (vLLM paper, section 4.5); both evict the latest arrival, and a
subclass picks another victim by overriding `select_victim`."""
from __future__ import annotations

from typing import Literal, Sequence as Seq

from policies.types import Request
from policies.validators import non_negative_number


class RecomputePreemption:
    """Free the victim's blocks and requeue it; its prompt and generated tokens are recomputed
    when it is admitted again."""

    def __init__(self, swap_space_gb: float = 0.0):
        non_negative_number("preemption.swap_space_gb", swap_space_gb)
        # The host pool is sized from this by whoever builds the KV manager.
        self.swap_space_gb = float(swap_space_gb)

    def select_victim(self, running: Seq[Request]) -> Request:
        return max(running, key=lambda request: (request.arrival_time, request.request_id))

    def mode(self, request: Request, kv_cache) -> Literal["recompute", "swap"]:
        return "recompute"


class SwapPreemption(RecomputePreemption):
    """Move the victim's blocks to the host pool; swap them back before admitting newer requests.
    Falls back to recompute when the host pool cannot take them."""

    def __init__(self, swap_space_gb: float = 4.0):
        super().__init__(swap_space_gb)

    def mode(self, request: Request, kv_cache) -> Literal["recompute", "swap"]:
        if kv_cache.can_swap_out(request.unfinished_sequences()):
            return "swap"
        return "recompute"
