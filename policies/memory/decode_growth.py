"""The blocks a batch of decodes takes as it goes on a token a step: what a KV manager tells the
simulator's repeated steps (sim/core/repeated_steps.py) through `decode_growth`."""
from __future__ import annotations

from policies.types import Sequence


def slots_left(seqs: list[Sequence], block_size: int) -> list[int]:
    """The slots left in the last blocks of decodes that hold exactly the blocks their tokens
    fill."""
    return [-seq.num_tokens % block_size for seq in seqs]


def new_blocks_per_step(slots_left: bytes | list[int], block_size: int, num_steps: int,
                        first_step: int = 0) -> list[int]:
    """The blocks decodes with these slots left take at each of this step and the next
    `num_steps - 1` (one with s left takes a block at steps s + 1, s + 1 + block_size, ...);
    from a later `first_step`, the first entry counts every block taken by then."""
    return DecodeGrowth(slots_left, block_size).new_blocks_per_step(num_steps, first_step)


class DecodeGrowth:
    """Paged decodes counted by slots left in their last blocks: at step t >= 1
    `cycle[(t - 1) % block_size]` of them take a block (kept for a whole run, so a decode leaving
    costs no pass over the rest)."""

    __slots__ = ("block_size", "cycle")

    def __init__(self, slots_left: bytes | list[int], block_size: int):
        self.block_size = block_size
        if isinstance(slots_left, bytes):   # one C pass per count
            self.cycle = [slots_left.count(num_left) for num_left in range(block_size)]
        else:
            self.cycle = [0] * block_size
            for num_left in slots_left:
                self.cycle[num_left] += 1

    @classmethod
    def of(cls, seqs: list[Sequence], block_size: int) -> DecodeGrowth:
        """The growth of decodes that hold exactly the blocks their tokens fill."""
        # One pass over the batch: faster than building bytes to count, up to hundreds of decodes.
        cycle = [0] * block_size
        for seq in seqs:
            cycle[-seq.num_tokens % block_size] += 1
        growth = cls.__new__(cls)
        growth.block_size, growth.cycle = block_size, cycle
        return growth

    def join(self, seqs: list[Sequence], num_steps: int) -> None:
        """Decodes (counters where they join) join the batch `num_steps` steps after its counters
        stood: each counts where its blocks fall in the batch's steps."""
        cycle, block_size = self.cycle, self.block_size
        for seq in seqs:
            cycle[(num_steps - seq.num_tokens) % block_size] += 1

    def blocks_between(self, first: int, last: int) -> int:
        """The blocks taken at steps first + 1 to `last`."""
        cycle, block_size = self.cycle, self.block_size
        num_cycles, num_past = divmod(last - first, block_size)
        start = first % block_size   # the cycle index of step first + 1
        end = start + num_past
        blocks = (sum(cycle[start:end]) if end <= block_size
                  else sum(cycle[start:]) + sum(cycle[:end - block_size]))
        return blocks + sum(cycle) * num_cycles if num_cycles else blocks

    def remove(self, slots_left: list[int]) -> None:
        """Decodes with these slots left leave the batch."""
        cycle = self.cycle
        for num_left in slots_left:
            cycle[num_left] -= 1

    def leave(self, seqs: list[Sequence]) -> None:
        """These decodes (counters where the run began) leave the batch."""
        self.remove(slots_left(seqs, self.block_size))

    def new_blocks_per_step(self, num_steps: int, first_step: int = 0) -> list[int]:
        """The module's `new_blocks_per_step` for this batch."""
        if not num_steps:
            return []
        cycle, block_size = self.cycle, self.block_size
        first = self.blocks_between(0, first_step) if first_step else 0
        if num_steps == 1:
            return [first]
        start = first_step % block_size   # cycle index of step first_step + 1
        if start + num_steps - 1 <= block_size:
            return [first, *cycle[start:start + num_steps - 1]]
        per_step = [first]
        for step in range(first_step + 1, first_step + num_steps):
            per_step.append(cycle[(step - 1) % block_size])
        return per_step


class NoDecodeGrowth:
    """The growth of decodes that never take a block (a contiguous reservation holds them)."""

    __slots__ = ()

    def leave(self, seqs: list[Sequence]) -> None:
        pass

    def join(self, seqs: list[Sequence], num_steps: int) -> None:
        pass

    def remove(self, slots_left: list[int]) -> None:
        pass

    def blocks_between(self, first: int, last: int) -> int:
        return 0

    def new_blocks_per_step(self, num_steps: int, first_step: int = 0) -> list[int]:
        return [0] * num_steps
