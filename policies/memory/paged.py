"""Paged KV blocks with reference counts, copy-on-write, swap to host and an optional prefix cache.

The PagedAttention design (vLLM paper, section 4): a sequence's KV lives in fixed-size blocks that
need not be contiguous, so memory is taken one block at a time as the sequence grows. Blocks are
shared by reference count between the samples of a request (fork) and, with prefix caching, between
requests whose prompts start alike. A shared block is copied before a sequence writes into it.

Device block ids 0..num_blocks-1 index the engine's KV tensors; host block ids
0..num_host_blocks-1 are a separate id space, the swap pool. Copies and swaps are not performed
here: they are returned as (source, destination) pairs and carried out by the executor before the
step's forward pass, in the order swap out, offload, load, swap in, copy.

The prefix cache and its host tier are in prefix_cache.py, swap to host in swap.py, the blocks a
kv_retention policy keeps for a session between its turns in retained.py.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque
from itertools import repeat, starmap
from typing import Sequence as Seq

from policies.memory.decode_growth import DecodeGrowth
from policies.memory.prefix_cache import PrefixCache
from policies.memory.retained import RetainedBlocks
from policies.memory.slots import NOT_EXCLUSIVE, SeqSlots
from policies.memory.swap import HostSwap
from policies.types import Sequence
from policies.validators import boolean, fraction, non_negative_int, positive_int


class PagedBlockManager(PrefixCache, HostSwap, RetainedBlocks):
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
        # Blocks kept free by allocations that ask for the watermark (admissions), so that running
        # sequences can still grow without an immediate preemption.
        self.watermark_blocks = int(watermark * num_blocks)

        # Device pool. A free block is either uncached (`_free_block_ids`) or holds a cached prefix
        # block nobody uses (`_evictable_block_ids`, least recently freed first).
        self.block_tables: dict[int, list[int]] = {}
        self._slots: dict[int, SeqSlots] = {}   # seq_id -> its slots, for each table
        # Whether a block ever had a second reference (fork, prefix hit, shared swap in). Until
        # then every table is its own, so a block's ref count is implied (1 in a table, 0 free)
        # and `_ref_counts` stays all zero: taking and freeing blocks writes no counts. The
        # first share counts them from the tables (_count_refs) and keeps them from then on.
        self._any_block_shared = False
        self._ref_counts = [0] * num_blocks
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._evictable_block_ids: OrderedDict[int, None] = OrderedDict()
        self._num_tokens_stored = 0
        self._pending_copies: list[tuple[int, int]] = []

        self._init_prefix_cache(num_offload_blocks)
        self._init_host_pool(num_host_blocks)
        self._init_retained()

    # ---- counts (all O(1): waste is reported every step) ----

    def num_free_blocks(self) -> int:
        return len(self._free_block_ids) + len(self._evictable_block_ids)

    # (num_free_blocks inlined: a step's row asks for both every step.)
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids) - len(self._evictable_block_ids)

    def num_slots_allocated(self) -> int:
        return ((self.num_blocks - len(self._free_block_ids) - len(self._evictable_block_ids))
                * self.block_size)

    def num_tokens_stored(self) -> int:
        return self._num_tokens_stored

    def can_ever_fit(self, num_tokens: int, num_seqs: int = 1) -> bool:
        """Whether `num_seqs` sequences this long (the samples of one request, counted without
        sharing) could be admitted (with the watermark) into the empty pool. Leaving the
        watermark out would let a scheduler wait forever for an admission that the watermark
        always refuses."""
        num_blocks_needed = num_seqs * -(-num_tokens // self.block_size)
        return num_blocks_needed <= self.num_blocks - self.watermark_blocks

    def may_allocate_new(self, num_tokens: Seq[int]) -> bool:
        """Whether new sequences (holding no blocks) might get slots for these lengths, with
        the watermark, now; False is exact: allocate_slots(..., watermark=True) would fail for
        one of them. A prefix hit never needs more free blocks than it saves, so with prefix
        caching (where the lengths are those before any hit) the answer is True."""
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
        # Hot path (a decode step inside the last block): the table already covers num_tokens, so
        # the write starts inside its last block; only a shared last block needs more work (CoW).
        if (table is not None and num_tokens <= len(table) * self.block_size
                and (not self._any_block_shared or self._ref_counts[table[-1]] == 1)):
            slots.num_allocated = num_tokens   # (a table has its slots)
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
        """The decoding `seqs`' growth over a run of repeated steps (their counters where the
        step just planned stands): each holds exactly the blocks its tokens fill."""
        return DecodeGrowth.of(seqs, self.block_size)

    def frees_in_any_order(self) -> bool:
        """False with prefix caching: its cache evicts blocks in the order they were freed."""
        return not self.enable_prefix_caching

    def num_blocks_for_repeated_steps(self) -> int:
        """Blocks that decodes may take during repeated steps, in another order than step by
        step, without changing any later step: the free ones, or none with prefix caching (its
        cache evicts blocks in the order they were freed)."""
        return 0 if self.enable_prefix_caching else len(self._free_block_ids)

    def append_slots(self, seqs: list[Sequence], start: int = 0) -> int:
        """`allocate_slots(seq, seq.num_tokens)` for each of `seqs[start:]` in order, all
        decoding (one new token each, or several after repeated steps); stops at the first that
        fails and returns its index (len(seqs) when all succeeded). The simulator's hottest call:
        one pass per step over the batch instead of one method call per sequence."""
        seq_slots = self._slots
        free_block_ids = self._free_block_ids
        block_size = self.block_size
        num_stored_added = 0
        for seq in seqs[start:] if start else seqs:
            num_tokens = seq.num_tokens
            try:   # (a subscript costs less than .get, and a decode always holds slots)
                slots = seq_slots[seq.seq_id]
            except KeyError:
                pass
            else:
                num_exclusive = slots.num_exclusive
                if num_tokens <= num_exclusive:   # inside its own last block: counts move
                    num_new_tokens = num_tokens - slots.num_allocated
                    if num_new_tokens >= 0:
                        num_stored_added += num_new_tokens
                        slots.num_allocated = num_tokens
                        continue
                elif num_exclusive >= 0:
                    # Past it, whole blocks come off the free list (a running sequence's growth
                    # keeps no watermark).
                    num_new_blocks = -(-(num_tokens - num_exclusive) // block_size)
                    if num_new_blocks > len(free_block_ids):
                        break
                    table = self.block_tables[seq.seq_id]
                    if num_new_blocks == 1:   # a decode past its last block: inlined
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
        return seqs.index(seq, start)   # (the failing one; counted here, not every pass)

    def trim_slots(self, seq: Sequence, num_tokens: int) -> None:
        """Shrink the seq's table to cover at most positions [0, num_tokens), freeing the whole
        blocks past it: the slots of rejected draft tokens go back after a speculative step. A
        table already that short is left alone (all drafts accepted)."""
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
        # The draft slots were written by this seq alone: its kept last block is its own, and
        # only its fill shrinks.
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
        # Copy-on-write: the first write into a block that others still read gets a private copy.
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
        # The uncached blocks in one go (a long prompt takes hundreds), then cached ones evicted,
        # as _take_free_block would hand them out one by one.
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
        """`num_blocks` blocks off the uncached free list (which holds them), ref count 1 each,
        in the order _take_free_block would hand them out."""
        blocks = list(starmap(self._free_block_ids.popleft, repeat((), num_blocks)))
        if self._any_block_shared:
            ref_counts = self._ref_counts
            for block in blocks:
                ref_counts[block] = 1
        return blocks

    def _take_free_block(self) -> int:
        """A free block with ref count 1. Uncached blocks go first so cached prefixes live longer;
        otherwise the least recently freed cached block is evicted and forgets its hash."""
        if not self._free_block_ids:
            return self._evict_blocks(1)[0]
        block = self._free_block_ids.popleft()
        if self._any_block_shared:
            self._ref_counts[block] = 1
        return block

    def _evict_blocks(self, num_blocks: int) -> list[int]:
        """`num_blocks` cached free blocks, least recently freed first, each forgetting its hash
        (stored in the host tier, if any), ref count 1 each."""
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

    def _count_refs(self, *unlisted_tables: list[int]) -> None:
        """Before the first share: count every block's references, from the tables and from
        `unlisted_tables` (being built, not in block_tables yet); kept from now on."""
        ref_counts = self._ref_counts
        for table in (*self.block_tables.values(), *unlisted_tables):
            for block in table:
                ref_counts[block] += 1
        self._any_block_shared = True

    def _release_blocks(self, table: list[int], num_tokens: int,
                        num_computed_tokens: int) -> None:
        """Drop one reference to each block of a table of `num_tokens` slots, of which the first
        `num_computed_tokens` hold computed KV. A freed block that was cached (its hash is
        registered when allocated) but never fully computed forgets its hash: its KV is not
        there (the sequence was dropped in the step that allocated it)."""
        block_size = self.block_size
        ref_counts = self._ref_counts
        cached_blocks = self._block_to_hash
        track_freed = bool(self._pending_copies)
        counted = self._any_block_shared
        if (table and not cached_blocks and not track_freed
                and (not counted or max(map(ref_counts.__getitem__, table)) == 1)):
            # Nothing cached, no copy pending, shared with none: every block is freed, the
            # tail first, and they hold the table's tokens.
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
                # Every block but the last is full.
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
            # A copy into a freed block must not run: the block may be handed out again this step
            # (a swap in writes it before the copies run).
            freed = set(freed_blocks)
            self._pending_copies = [(src, dst) for src, dst in self._pending_copies
                                    if dst not in freed]

    # ---- sharing ----

    def fork(self, parent: Sequence, child: Sequence) -> bool:
        """Give `child` the parent's KV: shared blocks, or with share_on_fork=False fresh blocks
        and one pending copy per block. False (and no change) if the copies do not fit."""
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

    def free(self, seq: Sequence) -> None:
        seq_id = seq.seq_id
        table = self.block_tables.pop(seq_id, None)
        if table is not None:
            self._release_blocks(table, self._slots.pop(seq_id).num_allocated,
                                 seq.num_computed_tokens)
        host_table = self._host_block_tables.pop(seq_id, None)
        if host_table is not None:
            del self._swapped_num_tokens[seq_id]
            self._release_host_blocks(host_table)
        self._seq_block_hashes.pop(seq_id, None)
        self._seq_loaded_tokens.pop(seq_id, None)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ---- tests ----

    def check_invariants(self) -> None:
        """Recount everything from the tables and compare with the incremental bookkeeping."""
        block_size = self.block_size
        refs = Counter()
        fills: dict[int, int] = {}
        for seq_id, table in self.block_tables.items():
            slots = self._slots.get(seq_id)
            assert slots is not None, f"seq {seq_id} has a table but no allocated length"
            num_tokens = slots.num_allocated
            assert len(table) == -(-num_tokens // block_size), (
                f"seq {seq_id}: {len(table)} blocks for {num_tokens} slots")
            assert len(set(table)) == len(table), f"seq {seq_id} holds a block twice: {table}"
            assert seq_id not in self._host_block_tables, f"seq {seq_id} is on device and host"
            refs.update(table)
            for index, block in enumerate(table):
                fill = min(block_size, num_tokens - index * block_size)
                assert fills.setdefault(block, fill) == fill, (
                    f"block {block} is shared by sequences that fill it differently")
        for table in self._retained_tables():   # full blocks, one reference each
            refs.update(table)
            for block in table:
                assert fills.setdefault(block, block_size) == block_size, (
                    f"retained block {block} is not full")
        assert set(self._slots) == set(self.block_tables), (
            "allocated lengths and tables name different sequences")
        if self._any_block_shared:
            ref_counts = self._ref_counts
        else:   # not counted yet: none shared, and nothing written
            assert not any(self._ref_counts), "ref counts written before any block was shared"
            assert all(count == 1 for count in refs.values()), (
                "a block is shared but ref counts are not kept")
            ref_counts = [refs[block] for block in range(self.num_blocks)]
        for seq_id, slots in self._slots.items():
            num_slots = slots.num_exclusive
            if num_slots == NOT_EXCLUSIVE:
                continue
            table = self.block_tables.get(seq_id)
            assert table is not None and num_slots == len(table) * block_size, (
                f"seq {seq_id}: stale fast-path capacity {num_slots}")
            assert ref_counts[table[-1]] == 1, (
                f"seq {seq_id}: fast path open on a shared last block")
        for block, ref_count in enumerate(ref_counts):
            assert ref_count >= 0, f"block {block} has ref count {ref_count}"
            assert ref_count == refs[block], (
                f"block {block} has ref count {ref_count} but {refs[block]} tables hold it")

        free_blocks = list(self._free_block_ids) + list(self._evictable_block_ids)
        assert len(set(free_blocks)) == len(free_blocks), "a block is free twice"
        assert all(ref_counts[block] == 0 for block in free_blocks), "a free block is in use"
        assert self.num_free_blocks() + len(refs) == self.num_blocks, (
            f"free {self.num_free_blocks()} + used {len(refs)} != {self.num_blocks} blocks")
        assert all(block in self._block_to_hash for block in self._evictable_block_ids), (
            "an evictable block has no hash")
        assert not any(block in self._block_to_hash for block in self._free_block_ids), (
            "an uncached free block still has a hash")
        assert {block: h for h, block in self._hash_to_block.items()} == self._block_to_hash, (
            "hash maps disagree")

        stored = sum(fills.values())
        assert stored == self._num_tokens_stored, (
            f"tokens stored is {self._num_tokens_stored}, recount gives {stored}")
        assert stored <= self.num_slots_allocated(), "more tokens stored than slots allocated"
        assert all(ref_counts[dst] > 0 for _, dst in self._pending_copies), (
            "a pending copy targets a free block")
        self._check_host_pool()
        self._check_tier(ref_counts)
