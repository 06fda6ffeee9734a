"""A paged sequence's slots in its device table, as the block pool, the prefix cache and swap
keep them."""
from __future__ import annotations

from dataclasses import dataclass

NOT_EXCLUSIVE = -1   # SeqSlots.num_exclusive of a table whose last block may be shared


@dataclass(slots=True)
class SeqSlots:
    """A sequence's slots: `num_allocated`, those its table covers, and `num_exclusive`, those
    it may grow into without a block or copy while its last block is its own (append_slots' fast
    path), else NOT_EXCLUSIVE. One object, so the hot loops do a single lookup."""

    num_allocated: int
    num_exclusive: int = NOT_EXCLUSIVE
