"""Contiguous reservation, the pre-PagedAttention baseline ("Orca (Max)" / "Orca (Oracle)" in the
vLLM paper): each sequence reserves one first-fit run of blocks for the longest it may become, to
measure internal waste and external fragmentation (docs/policies.md). Nothing is shared, so fork
and swap copy.
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Sequence as Seq

from policies.memory.decode_growth import NoDecodeGrowth
from policies.types import Sequence
from policies.validators import fraction, non_negative_int, positive_int

RESERVE_MODES = ("max", "oracle")


def _take_first_fit(free_extents: list[tuple[int, int]], num_blocks: int) -> int | None:
    """Carve `num_blocks` from the first free extent (start, length) that holds them; return the
    run's start, or None if no extent is long enough."""
    for index, (start, length) in enumerate(free_extents):
        if length >= num_blocks:
            if length == num_blocks:
                del free_extents[index]
            else:
                free_extents[index] = (start + num_blocks, length - num_blocks)
            return start
    return None


class ContiguousAllocator:
    """Satisfies `policies.protocols.KVCacheManager`."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, reserve: str = "max",
                 num_host_blocks: int = 0, watermark: float = 0.0):
        positive_int("kv_cache.num_blocks", num_blocks)
        positive_int("kv_cache.block_size", block_size)
        positive_int("kv_cache.max_model_len", max_model_len)
        if reserve not in RESERVE_MODES:
            raise ValueError(f"kv_cache.reserve must be one of {', '.join(RESERVE_MODES)}, "
                             f"got {reserve!r}")
        non_negative_int("kv_cache.num_host_blocks", num_host_blocks)
        fraction("kv_cache.watermark", watermark)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.reserve = reserve
        self.num_host_blocks = num_host_blocks
        self.watermark = watermark
        self.watermark_blocks = int(watermark * num_blocks)

        self.block_tables: dict[int, list[int]] = {}   # seq_id -> its run's block ids
        self._num_allocated_tokens: dict[int, int] = {}
        # Free space as (start, length) extents sorted by start, neighbours always merged.
        self._free_extents: list[tuple[int, int]] = [(0, num_blocks)]
        self._num_free_blocks = num_blocks
        self._num_tokens_stored = 0
        self._pending_copies: list[tuple[int, int]] = []

        self._host_block_tables: dict[int, list[int]] = {}  # filled blocks only
        self._swapped_num_tokens: dict[int, int] = {}
        self._swapped_num_reserved: dict[int, int] = {}     # run length to reserve on swap in
        self._host_free_block_ids: deque[int] = deque(range(num_host_blocks))

    # ---- counts ----

    def num_free_blocks(self) -> int:
        return self._num_free_blocks

    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free_blocks

    def num_slots_allocated(self) -> int:
        return self.num_used_blocks() * self.block_size

    def num_tokens_stored(self) -> int:
        return self._num_tokens_stored

    def num_free_host_blocks(self) -> int:
        return len(self._host_free_block_ids)

    def largest_free_run(self) -> int:
        """The longest run a new sequence could get: free blocks minus this is fragmentation."""
        return max((length for _, length in self._free_extents), default=0)

    def _num_reserved_blocks(self, seq: Sequence) -> int:
        if self.reserve == "max":
            return -(-self.max_model_len // self.block_size)
        request = seq.request
        return -(-(request.prompt_len + request.output_len) // self.block_size)

    def can_ever_fit(self, num_tokens: int, num_seqs: int = 1) -> bool:
        """Whether `num_seqs` sequences this long (each its own region) fit the empty pool less the
        watermark; under "oracle" `num_tokens` is prompt + output."""
        if self.reserve == "max":
            if num_tokens > self.max_model_len:
                return False
            num_tokens = self.max_model_len
        return num_seqs * -(-num_tokens // self.block_size) <= self.num_blocks - self.watermark_blocks

    # ---- growth ----

    def allocate_slots(self, seq: Sequence, num_tokens: int, *, watermark: bool = False) -> bool:
        """Reserve the seq's run on its first call; later calls only move its length within it."""
        seq_id = seq.seq_id
        table = self.block_tables.get(seq_id)
        if table is None:
            return self._reserve(seq, num_tokens, watermark)
        num_allocated = self._num_allocated_tokens[seq_id]
        if num_tokens < num_allocated:
            raise ValueError(f"allocate_slots: seq {seq_id} already has {num_allocated} slots, "
                             f"cannot shrink to {num_tokens}")
        if num_tokens > len(table) * self.block_size:
            raise ValueError(f"allocate_slots: seq {seq_id} asks for {num_tokens} slots beyond its "
                             f"reservation of {len(table) * self.block_size}")
        self._num_allocated_tokens[seq_id] = num_tokens
        self._num_tokens_stored += num_tokens - num_allocated
        return True

    def trim_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink the seq's length to at most `num_tokens` (rejected drafts give back their
        slots); its reserved run stays, so only the tokens stored move."""
        num_allocated = self._num_allocated_tokens.get(seq.seq_id)
        if num_allocated is None:
            raise ValueError(f"trim_slots: seq {seq.seq_id} holds no device blocks")
        positive_int("trim_slots: num_tokens", num_tokens)
        if num_tokens < num_allocated:
            self._num_allocated_tokens[seq.seq_id] = num_tokens
            self._num_tokens_stored -= num_allocated - num_tokens

    # ---- the simulator's repeated steps (sim/core/repeated_steps.py: RepeatedStepsKVCache) ----

    def decode_growth(self, seqs: list[Sequence]) -> NoDecodeGrowth:
        """None at any step: a sequence grows only within its reservation."""
        return NoDecodeGrowth()

    def frees_in_any_order(self) -> bool:
        return True

    def num_blocks_for_repeated_steps(self) -> int:
        """0: a sequence grows only within its reservation."""
        return 0

    def take_computed_slots(self, seqs: list[Sequence]) -> int:
        """`allocate_slots(seq, seq.num_computed_tokens)` for each of `seqs` in order: the index of
        the first that fails, or len(seqs)."""
        for index, seq in enumerate(seqs):
            if not self.allocate_slots(seq, seq.num_computed_tokens):
                return index
        return len(seqs)

    def append_slots(self, seqs: list[Sequence], start: int = 0) -> int:
        """`allocate_slots(seq, seq.num_tokens)` for each of `seqs[start:]` in order; stops at
        the first that fails and returns its index (len(seqs) when all succeeded)."""
        for index in range(start, len(seqs)):
            seq = seqs[index]
            if not self.allocate_slots(seq, seq.num_tokens):
                return index
        return len(seqs)

    def _reserve(self, seq: Sequence, num_tokens: int, watermark: bool) -> bool:
        if seq.seq_id in self._host_block_tables:
            raise ValueError(f"allocate_slots: seq {seq.seq_id} is swapped out")
        num_reserved = self._num_reserved_blocks(seq)
        if num_tokens > num_reserved * self.block_size:
            raise ValueError(f"allocate_slots: seq {seq.seq_id} asks for {num_tokens} slots beyond "
                             f"its reservation of {num_reserved * self.block_size} "
                             f"(kv_cache.reserve={self.reserve})")
        table = self._take_run(num_reserved, watermark)
        if table is None:
            return False
        self.block_tables[seq.seq_id] = table
        self._num_allocated_tokens[seq.seq_id] = num_tokens
        self._num_tokens_stored += num_tokens
        return True

    def _take_run(self, num_blocks: int, watermark: bool) -> list[int] | None:
        reserve = self.watermark_blocks if watermark else 0
        if self._num_free_blocks - num_blocks < reserve:
            return None
        start = _take_first_fit(self._free_extents, num_blocks)
        if start is None:
            return None
        self._num_free_blocks -= num_blocks
        return list(range(start, start + num_blocks))

    def _release_run(self, table: list[int]) -> None:
        """Return a run to the free extents, merging it with free neighbours."""
        start, length = table[0], len(table)
        extents = self._free_extents
        index = bisect.bisect_left(extents, (start, 0))
        if index < len(extents) and extents[index][0] == start + length:  # merge with the next
            length += extents.pop(index)[1]
        if index > 0 and sum(extents[index - 1]) == start:                 # merge with the previous
            previous_start, previous_length = extents[index - 1]
            extents[index - 1] = (previous_start, previous_length + length)
        else:
            extents.insert(index, (start, length))
        self._num_free_blocks += len(table)
        if self._pending_copies:
            # A copy into a freed block must not run: the block may be handed out again this step.
            freed = set(table)
            self._pending_copies = [(src, dst) for src, dst in self._pending_copies
                                    if dst not in freed]

    def _num_filled_blocks(self, seq_id: int) -> int:
        return -(-self._num_allocated_tokens[seq_id] // self.block_size)

    # ---- sharing (none: the baseline copies) ----

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give `child` its own run and pending copies of the parent's filled blocks; False (and
        no change) if no run fits."""
        parent_table = self.block_tables.get(parent.seq_id)
        if parent_table is None:
            raise ValueError(f"fork: parent seq {parent.seq_id} holds no device blocks")
        if child.seq_id in self.block_tables or child.seq_id in self._host_block_tables:
            raise ValueError(f"fork: child seq {child.seq_id} already holds blocks")
        child_table = self._take_run(len(parent_table), watermark=False)
        if child_table is None:
            return False
        num_filled = self._num_filled_blocks(parent.seq_id)
        self._pending_copies.extend(zip(parent_table[:num_filled], child_table[:num_filled]))
        num_tokens = self._num_allocated_tokens[parent.seq_id]
        self.block_tables[child.seq_id] = child_table
        self._num_allocated_tokens[child.seq_id] = num_tokens
        self._num_tokens_stored += num_tokens
        return True

    def free(self, seq: Sequence) -> None:
        seq_id = seq.seq_id
        table = self.block_tables.pop(seq_id, None)
        if table is not None:
            self._num_tokens_stored -= self._num_allocated_tokens.pop(seq_id)
            self._release_run(table)
        host_table = self._host_block_tables.pop(seq_id, None)
        if host_table is not None:
            del self._swapped_num_tokens[seq_id]
            del self._swapped_num_reserved[seq_id]
            self._host_free_block_ids.extend(host_table)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def allocate_prefix(self, seq: Sequence) -> int:
        return 0

    def num_cached_prefix_tokens(self, token_ids: Seq[int]) -> int:
        """Nothing is cached: no prefix cache without shared blocks."""
        return 0

    # ---- swap: only filled blocks travel; swap in reserves a fresh run ----

    def can_swap_out(self, seqs: Seq[Sequence]) -> bool:
        num_needed = sum(self._num_filled_blocks(seq.seq_id) for seq in seqs
                         if seq.seq_id in self.block_tables)
        return num_needed <= len(self._host_free_block_ids)

    def swap_out(self, seqs: Seq[Sequence]) -> list[tuple[int, int]]:
        if not self.can_swap_out(seqs):
            raise RuntimeError("swap_out: not enough free host blocks (check can_swap_out first)")
        # Swaps run before this step's copies: a block still waiting for its fork copy holds the
        # right tokens only in the copy's source.
        copy_sources = {dst: src for src, dst in self._pending_copies}
        swaps = []
        for seq in seqs:
            table = self.block_tables.pop(seq.seq_id, None)
            if table is None:
                continue
            num_tokens = self._num_allocated_tokens.pop(seq.seq_id)
            filled = table[:-(-num_tokens // self.block_size)]
            host_table = [self._host_free_block_ids.popleft() for _ in filled]
            swaps.extend((copy_sources.get(device, device), host)
                         for device, host in zip(filled, host_table))
            self._host_block_tables[seq.seq_id] = host_table
            self._swapped_num_tokens[seq.seq_id] = num_tokens
            self._swapped_num_reserved[seq.seq_id] = len(table)
            self._num_tokens_stored -= num_tokens
            self._release_run(table)
        return swaps

    def can_swap_in(self, seqs: Seq[Sequence]) -> bool:
        """Whether every seq's run fits, placed first fit one after another, above the watermark."""
        free_extents = list(self._free_extents)
        num_needed = 0
        for seq in seqs:
            num_reserved = self._swapped_num_reserved.get(seq.seq_id)
            if num_reserved is None:
                continue
            if _take_first_fit(free_extents, num_reserved) is None:
                return False
            num_needed += num_reserved
        return self._num_free_blocks - num_needed >= self.watermark_blocks

    def swap_in(self, seqs: Seq[Sequence]) -> list[tuple[int, int]]:
        if not self.can_swap_in(seqs):
            raise RuntimeError("swap_in: no room for the runs (check can_swap_in first)")
        swaps = []
        for seq in seqs:
            host_table = self._host_block_tables.pop(seq.seq_id, None)
            if host_table is None:
                continue
            num_tokens = self._swapped_num_tokens.pop(seq.seq_id)
            table = self._take_run(self._swapped_num_reserved.pop(seq.seq_id), watermark=False)
            swaps.extend(zip(host_table, table))
            self._host_free_block_ids.extend(host_table)
            self.block_tables[seq.seq_id] = table
            self._num_allocated_tokens[seq.seq_id] = num_tokens
            self._num_tokens_stored += num_tokens
        return swaps

    # ---- tests ----

    def check_invariants(self) -> None:
        block_size = self.block_size
        owner: dict[int, int] = {}
        stored = 0
        for seq_id, table in self.block_tables.items():
            assert table == list(range(table[0], table[0] + len(table))), (
                f"seq {seq_id}'s run is not contiguous: {table}")
            num_tokens = self._num_allocated_tokens.get(seq_id)
            assert num_tokens is not None, f"seq {seq_id} has a run but no allocated length"
            assert 0 <= num_tokens <= len(table) * block_size, (
                f"seq {seq_id}: {num_tokens} tokens in a run of {len(table)} blocks")
            assert seq_id not in self._host_block_tables, f"seq {seq_id} is on device and host"
            for block in table:
                assert block not in owner, (
                    f"block {block} is in the runs of seqs {owner[block]} and {seq_id}")
                owner[block] = seq_id
            stored += num_tokens
        assert set(self._num_allocated_tokens) == set(self.block_tables), (
            "allocated lengths and tables name different sequences")

        previous_end = -1
        num_free = 0
        for start, length in self._free_extents:
            assert length > 0, f"empty free extent at {start}"
            assert start > previous_end, f"free extents overlap or touch unmerged at {start}"
            assert not any(block in owner for block in range(start, start + length)), (
                f"free extent ({start}, {length}) overlaps a run")
            previous_end = start + length
            num_free += length
        assert previous_end <= self.num_blocks, "a free extent runs past the pool"
        assert num_free == self._num_free_blocks, (
            f"free count {self._num_free_blocks} but extents hold {num_free}")
        assert num_free + len(owner) == self.num_blocks, (
            f"free {num_free} + used {len(owner)} != {self.num_blocks} blocks")
        assert stored == self._num_tokens_stored, (
            f"tokens stored is {self._num_tokens_stored}, recount gives {stored}")
        assert stored <= self.num_slots_allocated(), "more tokens stored than slots allocated"
        assert all(dst in owner for _, dst in self._pending_copies), (
            "a pending copy targets a free block")

        host_used = [block for host_table in self._host_block_tables.values()
                     for block in host_table]
        host_free = list(self._host_free_block_ids)
        assert len(set(host_used + host_free)) == len(host_used) + len(host_free), (
            "a host block is used twice or both used and free")
        assert len(host_used) + len(host_free) == self.num_host_blocks, (
            f"host free {len(host_free)} + used {len(host_used)} != {self.num_host_blocks}")
        for seq_id, host_table in self._host_block_tables.items():
            assert len(host_table) == -(-self._swapped_num_tokens[seq_id] // block_size), (
                f"swapped seq {seq_id}: {len(host_table)} host blocks for its length")
        assert (set(self._swapped_num_tokens) == set(self._swapped_num_reserved)
                == set(self._host_block_tables)), "swapped bookkeeping names different sequences"
