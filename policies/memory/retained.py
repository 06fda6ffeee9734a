"""The paged KV manager's side of the kv_retention policies: `retain(seq, key)` keeps a reference
to each block of a finished turn's cached prefix until `release(key)`; `free_to_tier(seq)` stores
them in the prefix cache's host tier at once.
"""
from __future__ import annotations

from collections import Counter

from policies.types import Sequence


class RetainedBlocks:
    """PagedBlockManager's retained blocks, on the pool's blocks, ref counts and prefix cache."""

    def _init_retained(self) -> None:
        self._retained: dict[int, list[int]] = {}   # key -> the blocks kept under it
        self._retained_refs: Counter[int] = Counter()   # block -> keys keeping it

    def retain(self, seq: Sequence, key: int) -> int:
        if key in self._retained:
            raise ValueError(f"retain: blocks are already kept under key {key}")
        table = self.block_tables.get(seq.seq_id)
        kept = self._cached_prefix(seq, table) if table else []
        if kept:
            if not self._any_block_shared:
                self._count_refs()
            ref_counts = self._ref_counts
            for block in kept:
                ref_counts[block] += 1
            self._retained[key] = kept
            self._retained_refs.update(kept)
        self.free(seq)
        return len(kept)

    def release(self, key: int) -> int:
        kept = self._retained.pop(key, None)
        if not kept:
            return 0
        retained_refs = self._retained_refs
        retained_refs.subtract(kept)
        for block in kept:
            if not retained_refs[block]:
                del retained_refs[block]
        num_tokens = len(kept) * self.block_size   # full, computed blocks
        self._release_blocks(kept, num_tokens, num_tokens)
        return len(kept)

    def free_to_tier(self, seq: Sequence) -> int:
        table = self.block_tables.get(seq.seq_id)
        cached = self._cached_prefix(seq, table) if table and self.num_offload_blocks else []
        self.free(seq)
        evictable = self._evictable_block_ids
        num_stored = 0
        # Tail first, as eviction stores them: the tier drops its oldest entries first, and a
        # prefix's tail is useless without its head.
        for block in reversed(cached):
            if block not in evictable:
                continue   # another sequence still holds it: it stays on the device
            del evictable[block]
            block_hash = self._block_to_hash.pop(block)
            del self._hash_to_block[block_hash]
            self._offload(block, block_hash)
            self._free_block_ids.append(block)
            num_stored += block_hash in self._offloaded   # (not when every slot is loading)
        return num_stored

    def num_retained_blocks(self) -> int:
        """Device blocks kept under any key (a block kept under several counted once)."""
        return len(self._retained_refs)

    def _cached_prefix(self, seq: Sequence, table: list[int]) -> list[int]:
        """The blocks of `table` that hold `seq`'s computed full blocks and are their hashes'
        cache entries, up to the first that is not (a prefix hit stops there)."""
        hashes = self._seq_block_hashes.get(seq.seq_id) or ()
        num_blocks = min(len(hashes), len(table), seq.num_computed_tokens // self.block_size)
        block_to_hash = self._block_to_hash
        cached = []
        for index in range(num_blocks):
            block = table[index]
            if block_to_hash.get(block) != hashes[index]:
                break
            cached.append(block)
        return cached

    def _retained_tables(self) -> list[list[int]]:
        """check_invariants' view: each key's blocks, as one more table of full blocks."""
        assert self._retained_refs == Counter(
            block for kept in self._retained.values() for block in kept), (
            "retained block counts disagree with the kept blocks")
        return list(self._retained.values())
