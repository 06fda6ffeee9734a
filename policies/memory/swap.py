"""The paged KV manager's swap to host memory: a preempted sequence's blocks move to a host pool
(host block ids 0..num_host_blocks-1, a separate id space), each shared block once, and come
back when it is swapped in. The moves are returned as (source, destination) pairs for the
executor."""
from __future__ import annotations

from collections import Counter, deque
from typing import Sequence as Seq

from policies.memory.slots import SeqSlots
from policies.types import Sequence


class HostSwap:
    """PagedBlockManager's host pool for swapped-out sequences, on the pool's blocks and tables."""

    def _init_host_pool(self, num_host_blocks: int) -> None:
        # Host pool: tables of swapped-out sequences, their lengths, and the host refs.
        self._host_block_tables: dict[int, list[int]] = {}
        self._swapped_num_tokens: dict[int, int] = {}
        self._host_ref_counts = [0] * num_host_blocks
        self._host_free_block_ids: deque[int] = deque(range(num_host_blocks))

    def num_free_host_blocks(self) -> int:
        return len(self._host_free_block_ids)

    @staticmethod
    def _distinct_blocks(tables: dict[int, list[int]], seqs: Seq[Sequence]) -> dict[int, None]:
        """The blocks of these seqs in `tables`, each once, in first-seen order."""
        blocks: dict[int, None] = {}
        for seq in seqs:
            for block in tables.get(seq.seq_id, ()):
                blocks[block] = None
        return blocks

    def can_swap_out(self, seqs: Seq[Sequence]) -> bool:
        return len(self._distinct_blocks(self.block_tables, seqs)) <= len(self._host_free_block_ids)

    def swap_out(self, seqs: Seq[Sequence]) -> list[tuple[int, int]]:
        """Move the seqs' blocks to host memory, each shared block once, so sharing survives."""
        if not self.can_swap_out(seqs):
            raise RuntimeError("swap_out: not enough free host blocks (check can_swap_out first)")
        blocks = self._distinct_blocks(self.block_tables, seqs)
        if self._pending_loads and any(block in self._pending_loads for block in blocks):
            # Swap-outs run before loads: the block would be copied before its K/V arrives.
            raise RuntimeError("swap_out: a block of these seqs is still being loaded from the "
                               "host tier; a sequence cannot be swapped out in the step that "
                               "admitted it")
        device_to_host = {block: self._host_free_block_ids.popleft() for block in blocks}
        # Swaps run before this step's copies: a block still waiting for its copy-on-write copy
        # holds the right tokens only in the copy's source, so that is what goes to host.
        copy_sources = {dst: src for src, dst in self._pending_copies}
        swaps = [(copy_sources.get(device, device), host)
                 for device, host in device_to_host.items()]
        for seq in seqs:
            table = self.block_tables.pop(seq.seq_id, None)
            if table is None:
                continue
            host_table = [device_to_host[block] for block in table]
            for host_block in host_table:
                self._host_ref_counts[host_block] += 1
            num_tokens = self._slots.pop(seq.seq_id).num_allocated
            self._host_block_tables[seq.seq_id] = host_table
            self._swapped_num_tokens[seq.seq_id] = num_tokens
            self._release_blocks(table, num_tokens, seq.num_computed_tokens)
        return swaps

    def can_swap_in(self, seqs: Seq[Sequence]) -> bool:
        num_blocks_needed = len(self._distinct_blocks(self._host_block_tables, seqs))
        return self.num_free_blocks() - num_blocks_needed >= self.watermark_blocks

    def swap_in(self, seqs: Seq[Sequence]) -> list[tuple[int, int]]:
        if not self.can_swap_in(seqs):
            raise RuntimeError("swap_in: not enough free device blocks (check can_swap_in first)")
        block_size = self.block_size
        host_to_device: dict[int, int] = {}
        for seq in seqs:
            host_table = self._host_block_tables.pop(seq.seq_id, None)
            if host_table is None:
                continue
            num_tokens = self._swapped_num_tokens.pop(seq.seq_id)
            table = []
            for index, host_block in enumerate(host_table):
                block = host_to_device.get(host_block)
                if block is None:
                    block = host_to_device[host_block] = self._take_free_block()
                    self._num_tokens_stored += min(block_size, num_tokens - index * block_size)
                else:
                    if not self._any_block_shared:
                        self._count_refs(table)
                    self._ref_counts[block] += 1
                table.append(block)
            self._release_host_blocks(host_table)
            self.block_tables[seq.seq_id] = table
            self._slots[seq.seq_id] = SeqSlots(num_tokens)
        return list(host_to_device.items())

    def _release_host_blocks(self, host_table: list[int]) -> None:
        for host_block in host_table:
            self._host_ref_counts[host_block] -= 1
            if self._host_ref_counts[host_block] == 0:
                self._host_free_block_ids.append(host_block)

    def _check_host_pool(self) -> None:
        """check_invariants' part for the host pool."""
        block_size = self.block_size
        host_refs = Counter()
        for seq_id, host_table in self._host_block_tables.items():
            assert seq_id in self._swapped_num_tokens, f"swapped seq {seq_id} has no length"
            assert len(host_table) == -(-self._swapped_num_tokens[seq_id] // block_size), (
                f"swapped seq {seq_id}: {len(host_table)} host blocks for its length")
            host_refs.update(host_table)
        assert set(self._swapped_num_tokens) == set(self._host_block_tables), (
            "swapped lengths and host tables name different sequences")
        for host_block, ref_count in enumerate(self._host_ref_counts):
            assert ref_count == host_refs[host_block], (
                f"host block {host_block} has ref count {ref_count} but {host_refs[host_block]} "
                f"host tables hold it")
        host_free = list(self._host_free_block_ids)
        assert len(set(host_free)) == len(host_free), "a host block is free twice"
        assert all(self._host_ref_counts[block] == 0 for block in host_free), (
            "a free host block is in use")
        assert len(host_free) + len(host_refs) == self.num_host_blocks, (
            f"host free {len(host_free)} + used {len(host_refs)} != {self.num_host_blocks}")
