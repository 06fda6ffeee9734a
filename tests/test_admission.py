"""Admission under the token budget (policies/batching/admission.py): a head the pool refused is
not asked about again while the answer cannot change, and is admitted as soon as it can."""
from __future__ import annotations

import pytest

from factories import make_seq
from policies.batching.admission import Admission
from policies.batching.queues import Queues
from policies.memory import PagedBlockManager
from policies.types import StepPlan

BLOCK_SIZE = 16


def admission_over(num_blocks: int) -> tuple[Admission, PagedBlockManager]:
    kv_cache = PagedBlockManager(num_blocks, BLOCK_SIZE, watermark=0.0)
    return Admission(Queues(), kv_cache, max_num_seqs=8, lora=None, kv_retention=None,
                     num_loaded_prefix_tokens=None), kv_cache


def admit(admission: Admission, kv_cache: PagedBlockManager, request, token_budget: int,
          chunked: bool) -> int | None:
    admission.queues.waiting.append(request)
    budget_left = admission.admit(request, StepPlan(block_tables=kv_cache.block_tables),
                                  token_budget, 0.0, chunked, lambda _: True,
                                  admission.queues.take_waiting)
    if budget_left is None:
        admission.queues.waiting.remove(request)
    return budget_left


def test_a_refused_head_is_admitted_once_the_pool_frees_blocks():
    admission, kv_cache = admission_over(num_blocks=4)
    holder = make_seq(0, prompt_len=2 * BLOCK_SIZE)
    assert admit(admission, kv_cache, holder.request, 4096, chunked=False) is not None
    head = make_seq(1, prompt_len=3 * BLOCK_SIZE)
    for _ in range(2):   # asked twice with the pool as it was: refused both times
        assert admit(admission, kv_cache, head.request, 4096, chunked=False) is None
        assert admission.short_of_blocks
    kv_cache.free(holder)
    assert admit(admission, kv_cache, head.request, 4096, chunked=False) is not None
    assert len(kv_cache.block_tables[head.seq_id]) == 3


@pytest.mark.parametrize("budget", [BLOCK_SIZE, 2 * BLOCK_SIZE])
def test_a_refused_head_takes_a_smaller_chunk_when_the_budget_shrinks(budget):
    admission, kv_cache = admission_over(num_blocks=3)
    holder = make_seq(0, prompt_len=BLOCK_SIZE)
    assert admit(admission, kv_cache, holder.request, 4096, chunked=True) is not None
    head = make_seq(1, prompt_len=4 * BLOCK_SIZE)
    assert admit(admission, kv_cache, head.request, 4 * BLOCK_SIZE, chunked=True) is None
    # A chunk of the budget's size fits the two free blocks, though the whole prompt did not.
    assert admit(admission, kv_cache, head.request, budget, chunked=True) == 0
    assert len(kv_cache.block_tables[head.seq_id]) == budget // BLOCK_SIZE
