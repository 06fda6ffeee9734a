"""A paged sequence's slots in its device table, as the block pool, the prefix cache and swap
keep them."""
from __future__ import annotations

from dataclasses import dataclass

NOT_EXCLUSIVE = -1   # SeqSlots.num_exclusive of a table whose last block may be shared


@dataclass(slots=True)
class SeqSlots:
    """A sequence's slots in its device table: `num_allocated`, the slots it covers, and
    `num_exclusive`, the slots the table holds while its last block is its own, so growing
    within them needs no block and no copy (append_slots' fast path), else NOT_EXCLUSIVE (growth
    goes through `_grow`): reset whenever the last block may become shared, never set with
    prefix caching. One object per sequence: the hot loops read and write both through a single
    lookup."""

    num_allocated: int
    num_exclusive: int = NOT_EXCLUSIVE
