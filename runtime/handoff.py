"""Prefill/decode disaggregation's hand-off, as both backends run it: the prefill scheduler stops
a request after its first token (`take_handoffs`), the decode scheduler admits waiting hand-offs
first come first served (`admit_handoffs`), the backend copies the KV, then the prefill side frees
its blocks and the request decodes (`land`).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from policies.protocols import DecodePoolScheduler, KVCacheManager, PrefillPoolScheduler
from policies.types import Request, Sequence


@dataclass(slots=True)
class Handoff:
    """A request whose KV waits to move from a prefill replica to a decode replica."""

    request: Request
    source_seq: Sequence       # its sequence on the prefill replica, holding the KV
    source_kv: KVCacheManager  # the prefill replica's KV manager, which frees the blocks
    source: object = None      # the backend's prefill replica
    prefill_step_s: float = 0.0   # the step that finished the prompt (what a copy overlaps)

    def free_source(self) -> None:
        """The prefill replica's blocks go back: the KV has moved, or never will."""
        self.source_kv.free(self.source_seq)


def take_handoffs(prefill: PrefillPoolScheduler, source: object = None,
                  prefill_step_s: float = 0.0) -> list[Handoff]:
    """The requests `prefill` stopped after their first token since the last call."""
    return [Handoff(request, request.sequences[0], prefill.kv_cache, source, prefill_step_s)
            for request in prefill.take_handoffs()]


def admit_handoffs(waiting: deque[Handoff], decode: DecodePoolScheduler, now: float,
                   start_copy: Callable[[Handoff], None],
                   rejected: Callable[[Handoff], None] | None = None) -> None:
    """Start the copies of the `waiting` hand-offs, oldest first, while `decode` admits them; one
    it can never hold leaves with its `rejected_reason` and its source blocks freed."""
    while waiting:
        handoff = waiting[0]
        if not decode.admit_transfer(handoff.request, now):
            if handoff.request.rejected_reason is None:
                return   # no room now: a later step of the decode replica frees some
            waiting.popleft()
            handoff.free_source()
            if rejected is not None:
                rejected(handoff)
            continue
        waiting.popleft()
        start_copy(handoff)


def land(handoff: Handoff, decode: DecodePoolScheduler, replica_id: int, now: float) -> None:
    """The KV has moved: the prefill replica frees its blocks and the request decodes on the
    decode replica `replica_id` from its next step."""
    handoff.free_source()
    handoff.request.replica_id = replica_id
    decode.finish_transfer(handoff.request, now)
