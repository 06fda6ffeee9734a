"""Optional parts of the KV manager's contract, each a typed protocol that an object has whole or
not at all, asked once where the object is built (`policies.checks.has_capability`): a host tier
for its prefix cache (`OffloadingKVCache`), a cheap refusal of an admission before trying it
(`AdmissionCheckingKVCache`). The other optional capabilities sit beside what they extend: an
online length predictor, a bounded scheduler, prefill/decode pool schedulers, a cost model that
states its error and an executor that reports its speed in `policies/protocols.py`; the repeated
decode steps' protocols in `policies/decode_run.py`.
"""
from __future__ import annotations

from typing import Protocol, Sequence as Seq, runtime_checkable

from policies.types import Sequence


@runtime_checkable
class OffloadingKVCache(Protocol):
    """A KV manager with a host tier for its prefix cache (PagedBlockManager with
    num_offload_blocks > 0): BaseScheduler puts its stores and loads into each plan."""

    num_offload_blocks: int   # host tier slots: sizes the engine's tier pool

    def take_pending_offload(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The (device, tier) stores and (tier, device) loads decided since the last call."""
    def num_loaded_prefix_tokens(self, seq: Sequence) -> int:
        """Of the tokens allocate_prefix gave `seq`, those loaded from the tier
        (`Request.num_host_cached_tokens`)."""


@runtime_checkable
class AdmissionCheckingKVCache(Protocol):
    """A KV manager that can tell, cheaply, that an admission's allocation would fail."""

    def may_allocate_new(self, num_tokens: Seq[int]) -> bool:
        """Whether new sequences holding no blocks might get slots for these lengths (their
        prefill chunks, counted as if nothing were cached) with the watermark. False must be
        exact (allocate_slots with watermark=True would fail for one of them): BaseScheduler
        then skips the attempt; without this member it tries the allocation and undoes it."""
