"""Optional parts of the contract, each a typed protocol that an object has whole or not at all,
checked once where the object is built (`has_capability`): a KV manager with a host tier for its
prefix cache (`OffloadingKVCache`), one that can refuse an admission before trying it
(`AdmissionCheckingKVCache`); the repeated decode steps' protocols are in `policies/decode_run.py`.
"""
from __future__ import annotations

from typing import Protocol, Sequence as Seq, runtime_checkable

from policies.types import Sequence


def protocol_members(protocol: type) -> list[str]:
    """The attributes and methods a protocol lists, in the order it lists them."""
    members = list(vars(protocol).get("__annotations__", {}))
    members += [name for name, value in vars(protocol).items()
                if not name.startswith("_") and name not in members
                and (callable(value) or isinstance(value, property))]
    return members


def has_capability(obj: object, protocol: type, role: str) -> bool:
    """Whether `obj`, the run's `role` (a config key such as "kv_cache"), has the optional
    `protocol`: False when it has none of its members; a ValueError naming the first member it
    lacks when it has only some (a capability half written is a mistake, not an opt-out)."""
    members = protocol_members(protocol)
    present = [hasattr(obj, name) for name in members]
    if all(present):
        return True
    if not any(present):
        return False
    have = ", ".join(name for name, there in zip(members, present) if there)
    raise ValueError(f"{role} ({type(obj).__name__}) has {have} of {protocol.__name__} but no "
                     f"{members[present.index(False)]}: give it all of "
                     f"{', '.join(members)} or none")


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
