"""Every scheduler × both KV managers × both preemption modes, on random workloads with KV pools
small enough to preempt: the invariants that must hold whatever the policy.

- every request finishes exactly once with exactly its output length per sample, or is rejected
  with a reason;
- blocks in use never exceed capacity, ref counts stay consistent (the managers'
  check_invariants), and at the end every block is free;
- a sequence in a plan is running, has its slots allocated, and is never swapped out: a swapped
  sequence runs only after it is swapped in.
"""
from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.batching import (ChunkedPrefillScheduler, ContinuousBatchingScheduler,
                               StaticBatchingScheduler)
from policies.memory import ContiguousAllocator, PagedBlockManager
from policies.preemption import RecomputePreemption, SwapPreemption
from policies.types import Request, SequenceStatus, StepResult

MAX_MODEL_LEN = 128
SCHEDULERS = {
    "static": StaticBatchingScheduler,
    "continuous": ContinuousBatchingScheduler,
    "chunked_prefill": ChunkedPrefillScheduler,
}


def build_scheduler(scheduler_name, kv_name, preemption_name, block_size, num_blocks,
                    num_host_blocks, max_num_seqs, chunk_budget, prefix_caching=False,
                    speculation=None):
    if kv_name == "paged":
        kv_cache = PagedBlockManager(num_blocks, block_size, num_host_blocks=num_host_blocks,
                                     enable_prefix_caching=prefix_caching)
    else:
        kv_cache = ContiguousAllocator(num_blocks, block_size, MAX_MODEL_LEN,
                                       reserve=kv_name.split("_")[1],
                                       num_host_blocks=num_host_blocks)
    preemption = RecomputePreemption() if preemption_name == "recompute" else SwapPreemption()
    budget = chunk_budget if scheduler_name == "chunked_prefill" else MAX_MODEL_LEN
    return SCHEDULERS[scheduler_name](kv_cache, preemption, max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=budget,
                                      max_model_len=MAX_MODEL_LEN, speculation=speculation)


def check_speculation(scheduler, plan):
    """Drafts only on decodes, never past the output length or max_model_len, with their slots
    allocated, and the plan's aggregates in step with spec_lens."""
    planned = {seq.seq_id: (seq, num_new) for seq, num_new in zip(plan.seqs, plan.num_new_tokens)}
    for seq_id, k in plan.spec_lens.items():
        seq, num_new = planned[seq_id]
        assert k >= 1 and num_new == 1 and seq.num_output_tokens > 0
        assert seq.num_computed_tokens == seq.num_tokens - 1, f"{seq} speculates mid-prefill"
        assert seq.num_output_tokens + k + 1 <= seq.request.output_len
        assert seq.num_tokens + k <= scheduler.max_model_len
        table = scheduler.kv_cache.block_tables[seq_id]
        assert len(table) * scheduler.kv_cache.block_size >= seq.num_tokens + k
    assert plan.num_draft_tokens == sum(plan.spec_lens.values())
    assert plan.max_draft_len == max(plan.spec_lens.values(), default=0)


def drive(scheduler, requests, step_duration=0.01, max_steps=20_000, execute=None):
    """Run a scheduler to completion with a fake executor, checking invariants every step.
    `execute(plan) -> StepResult` replaces the default (every step takes step_duration)."""
    kv_cache = scheduler.kv_cache
    pending = sorted(requests, key=lambda r: r.arrival_time)
    now = 0.0
    finished_ids: list[int] = []
    for _ in range(max_steps):
        while pending and pending[0].arrival_time <= now:
            scheduler.add_request(pending.pop(0), now)
        if not scheduler.has_unfinished():
            if not pending:
                break
            now = pending[0].arrival_time
            continue
        plan = scheduler.schedule(now)
        assert not plan.is_empty, f"no progress: {scheduler.queue_lengths()}"
        assert kv_cache.num_used_blocks() <= kv_cache.num_blocks
        kv_cache.check_invariants()
        seen = set()
        for seq, num_new in zip(plan.seqs, plan.num_new_tokens):
            assert seq.seq_id not in seen, "a sequence scheduled twice in one step"
            seen.add(seq.seq_id)
            assert seq.status is SequenceStatus.RUNNING, f"{seq} planned while not running"
            assert 1 <= num_new <= seq.num_tokens - seq.num_computed_tokens
            table = kv_cache.block_tables[seq.seq_id]
            assert len(table) * kv_cache.block_size >= seq.num_computed_tokens + num_new
        assert plan.num_batched_tokens <= scheduler.max_num_batched_tokens or \
            not isinstance(scheduler, ChunkedPrefillScheduler)
        assert sum(1 for r in scheduler.running for s in r.sequences
                   if s.status is SequenceStatus.RUNNING) <= scheduler.max_num_seqs
        swapped_seq_ids = {s.seq_id for r in scheduler.swapped for s in r.sequences}
        assert not swapped_seq_ids & seen, "a swapped sequence ran before being swapped in"
        check_speculation(scheduler, plan)
        assert plan.draft_catch_up_tokens == sum(min(seq.draft_lag, seq.num_computed_tokens)
                                                 for seq in plan.seqs)
        starts_run = {seq.seq_id: seq.starts_run for seq in plan.seqs}
        result = StepResult(step_duration) if execute is None else execute(plan)
        now += result.duration
        for request in scheduler.update(plan, result, now):
            finished_ids.append(request.request_id)
        for seq in plan.seqs:  # what the drafts' outcome leaves for the sequence's next step
            k = plan.spec_lens.get(seq.seq_id, 0)
            accepted = (result.num_accepted or {}).get(seq.seq_id, 0)
            assert seq.draft_lag == (1 if k and accepted == k else 0)
            # A run of acceptable drafts ends at a rejection; a step without drafts leaves it.
            assert seq.starts_run == (accepted < k if k else starts_run[seq.seq_id])
        if plan.spec_lens:
            kv_cache.check_invariants()  # after the rejected drafts' slots went back
    else:
        raise AssertionError(f"did not finish in {max_steps} steps: {scheduler.queue_lengths()}")
    return finished_ids


def check_outcome(scheduler, requests, finished_ids):
    assert len(finished_ids) == len(set(finished_ids)), "a request finished twice"
    rejected = [r for r in requests if r.rejected_reason is not None]
    assert sorted(finished_ids) == sorted(r.request_id for r in requests
                                          if r.rejected_reason is None)
    for request in requests:
        if request.rejected_reason is not None:
            assert request.finish_time is None
            continue
        assert len(request.sequences) == request.n
        for seq in request.sequences:
            assert seq.status is SequenceStatus.FINISHED
            assert seq.num_output_tokens == request.output_len
        assert request.arrival_time <= request.first_scheduled_time <= request.first_token_time
        assert request.first_token_time <= request.finish_time
    for request in rejected:
        assert request.rejected_reason
    kv_cache = scheduler.kv_cache
    kv_cache.check_invariants()
    assert kv_cache.num_used_blocks() == 0
    assert kv_cache.num_free_blocks() == kv_cache.num_blocks
    assert not kv_cache.block_tables


request_strategy = st.tuples(
    st.floats(0, 2, allow_nan=False),           # arrival
    st.integers(1, 100),                        # prompt_len
    st.integers(1, 40),                         # output_len
    st.sampled_from([1, 1, 1, 2, 4]),           # n
)


# The policy space the invariant tests draw from (the speculation tests add to it).
POLICY_STRATEGIES = dict(
    scheduler_name=st.sampled_from(sorted(SCHEDULERS)),
    kv_name=st.sampled_from(["paged", "contiguous_max", "contiguous_oracle"]),
    preemption_name=st.sampled_from(["recompute", "swap"]),
    block_size=st.sampled_from([1, 4, 16]),
    pool_slack=st.integers(0, 200),
    num_host_blocks=st.integers(0, 64),
    max_num_seqs=st.integers(4, 12),
    chunk_budget=st.integers(1, 64),
    request_specs=st.lists(request_strategy, min_size=1, max_size=10),
)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**POLICY_STRATEGIES)
def test_every_policy_keeps_its_invariants(scheduler_name, kv_name, preemption_name,
                                           block_size, pool_slack, num_host_blocks,
                                           max_num_seqs, chunk_budget, request_specs):
    # A pool that holds at least one full-length sequence, often barely more: preemption.
    num_blocks = math.ceil(MAX_MODEL_LEN / block_size) + pool_slack // block_size
    scheduler = build_scheduler(scheduler_name, kv_name, preemption_name, block_size,
                                num_blocks, num_host_blocks, max_num_seqs, chunk_budget)
    requests = [Request(i, arrival, prompt_len, output_len, n=n)
                for i, (arrival, prompt_len, output_len, n) in enumerate(request_specs)]
    finished_ids = drive(scheduler, requests)
    check_outcome(scheduler, requests, finished_ids)


def test_preemption_happens_in_both_modes():
    """The property test's pools really are small enough to preempt, and swap really swaps."""
    for preemption_name in ("recompute", "swap"):
        scheduler = build_scheduler("continuous", "paged", preemption_name, block_size=4,
                                    num_blocks=40, num_host_blocks=64, max_num_seqs=8,
                                    chunk_budget=64)
        requests = [Request(i, 0.0, 60, 40) for i in range(6)]
        finished_ids = drive(scheduler, requests)
        check_outcome(scheduler, requests, finished_ids)
        assert sum(r.num_preemptions for r in requests) > 0


def test_too_long_request_is_rejected_and_the_run_goes_on():
    scheduler = build_scheduler("continuous", "paged", "recompute", 16, 64, 0, 8, 64)
    requests = [Request(0, 0.0, 100, 10), Request(1, 0.0, 120, 20), Request(2, 0.1, 20, 5)]
    finished_ids = drive(scheduler, requests)
    check_outcome(scheduler, requests, finished_ids)
    assert "max_model_len" in requests[1].rejected_reason
    assert sorted(finished_ids) == [0, 2]


def test_prefix_cache_in_a_run_skips_shared_prompt_blocks():
    scheduler = build_scheduler("continuous", "paged", "recompute", 4, 200, 0, 8, 64,
                                prefix_caching=True)
    shared = list(range(40))
    requests = [Request(i, 0.1 * i, 48, 5, prompt_token_ids=shared + [100 + i] * 8)
                for i in range(4)]
    total_prefill = 0
    now = 0.0
    for request in requests:
        scheduler.add_request(request, now)
    while scheduler.has_unfinished():
        plan = scheduler.schedule(now)
        total_prefill += plan.num_prefill_tokens
        now += 0.01
        scheduler.update(plan, StepResult(0.01), now)
    # The first request computes all 48 tokens; the others at most their own blocks past the
    # cached 40-token prefix (blocks registered in the same step are already usable).
    assert 48 + 3 * 8 <= total_prefill <= 4 * 48
    # A later arrival reuses the cached prefix blocks: only its own 8 tokens are computed.
    late = Request(9, now, 48, 5, prompt_token_ids=shared + [7] * 8)
    scheduler.add_request(late, now)
    plan = scheduler.schedule(now)
    assert plan.num_prefill_tokens == 8
