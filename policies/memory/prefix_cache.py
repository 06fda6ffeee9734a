"""The paged KV manager's prefix cache: full blocks registered by the chained hash of their tokens,
shared by requests whose prompts start alike, with an optional host tier for evicted blocks
(`num_offload_blocks`); docs/policies.md (KV managers) describes both.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence as Seq

from policies.memory.slots import SeqSlots
from policies.types import Sequence


def _token_ids(seq: Sequence) -> Seq[int] | None:
    """The seq's token ids as `seq.token_ids()` lists them, its prompt's own list (not copied)
    while it has no output ids: a hash reads a block's slice, and prompts run to 100k+ tokens.
    Outputs the run keeps no ids of (the simulator samples none) read as ids of the seq's own."""
    if seq.output_token_ids:
        return seq.token_ids()
    prompt = seq.request.prompt_token_ids
    if prompt is None or not seq.num_output_tokens:
        return prompt
    return _OwnOutputIds(prompt, seq.seq_id, seq.num_output_tokens)


class _OwnOutputIds:
    """A prompt's ids, then a negative id per output position of one seq, which no other seq
    has (sampled outputs almost never coincide), read by slices as a list would be."""

    __slots__ = ("prompt", "seq_id", "num_outputs")

    def __init__(self, prompt: Seq[int], seq_id: int, num_outputs: int):
        self.prompt, self.seq_id, self.num_outputs = prompt, seq_id, num_outputs

    def __len__(self) -> int:
        return len(self.prompt) + self.num_outputs

    def __getitem__(self, part: slice) -> list[int]:
        num_prompt = len(self.prompt)
        stop = min(part.stop, len(self))
        ids = list(self.prompt[part.start:min(stop, num_prompt)])
        first_id = -(self.seq_id << 32) - 1
        ids.extend(first_id - position for position in
                   range(max(part.start, num_prompt) - num_prompt, stop - num_prompt))
        return ids


class PrefixCache:
    """PagedBlockManager's prefix cache and its host tier, on the pool's blocks and tables."""

    def _init_prefix_cache(self, num_offload_blocks: int) -> None:
        # Prefix cache: chained hash of a full block's tokens <-> the block that holds them.
        self._hash_to_block: dict[int, int] = {}
        self._block_to_hash: dict[int, int] = {}
        self._seq_block_hashes: dict[int, list[int]] = {}  # seq_id -> hashes of its full blocks

        # The host tier: hash -> slot (LRU first), free slots, this step's stores and loads, and
        # the prefix tokens each seq got by loads.
        self._offloaded: OrderedDict[int, int] = OrderedDict()
        self._offload_free_ids: deque[int] = deque(range(num_offload_blocks))
        self._pending_offloads: list[tuple[int, int]] = []
        self._pending_loads: dict[int, int] = {}
        self._seq_loaded_tokens: dict[int, int] = {}

    def allocate_prefix(self, seq: Sequence) -> int:
        """Point a newly admitted seq at its longest cached prefix's blocks (loading host-tier ones
        back) and return the tokens they hold, leaving one to compute so the step has logits."""
        if not self.enable_prefix_caching:
            return 0
        if self.block_tables.get(seq.seq_id) or seq.seq_id in self._host_block_tables:
            raise ValueError(f"allocate_prefix: seq {seq.seq_id} already holds blocks")
        token_ids = _token_ids(seq)
        if token_ids is None:
            return 0
        block_size = self.block_size
        max_cached_blocks = min((seq.num_tokens - 1) // block_size, len(token_ids) // block_size)
        hashes: list[int] = []
        hit_blocks: list[int] = []
        num_loaded = 0
        for block_hash in self._prefix_hashes(token_ids, max_cached_blocks):
            block = self._hash_to_block.get(block_hash)
            if block is not None:
                if block in self._evictable_block_ids:  # revived: no reference yet
                    del self._evictable_block_ids[block]
                    self._num_tokens_stored += block_size
                    if self._any_block_shared:
                        self._ref_counts[block] = 1
                else:
                    if not self._any_block_shared:
                        self._count_refs(hit_blocks)
                    self._ref_counts[block] += 1
            elif (block_hash in self._offloaded
                  and self.num_free_blocks() > self.watermark_blocks):
                block = self._load(block_hash)
                num_loaded += 1
            else:
                break
            hashes.append(block_hash)
            hit_blocks.append(block)
        if not hit_blocks:
            return 0
        num_cached_tokens = len(hit_blocks) * block_size
        self.block_tables[seq.seq_id] = hit_blocks
        self._slots[seq.seq_id] = SeqSlots(num_cached_tokens)
        self._seq_block_hashes[seq.seq_id] = hashes
        if num_loaded:
            self._seq_loaded_tokens[seq.seq_id] = num_loaded * block_size
        return num_cached_tokens

    def num_cached_prefix_tokens(self, token_ids: Seq[int]) -> int:
        """Prompt tokens allocate_prefix would serve from either tier, changing nothing (what a
        prefix-aware router compares)."""
        if not self.enable_prefix_caching or not token_ids:
            return 0
        num_blocks = 0
        for block_hash in self._prefix_hashes(token_ids, (len(token_ids) - 1) // self.block_size):
            if block_hash not in self._hash_to_block and block_hash not in self._offloaded:
                break
            num_blocks += 1
        return num_blocks * self.block_size

    def num_loaded_prefix_tokens(self, seq: Sequence) -> int:
        """Of the tokens allocate_prefix gave `seq`, those loaded back from the host tier."""
        return self._seq_loaded_tokens.get(seq.seq_id, 0)

    def _prefix_hashes(self, token_ids: Seq[int], num_blocks: int, previous_hash=None,
                       first_block: int = 0):
        """The chained hashes of blocks first_block..num_blocks-1 of `token_ids`, each of the
        block's tokens and the hash before it (`previous_hash` for the first)."""
        block_size = self.block_size
        for index in range(first_block, num_blocks):
            start = index * block_size
            previous_hash = hash((previous_hash, tuple(token_ids[start:start + block_size])))
            yield previous_hash

    def _cache_full_blocks(self, seq: Sequence, table: list[int], num_tokens: int) -> None:
        """Register the seq's full blocks not hashed yet, as far as its token ids are known."""
        hashes = self._seq_block_hashes.setdefault(seq.seq_id, [])
        num_full_blocks = num_tokens // self.block_size
        prompt_token_ids = seq.request.prompt_token_ids
        if len(hashes) >= num_full_blocks or prompt_token_ids is None:
            return
        # Counted without listing the ids: a decode filling blocks past the known ids (the
        # simulator samples none) has nothing new to hash, every block_size steps.
        num_known_tokens = len(prompt_token_ids) + len(seq.output_token_ids or ())
        num_full_blocks = min(num_full_blocks, num_known_tokens // self.block_size)
        self._register_blocks(_token_ids(seq), table, hashes, num_full_blocks)

    def _register_blocks(self, token_ids: Seq[int], table: list[int], hashes: list[int],
                         num_blocks: int) -> None:
        """Hash and register the table's blocks from len(hashes) up to `num_blocks`, chaining on
        the seq's `hashes`, which they extend."""
        first_block = len(hashes)
        for index, block_hash in enumerate(
                self._prefix_hashes(token_ids, num_blocks, hashes[-1] if hashes else None,
                                    first_block), first_block):
            hashes.append(block_hash)
            self._register(block_hash, table[index])

    def _register(self, block_hash: int, block: int) -> None:
        """Make `block` the cache entry of `block_hash`, unless one is already: the first block
        to hold a prefix stays its entry, and a duplicate computed alongside is ordinary."""
        if block_hash not in self._hash_to_block and block not in self._block_to_hash:
            self._hash_to_block[block_hash] = block
            self._block_to_hash[block] = block_hash
            if self._offloaded:
                # Computed again on the device: its host copy goes (one tier per hash).
                slot = self._offloaded.pop(block_hash, None)
                if slot is not None:
                    self._offload_free_ids.append(slot)

    def _cache_outputs_before_preemption(self, seq: Sequence, table: list[int]) -> None:
        """Register a preempted seq's computed full blocks of outputs without ids, under ids of
        its own: vLLM V1 hashes generated tokens' blocks, so a resumed request recomputes only
        what was evicted meanwhile, and its own resume is the one hit such ids can give. (Known
        ids were registered as their blocks filled.)"""
        token_ids = _token_ids(seq)
        if not isinstance(token_ids, _OwnOutputIds):
            return
        num_computed_blocks = min(seq.num_computed_tokens // self.block_size, len(table))
        hashes = self._seq_block_hashes.setdefault(seq.seq_id, [])
        if len(hashes) < num_computed_blocks:
            self._register_blocks(token_ids, table, hashes, num_computed_blocks)

    # ---- host tier of the prefix cache ----

    def _offload(self, block: int, block_hash: int) -> None:
        """Store an evicted cached block in the host tier (dropping its least recently stored
        entry when full). Its K/V is intact until the step's forward pass: stores run first."""
        if self._offload_free_ids:
            slot = self._offload_free_ids.popleft()
        elif self._offloaded:
            _, slot = self._offloaded.popitem(last=False)
        else:
            return  # every slot is being read by a load this step: the block is forgotten
        self._offloaded[block_hash] = slot
        self._pending_offloads.append((block, slot))

    def _load(self, block_hash: int) -> int:
        """A device block for a prefix hit in the host tier, registered as the hash's cache
        entry, its load pending; the host slot stays held until take_pending_offload."""
        slot = self._offloaded.pop(block_hash)
        block = self._take_free_block()
        self._hash_to_block[block_hash] = block
        self._block_to_hash[block] = block_hash
        self._pending_loads[block] = slot
        self._num_tokens_stored += self.block_size
        return block

    def _return_to_tier(self, block: int) -> None:
        """A block freed before its pending load ran: the load is dropped and the hash goes
        back to the host slot, which still holds its K/V; the block is an uncached free one."""
        slot = self._pending_loads.pop(block)
        block_hash = self._block_to_hash.pop(block)
        del self._hash_to_block[block_hash]
        self._offloaded[block_hash] = slot

    def take_pending_offload(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The stores (device block, host slot) and loads (host slot, device block) since the last
        call; the loads' slots are free again, and a slot stored twice keeps its last store."""
        if not self._pending_offloads and not self._pending_loads:
            return [], []
        stores = list({slot: (block, slot) for block, slot in self._pending_offloads}.values())
        self._pending_offloads = []
        loads = [(slot, block) for block, slot in self._pending_loads.items()]
        self._pending_loads.clear()
        self._offload_free_ids.extend(slot for slot, _ in loads)
        return stores, loads

    def num_offloaded_blocks(self) -> int:
        """Blocks the host tier holds."""
        return len(self._offloaded)

    def _check_tier(self, ref_counts: list[int]) -> None:
        """check_invariants' part for the host tier."""
        # The prefix cache's host tier: every slot holds one entry, is free, or is held by a
        # pending load; a hash is in one tier; a pending load fills a cached block in use.
        tier_slots = (list(self._offloaded.values()) + list(self._offload_free_ids)
                      + list(self._pending_loads.values()))
        assert sorted(tier_slots) == list(range(self.num_offload_blocks)), (
            f"host tier slots are lost or held twice: {sorted(tier_slots)}")
        assert not set(self._offloaded) & set(self._hash_to_block), (
            "a hash is cached in both tiers")
        for block in self._pending_loads:
            assert block in self._block_to_hash and ref_counts[block] > 0, (
                f"pending load into block {block}, which is not a cached block in use")
        assert all(0 <= slot < self.num_offload_blocks for _, slot in self._pending_offloads), (
            "a store targets a slot outside the host tier")
        assert set(self._seq_loaded_tokens) <= set(self.block_tables) | set(
            self._host_block_tables), "loaded-token counts of sequences that hold nothing"
