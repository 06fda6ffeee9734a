"""The paged KV manager's shared blocks: a fork shares its parent's blocks by reference count (or
copies them), and a write into a shared last block gets a private copy (PagedBlockManager._grow).
Until a block is first shared, ref counts are implied by the tables and never written."""
from __future__ import annotations

from policies.memory.slots import NOT_EXCLUSIVE, SeqSlots
from policies.types import Sequence


class SharedBlocks:
    """PagedBlockManager's forks and block copies, on the pool's tables and ref counts."""

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give `child` the parent's KV: shared blocks, or (share_on_fork=False) copies; False (no
        change) if the copies do not fit."""
        parent_table = self.block_tables.get(parent.seq_id)
        if parent_table is None:
            raise ValueError(f"fork: parent seq {parent.seq_id} holds no device blocks")
        if child.seq_id in self.block_tables or child.seq_id in self._host_block_tables:
            raise ValueError(f"fork: child seq {child.seq_id} already holds blocks")
        parent_slots = self._slots[parent.seq_id]
        num_tokens = parent_slots.num_allocated
        if self.share_on_fork:
            parent_slots.num_exclusive = NOT_EXCLUSIVE   # its last block is shared now
            if not self._any_block_shared:
                self._count_refs()
            for block in parent_table:
                self._ref_counts[block] += 1
            child_table = list(parent_table)
        else:
            if len(parent_table) > self.num_free_blocks():
                return False
            child_table = [self._take_free_block() for _ in parent_table]
            self._pending_copies.extend(zip(parent_table, child_table))
            self._num_tokens_stored += num_tokens
        self.block_tables[child.seq_id] = child_table
        self._slots[child.seq_id] = SeqSlots(num_tokens)
        if parent.seq_id in self._seq_block_hashes:
            self._seq_block_hashes[child.seq_id] = list(self._seq_block_hashes[parent.seq_id])
        return True

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def _count_refs(self, *unlisted_tables: list[int]) -> None:
        """At the first share: count every block's references (`unlisted_tables`: being built)."""
        ref_counts = self._ref_counts
        for table in (*self.block_tables.values(), self._held_growth_block_ids,
                      *unlisted_tables):
            for block in table:
                ref_counts[block] += 1
        self._any_block_shared = True
