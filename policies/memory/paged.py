"""Paged KV blocks (vLLM's PagedAttention) with reference counts, copy-on-write, swap to host and
an optional prefix cache. Device block ids index the engine's KV tensors; host ids are a space of
their own. Copies and swaps are returned as (source, destination) pairs that the executor runs
before the forward pass, in the order swap out, offload, load, swap in, copy. The prefix cache is
in prefix_cache.py, swap in swap.py, blocks kept between a session's turns in retained.py,
forks sharing blocks in sharing.py.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from itertools import repeat, starmap
from typing import Sequence as Seq

from policies.memory.decode_growth import DecodeGrowth
from policies.memory.held_growth import HeldDecodeGrowth
from policies.memory.paged_invariants import check_paged_invariants
from policies.memory.prefix_cache import PrefixCache
from policies.memory.retained import RetainedBlocks
from policies.memory.sharing import SharedBlocks
from policies.memory.slots import SeqSlots
from policies.memory.swap import HostSwap
from policies.types import Sequence, SequenceStatus
from policies.validators import boolean, fraction, non_negative_int, positive_int


class PagedBlockManager(SharedBlocks, PrefixCache, HostSwap, RetainedBlocks, HeldDecodeGrowth):
    """Satisfies `policies.protocols.KVCacheManager`."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 watermark: float = 0.01, enable_prefix_caching: bool = False,
                 share_on_fork: bool = True, num_offload_blocks: int = 0):
        positive_int("kv_cache.num_blocks", num_blocks)
        positive_int("kv_cache.block_size", block_size)
        non_negative_int("kv_cache.num_host_blocks", num_host_blocks)
        fraction("kv_cache.watermark", watermark)
        boolean("kv_cache.enable_prefix_caching", enable_prefix_caching)
        boolean("kv_cache.share_on_fork", share_on_fork)
        non_negative_int("kv_cache.num_offload_blocks", num_offload_blocks)
        if num_offload_blocks and not enable_prefix_caching:
            raise ValueError(f"kv_cache.num_offload_blocks={num_offload_blocks} (from "
                             f"kv_cache.offload_gb) needs kv_cache.enable_prefix_caching=true: "
                             f"the host tier holds evicted prefix-cache blocks")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_host_blocks = num_host_blocks
        self.watermark = watermark
        self.enable_prefix_caching = enable_prefix_caching
        self.share_on_fork = share_on_fork
        self.num_offload_blocks = num_offload_blocks
        # Admissions leave these free so running sequences can grow without a preemption.
        self.watermark_blocks = int(watermark * num_blocks)

        # A free block is uncached, or a cached prefix block nobody uses (evictable, LRU first).
        self.block_tables: dict[int, list[int]] = {}
        self._slots: dict[int, SeqSlots] = {}   # seq_id -> its slots, for each table
        # Until a block is first shared, ref counts are implied by the tables and never written
        # (cheaper allocation); the first share counts them (_count_refs).
        self._any_block_shared = False
        self._ref_counts = [0] * num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._evictable_block_ids: OrderedDict[int, None] = OrderedDict()
        self._num_tokens_stored = 0
        self._pending_copies: list[tuple[int, int]] = []

        self._init_held_growth()
        self._init_prefix_cache(num_offload_blocks)
        self._init_host_pool(num_host_blocks)
        self._init_retained()

    # ---- counts (all O(1): waste is reported every step) ----

    def num_free_blocks(self) -> int:
        return len(self._free_block_ids) + len(self._evictable_block_ids)

    # num_free_blocks inlined: a step's row asks for both every step.
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids) - len(self._evictable_block_ids)

    def num_slots_allocated(self) -> int:
        return ((self.num_blocks - len(self._free_block_ids) - len(self._evictable_block_ids))
                * self.block_size)

    def num_tokens_stored(self) -> int:
        return self._num_tokens_stored

    def can_ever_fit(self, num_tokens: int, num_seqs: int = 1) -> bool:
        """Whether `num_seqs` unshared sequences this long fit the empty pool less the watermark
        (without it a scheduler could wait forever for an admission the watermark refuses)."""
        num_blocks_needed = num_seqs * -(-num_tokens // self.block_size)
        return num_blocks_needed <= self.num_blocks - self.watermark_blocks

    def may_allocate_new(self, num_tokens: Seq[int]) -> bool:
        """Whether new sequences might get slots for these lengths with the watermark now; False is
        exact. With prefix caching always True (a hit never needs more blocks than it saves)."""
        if self.enable_prefix_caching:
            return True
        block_size = self.block_size
        num_blocks_needed = sum([-(-length // block_size) for length in num_tokens])
        return self.num_free_blocks() - num_blocks_needed >= self.watermark_blocks

    # ---- growth ----

    def allocate_slots(self, seq: Sequence, num_tokens: int, *, watermark: bool = False) -> bool:
        """Make the seq's table cover positions [0, num_tokens). On False nothing changed."""
        seq_id = seq.seq_id
        slots = self._slots.get(seq_id)
        num_allocated = 0 if slots is None else slots.num_allocated
        if num_tokens <= num_allocated:
            if num_tokens < num_allocated:
                raise ValueError(f"allocate_slots: seq {seq_id} already has {num_allocated} slots, "
                                 f"cannot shrink to {num_tokens}")
            return True
        table = self.block_tables.get(seq_id)
        # Hot path: a decode inside its own last block only moves counts.
        if (table is not None and num_tokens <= len(table) * self.block_size
                and (not self._any_block_shared or self._ref_counts[table[-1]] == 1)):
            slots.num_allocated = num_tokens
            self._num_tokens_stored += num_tokens - num_allocated
            if self.enable_prefix_caching:
                if num_tokens == len(table) * self.block_size:
                    self._cache_full_blocks(seq, table, num_tokens)
            else:
                slots.num_exclusive = len(table) * self.block_size
            return True
        return self._grow(seq, table, num_allocated, num_tokens, watermark)

    # ---- the simulator's repeated steps (sim/core/repeated_steps.py: RepeatedStepsKVCache) ----

    def decode_growth(self, seqs: list[Sequence]) -> DecodeGrowth:
        """The decoding `seqs`' growth over a run of repeated steps."""
        return DecodeGrowth.of(seqs, self.block_size)

    def frees_in_any_order(self) -> bool:
        """False with prefix caching: its cache evicts blocks in the order they were freed."""
        return not self.enable_prefix_caching

    def num_blocks_for_repeated_steps(self) -> int:
        """Blocks decodes may take in repeated steps out of step order without changing any later
        step: none with prefix caching (its cache evicts in the order blocks were freed)."""
        return 0 if self.enable_prefix_caching else len(self._free_block_ids)

    def take_computed_slots(self, seqs: list[Sequence]) -> int:
        """`allocate_slots(seq, seq.num_computed_tokens)` for each decoding seq of `seqs`, where a
        run of repeated steps left their slots: the index of the first that fails, or len(seqs)."""
        return self._append_slots(seqs, 0, True)

    def append_slots(self, seqs: list[Sequence], start: int = 0) -> int:
        """`allocate_slots(seq, seq.num_tokens)` for each decoding seq of `seqs[start:]`, stopping
        at the first that fails: its index, or len(seqs). The simulator's hottest call."""
        return self._append_slots(seqs, start, False)

    def _append_slots(self, seqs: list[Sequence], start: int, computed: bool) -> int:
        seq_slots = self._slots
        free_block_ids = self._free_block_ids
        block_size = self.block_size
        num_stored_added = 0
        for seq in seqs[start:] if start else seqs:
            num_tokens = seq.num_computed_tokens if computed else seq.num_tokens
            try:   # a subscript costs less than .get, and a decode always holds slots
                slots = seq_slots[seq.seq_id]
            except KeyError:
                pass
            else:
                num_exclusive = slots.num_exclusive
                if num_tokens <= num_exclusive:   # inside its own last block
                    num_new_tokens = num_tokens - slots.num_allocated
                    if num_new_tokens >= 0:
                        num_stored_added += num_new_tokens
                        slots.num_allocated = num_tokens
                        continue
                elif num_exclusive >= 0:
                    # A running sequence's growth keeps no watermark.
                    num_new_blocks = -(-(num_tokens - num_exclusive) // block_size)
                    if num_new_blocks > len(free_block_ids):
                        break
                    table = self.block_tables[seq.seq_id]
                    if num_new_blocks == 1:   # inlined: the common case
                        block = free_block_ids.popleft()
                        if self._any_block_shared:
                            self._ref_counts[block] = 1
                        table.append(block)
                    else:
                        table.extend(self._take_uncached_blocks(num_new_blocks))
                    slots.num_exclusive = len(table) * block_size
                    num_stored_added += num_tokens - slots.num_allocated
                    slots.num_allocated = num_tokens
                    continue
            if not self.allocate_slots(seq, num_tokens):
                break
        else:
            self._num_tokens_stored += num_stored_added
            return len(seqs)
        self._num_tokens_stored += num_stored_added
        return seqs.index(seq, start)   # found here rather than counted every pass

    def trim_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink the seq's table to at most [0, num_tokens), freeing whole blocks past it (rejected
        drafts' slots)."""
        seq_id = seq.seq_id
        slots = self._slots.get(seq_id)
        if slots is None:
            raise ValueError(f"trim_slots: seq {seq_id} holds no device blocks")
        num_allocated = slots.num_allocated
        positive_int("trim_slots: num_tokens", num_tokens)
        if num_tokens >= num_allocated:
            return
        block_size = self.block_size
        table = self.block_tables[seq_id]
        num_kept_blocks = -(-num_tokens // block_size)
        released = table[num_kept_blocks:]
        del table[num_kept_blocks:]
        # Draft slots are this seq's alone, so only its kept last block's fill shrinks.
        last_block_start = (num_kept_blocks - 1) * block_size
        self._num_tokens_stored -= (min(block_size, num_allocated - last_block_start)
                                    - (num_tokens - last_block_start))
        slots.num_allocated = num_tokens
        if slots.num_exclusive >= 0:
            slots.num_exclusive = num_kept_blocks * block_size
        hashes = self._seq_block_hashes.get(seq_id)
        if hashes:
            del hashes[num_tokens // block_size:]
        if released:
            released_start = num_kept_blocks * block_size
            self._release_blocks(released, num_allocated - released_start,
                                 max(seq.num_computed_tokens - released_start, 0))

    def _grow(self, seq: Sequence, table: list[int] | None, num_allocated: int, num_tokens: int,
              watermark: bool) -> bool:
        if table is None and seq.seq_id in self._host_block_tables:
            raise ValueError(f"allocate_slots: seq {seq.seq_id} is swapped out")
        block_size = self.block_size
        num_new_blocks = -(-num_tokens // block_size) - (len(table) if table else 0)
        num_in_last_block = num_allocated % block_size
        # Copy-on-write: a write into a block others still read gets a private copy.
        copy_last_block = (num_in_last_block != 0 and self._any_block_shared
                           and self._ref_counts[table[-1]] > 1)
        num_blocks_needed = num_new_blocks + copy_last_block
        reserve = self.watermark_blocks if watermark else 0
        if self.num_free_blocks() - num_blocks_needed < reserve:
            return False

        if table is None:
            table = self.block_tables[seq.seq_id] = []
        if copy_last_block:
            shared_block = table[-1]
            private_block = self._take_free_block()
            self._ref_counts[shared_block] -= 1
            table[-1] = private_block
            self._pending_copies.append((shared_block, private_block))
            self._num_tokens_stored += num_in_last_block  # the copy holds the tokens so far
        # In bulk (a long prompt takes hundreds), in _take_free_block's order.
        num_uncached = min(num_new_blocks, len(self._free_block_ids))
        table.extend(self._take_uncached_blocks(num_uncached))
        if num_new_blocks > num_uncached:
            table.extend(self._evict_blocks(num_new_blocks - num_uncached))
        slots = self._slots.get(seq.seq_id)
        if slots is None:
            slots = self._slots[seq.seq_id] = SeqSlots(num_tokens)
        else:
            slots.num_allocated = num_tokens
        self._num_tokens_stored += num_tokens - num_allocated
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq, table, num_tokens)
        elif not self._any_block_shared or self._ref_counts[table[-1]] == 1:
            slots.num_exclusive = len(table) * block_size
        return True

    def _take_uncached_blocks(self, num_blocks: int) -> list[int]:
        """`num_blocks` uncached free blocks, ref count 1 each, in _take_free_block's order."""
        blocks = list(starmap(self._free_block_ids.popleft, repeat((), num_blocks)))
        if self._any_block_shared:
            ref_counts = self._ref_counts
            for block in blocks:
                ref_counts[block] = 1
        return blocks

    def _take_free_block(self) -> int:
        """A free block with ref count 1; uncached blocks go first so cached prefixes live longer."""
        if not self._free_block_ids:
            return self._evict_blocks(1)[0]
        block = self._free_block_ids.popleft()
        if self._any_block_shared:
            self._ref_counts[block] = 1
        return block

    def _evict_blocks(self, num_blocks: int) -> list[int]:
        """`num_blocks` cached free blocks, least recently freed first, evicted (to the host tier,
        if any), ref count 1 each."""
        evictable, block_to_hash = self._evictable_block_ids, self._block_to_hash
        hash_to_block = self._hash_to_block
        offloads = self.num_offload_blocks
        blocks = []
        for _ in range(num_blocks):
            block, _ = evictable.popitem(last=False)
            block_hash = block_to_hash.pop(block)
            del hash_to_block[block_hash]
            if offloads:
                self._offload(block, block_hash)
            blocks.append(block)
        if self._any_block_shared:
            ref_counts = self._ref_counts
            for block in blocks:
                ref_counts[block] = 1
        return blocks

    def _release_blocks(self, table: list[int], num_tokens: int,
                        num_computed_tokens: int) -> None:
        """Drop one reference to each block of a table of `num_tokens` slots. A freed cached block
        whose KV was never fully computed forgets its hash: its KV is not there."""
        block_size = self.block_size
        ref_counts = self._ref_counts
        cached_blocks = self._block_to_hash
        track_freed = bool(self._pending_copies)
        counted = self._any_block_shared
        if (table and not cached_blocks and not track_freed
                and (not counted or max(map(ref_counts.__getitem__, table)) == 1)):
            # The common case in one go: nothing cached, no copy pending, nothing shared.
            if counted:
                for block in table:
                    ref_counts[block] = 0
            self._num_tokens_stored -= num_tokens
            self._free_block_ids.extend(reversed(table))
            return
        freed_blocks = []
        num_stored_freed = 0
        last_index = len(table) - 1
        # Reversed, so a prefix's tail blocks are the least recently freed and get evicted first:
        # a cached block is only useful while every block before it is still cached.
        for index in range(last_index, -1, -1):
            block = table[index]
            if counted:
                ref_count = ref_counts[block] - 1
                ref_counts[block] = ref_count
            else:
                ref_count = 0
            if ref_count == 0:
                num_stored_freed += (block_size if index < last_index
                                     else num_tokens - index * block_size)
                if block in self._pending_loads:
                    self._return_to_tier(block)
                elif block in cached_blocks and (index + 1) * block_size > num_computed_tokens:
                    del self._hash_to_block[cached_blocks.pop(block)]
                if block in cached_blocks:
                    self._evictable_block_ids[block] = None
                else:
                    self._free_block_ids.append(block)
                if track_freed:
                    freed_blocks.append(block)
        self._num_tokens_stored -= num_stored_freed
        if freed_blocks:
            # A freed block may be handed out again this step, so no copy may target it.
            freed = set(freed_blocks)
            self._pending_copies = [(src, dst) for src, dst in self._pending_copies
                                    if dst not in freed]

    def free(self, seq: Sequence) -> None:
        seq_id = seq.seq_id
        table = self.block_tables.pop(seq_id, None)
        if table is not None:
            if self.enable_prefix_caching and seq.status is SequenceStatus.RUNNING:
                self._cache_outputs_before_preemption(seq, table)   # (a finish is FINISHED)
            self._release_blocks(table, self._slots.pop(seq_id).num_allocated,
                                 seq.num_computed_tokens)
        host_table = self._host_block_tables.pop(seq_id, None)
        if host_table is not None:
            del self._swapped_num_tokens[seq_id]
            self._release_host_blocks(host_table)
        self._seq_block_hashes.pop(seq_id, None)
        self._seq_loaded_tokens.pop(seq_id, None)

    def check_invariants(self) -> None:
        """Recount everything from the tables and compare with the incremental bookkeeping."""
        check_paged_invariants(self)
