"""The paged block manager's invariants, recounted from its tables (what the tests call)."""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from policies.memory.slots import NOT_EXCLUSIVE

if TYPE_CHECKING:
    from policies.memory.paged import PagedBlockManager


def check_paged_invariants(manager: PagedBlockManager) -> None:
    """Recount everything from the tables and compare with the incremental bookkeeping."""
    block_size = manager.block_size
    refs = Counter()
    fills: dict[int, int] = {}
    for seq_id, table in manager.block_tables.items():
        slots = manager._slots.get(seq_id)
        assert slots is not None, f"seq {seq_id} has a table but no allocated length"
        num_tokens = slots.num_allocated
        assert len(table) == -(-num_tokens // block_size), (
            f"seq {seq_id}: {len(table)} blocks for {num_tokens} slots")
        assert len(set(table)) == len(table), f"seq {seq_id} holds a block twice: {table}"
        assert seq_id not in manager._host_block_tables, f"seq {seq_id} is on device and host"
        refs.update(table)
        for index, block in enumerate(table):
            fill = min(block_size, num_tokens - index * block_size)
            assert fills.setdefault(block, fill) == fill, (
                f"block {block} is shared by sequences that fill it differently")
    for table in manager._retained_tables():   # full blocks, one reference each
        refs.update(table)
        for block in table:
            assert fills.setdefault(block, block_size) == block_size, (
                f"retained block {block} is not full")
    refs.update(manager._held_growth_block_ids)   # a paused run's decodes', one reference each
    assert set(manager._slots) == set(manager.block_tables), (
        "allocated lengths and tables name different sequences")
    if manager._any_block_shared:
        ref_counts = manager._ref_counts
    else:   # not counted yet: none shared, and nothing written
        assert not any(manager._ref_counts), "ref counts written before any block was shared"
        assert all(count == 1 for count in refs.values()), (
            "a block is shared but ref counts are not kept")
        ref_counts = [refs[block] for block in range(manager.num_blocks)]
    for seq_id, slots in manager._slots.items():
        num_slots = slots.num_exclusive
        if num_slots == NOT_EXCLUSIVE:
            continue
        table = manager.block_tables.get(seq_id)
        assert table is not None and num_slots == len(table) * block_size, (
            f"seq {seq_id}: stale fast-path capacity {num_slots}")
        assert ref_counts[table[-1]] == 1, (
            f"seq {seq_id}: fast path open on a shared last block")
    for block, ref_count in enumerate(ref_counts):
        assert ref_count >= 0, f"block {block} has ref count {ref_count}"
        assert ref_count == refs[block], (
            f"block {block} has ref count {ref_count} but {refs[block]} tables hold it")

    free_blocks = list(manager._free_block_ids) + list(manager._evictable_block_ids)
    assert len(set(free_blocks)) == len(free_blocks), "a block is free twice"
    assert all(ref_counts[block] == 0 for block in free_blocks), "a free block is in use"
    assert manager.num_free_blocks() + len(refs) == manager.num_blocks, (
        f"free {manager.num_free_blocks()} + used {len(refs)} != {manager.num_blocks} blocks")
    assert all(block in manager._block_to_hash for block in manager._evictable_block_ids), (
        "an evictable block has no hash")
    assert not any(block in manager._block_to_hash for block in manager._free_block_ids), (
        "an uncached free block still has a hash")
    assert {block: h for h, block in manager._hash_to_block.items()} == manager._block_to_hash, (
        "hash maps disagree")

    stored = sum(fills.values()) + manager._num_held_growth_tokens
    assert stored == manager._num_tokens_stored, (
        f"tokens stored is {manager._num_tokens_stored}, recount gives {stored}")
    assert stored <= manager.num_slots_allocated(), "more tokens stored than slots allocated"
    assert all(ref_counts[dst] > 0 for _, dst in manager._pending_copies), (
        "a pending copy targets a free block")
    manager._check_host_pool()
    manager._check_tier(ref_counts)
