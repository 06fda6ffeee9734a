"""Optional parts of the KV manager's and the retention policy's contracts, each had whole or not
at all and asked once where the object is built (`policies.checks.has_capability`); other
optional capabilities sit beside what they extend in `policies/protocols.py`."""
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
        """Whether new sequences might get slots for these prefill chunks under the watermark;
        False must be exact, since BaseScheduler then skips the attempt."""


@runtime_checkable
class ExpiringKVRetention(Protocol):
    """A KV retention policy that can tell when it next releases kept blocks by time: without it,
    the simulator runs every step on its own (its repeated steps end there)."""

    def next_expiry(self) -> float:
        """When the next kept blocks are released by time (inf: none)."""


@runtime_checkable
class PinningKVCache(Protocol):
    """A KV manager that can keep a finished sequence's cached blocks held, unevictable, under a
    key, until released (kv_retention=pin)."""

    enable_prefix_caching: bool   # pinned blocks are found again by their prefix hashes

    def retain(self, seq: Sequence, key: int) -> int:
        """Free `seq` but keep one reference to each block of its cached, computed prefix under
        `key` (none may be held under it); returns how many blocks are kept."""
    def release(self, key: int) -> int:
        """Drop the references kept under `key` (a block no one else holds becomes an
        evictable cached block); returns how many there were."""
    def num_retained_blocks(self) -> int:
        """Device blocks kept under any key, each counted once."""


@runtime_checkable
class TierRetainingKVCache(Protocol):
    """A KV manager that can move a finished sequence's cached blocks to its prefix cache's host
    tier at once (kv_retention=offload)."""

    num_offload_blocks: int   # host tier slots (0: no tier to move them to)

    def free_to_tier(self, seq: Sequence) -> int:
        """Free `seq` and store each of its cached blocks that no one else holds in the host
        tier (a store in the next plan), leaving the device block uncached; returns how many."""
