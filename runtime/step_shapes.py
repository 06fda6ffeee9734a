"""Step shapes (`GridPoint`) and the plans that realise them (`build_plan`, through a real
PagedBlockManager), for the engine's warm-up, the profiler's grid and the speed probe."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policies.memory import PagedBlockManager
from policies.types import Request, Sequence, StepPlan

VOCAB_FOR_IDS = 256  # random prompt ids are drawn below this (the smallest test vocabulary)
SPEC_PERIOD = 16   # a repeated pattern, so prompt lookup always finds drafts


@dataclass(frozen=True)
class GridPoint:
    """One step shape: (chunk, cached context) per prefill, context per decode, copies and swaps
    in blocks."""

    point_id: int
    kind: str
    block_size: int
    prefills: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()
    num_copies: int = 0
    num_swap_out: int = 0
    num_swap_in: int = 0
    spec_len: int = 0          # draft tokens each decode verifies (speculative decoding)
    num_lagging: int = 0       # decodes (the first ones) whose draft model lags one token

    def num_blocks_needed(self) -> int:
        bs = self.block_size
        blocks = sum(-(-(chunk + ctx) // bs) for chunk, ctx in self.prefills)
        blocks += sum(-(-(ctx + self.spec_len) // bs) for ctx in self.decodes)
        # A copy needs its parent's block and its child's; swapped-out blocks are allocated
        # before they leave.
        return blocks + 2 * self.num_copies + self.num_swap_in + self.num_swap_out + 1

    def num_host_blocks_needed(self) -> int:
        return self.num_swap_out + self.num_swap_in


def spread(count: int, low: int, high: int) -> tuple[int, ...]:
    """`count` lengths spread evenly over [low, high], in a shuffled (deterministic) order."""
    step = (high - low) / max(count - 1, 1)
    lengths = [low + round(i * step) for i in range(count)]
    return tuple(lengths[(i * 37) % count] for i in range(count)) if count > 1 else (low,)


def spread_chunks(count: int, low: int, high: int) -> tuple[tuple[int, int], ...]:
    """`count` fresh prompts (no cached context) of lengths spread over [low, high]."""
    return tuple((length, 0) for length in spread(count, low, high))


class _Ids:
    def __init__(self):
        self.next_seq = 0
        self.next_request = 0


def _new_seq(ids: _Ids, rng: np.random.Generator, prompt_len: int, num_outputs: int,
             n: int = 1, period: int = 0) -> Sequence:
    """A sequence with random ids, repeating a pattern of `period` if given."""
    num_tokens = prompt_len + num_outputs
    token_ids = (np.resize(rng.integers(3, VOCAB_FOR_IDS, size=period), num_tokens) if period
                 else rng.integers(3, VOCAB_FOR_IDS, size=num_tokens))
    prompt, outputs = token_ids[:prompt_len].tolist(), token_ids[prompt_len:].tolist()
    request = Request(ids.next_request, 0.0, prompt_len, max(num_outputs, 1) + 16, n=n,
                      prompt_token_ids=prompt)
    ids.next_request += 1
    seq = Sequence(ids.next_seq, request, num_output_tokens=num_outputs, output_token_ids=outputs)
    ids.next_seq += 1
    request.sequences.append(seq)
    return seq


def build_plan(point: GridPoint, rng: np.random.Generator | None = None,
               num_blocks: int | None = None, num_host_blocks: int | None = None,
               aged_pool: bool = False) -> StepPlan:
    """The point's StepPlan, built as the policies would in a fresh PagedBlockManager (with
    `aged_pool`, aged by its own generator so the plan's draws stay those of a fresh pool)."""
    rng = rng if rng is not None else np.random.default_rng(point.point_id)
    num_blocks = num_blocks or point.num_blocks_needed()
    num_host_blocks = num_host_blocks if num_host_blocks is not None else (
        point.num_host_blocks_needed())
    kv = PagedBlockManager(num_blocks, point.block_size, num_host_blocks=num_host_blocks,
                           watermark=0.0, share_on_fork=False)
    if aged_pool:
        age_pool(kv, np.random.default_rng(point.point_id).permutation(num_blocks).tolist())
    bs = point.block_size
    ids = _Ids()
    plan = StepPlan()

    # Memory operations first, in the order the executor carries them out.
    if point.num_swap_in:
        back = _new_seq(ids, rng, point.num_swap_in * bs, 0)
        _allocate(kv, back, point.num_swap_in * bs)
        back.num_computed_tokens = point.num_swap_in * bs
        kv.swap_out([back])               # (not executed: it only puts the blocks on host)
        plan.blocks_to_swap_in = kv.swap_in([back])
    if point.num_swap_out:
        leaving = _new_seq(ids, rng, point.num_swap_out * bs, 0)
        _allocate(kv, leaving, point.num_swap_out * bs)
        leaving.num_computed_tokens = point.num_swap_out * bs
        plan.blocks_to_swap_out = kv.swap_out([leaving])
    if point.num_copies:
        parent = _new_seq(ids, rng, point.num_copies * bs, 0, n=2)
        _allocate(kv, parent, point.num_copies * bs)
        child = Sequence(ids.next_seq, parent.request)
        ids.next_seq += 1
        if not kv.fork(parent, child):
            raise RuntimeError(f"grid point {point.point_id}: copies do not fit")
        plan.blocks_to_copy = kv.take_pending_copies()

    decodes = []
    for ctx in point.decodes:
        seq = _new_seq(ids, rng, ctx - 1, 1, period=SPEC_PERIOD if point.spec_len else 0)
        _allocate(kv, seq, ctx + point.spec_len)   # the drafts' lookahead slots too
        seq.num_computed_tokens = ctx - 1
        seq.draft_lag = int(len(decodes) < point.num_lagging)
        decodes.append(seq)
    if decodes:
        plan.add_decodes(decodes)
        if point.spec_len:
            plan.add_drafts({seq.seq_id: point.spec_len for seq in decodes})
    for chunk, ctx in point.prefills:
        seq = _new_seq(ids, rng, ctx + chunk, 0)
        _allocate(kv, seq, ctx + chunk)
        seq.num_computed_tokens = ctx
        plan.add(seq, chunk)
    plan.block_tables = kv.block_tables
    return plan


def age_pool(kv: PagedBlockManager, free_order: list[int]) -> None:
    """Make the empty pool hand its blocks out in `free_order` next, since a fresh pool's
    consecutive blocks are gathered faster than a serving pool's scattered ones."""
    if kv.num_used_blocks() or sorted(free_order) != list(range(kv.num_blocks)):
        raise ValueError(f"age_pool: free_order must be a permutation of the empty pool's "
                         f"{kv.num_blocks} block ids")
    request = Request(-1, 0.0, kv.block_size, 1)
    holder_of_block = {}
    for seq_id in range(kv.num_blocks):      # one block each
        holder = Sequence(seq_id, request)
        _allocate(kv, holder, kv.block_size)
        holder_of_block[kv.block_tables[seq_id][0]] = holder
    for block in free_order:
        kv.free(holder_of_block[block])


def _allocate(kv: PagedBlockManager, seq: Sequence, num_tokens: int) -> None:
    if not kv.allocate_slots(seq, num_tokens):
        raise RuntimeError(f"step shape: {num_tokens} slots do not fit the KV pool")
