"""The paged KV manager's side of a paused run of repeated steps (sim/core/repeated_steps.py):
the pool holds the blocks and tokens the run's decodes have grown into before their tables do."""
from __future__ import annotations


class HeldDecodeGrowth:
    """PagedBlockManager's held decode growth, on the pool's free list and token count."""

    def _init_held_growth(self) -> None:
        self._held_growth_block_ids: list[int] = []
        self._num_held_growth_tokens = 0

    def can_hold_decode_growth(self) -> bool:
        """Whether decodes' growth may be held in bulk (hold_decode_growth): not with prefix caching
        or shared blocks, whose later steps depend on which block each sequence holds."""
        return not self.enable_prefix_caching and not self._any_block_shared

    def hold_decode_growth(self, num_blocks: int, num_tokens: int) -> None:
        """Take `num_blocks` free blocks and count `num_tokens` stored for decodes that have grown
        into them in a paused run, before their tables do (the pool counts as step by step)."""
        if num_blocks:
            self._held_growth_block_ids += self._take_uncached_blocks(num_blocks)
        self._num_held_growth_tokens += num_tokens
        self._num_tokens_stored += num_tokens

    def release_decode_growth(self, num_blocks: int, num_tokens: int) -> None:
        """Give back held growth, to the front of the free list, for the decodes to take it into
        their tables (take_computed_slots)."""
        if num_blocks:
            held = self._held_growth_block_ids
            released = held[len(held) - num_blocks:]
            del held[len(held) - num_blocks:]
            if self._any_block_shared:
                for block in released:
                    self._ref_counts[block] = 0
            self._free_block_ids.extendleft(reversed(released))
        self._num_held_growth_tokens -= num_tokens
        self._num_tokens_stored -= num_tokens
