"""Every scheduler × both KV managers × both preemption modes, on random workloads with KV pools
small enough to preempt: the invariants that must hold whatever the policy.

- every request finishes exactly once with exactly its output length per sample, or is rejected
  with a reason;
- blocks in use never exceed capacity, ref counts stay consistent (the managers'
  check_invariants), and at the end every block is free;
- a sequence in a plan is running, has its slots allocated, and is never swapped out: a swapped
  sequence runs only after it is swapped in.

The policies are built from their conf/ groups (factories.build_scheduler) and the checks run
every step (factories.drive) and at the end (factories.check_outcome).
"""
from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings

from policies.types import Request, StepResult

from factories import (MAX_MODEL_LEN, POLICY_STRATEGIES, build_scheduler, check_outcome, drive,
                       requests_from_specs)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**POLICY_STRATEGIES)
def test_every_policy_keeps_its_invariants(scheduler_name, kv_name, preemption_name,
                                           block_size, pool_slack, num_host_blocks,
                                           max_num_seqs, chunk_budget, request_specs):
    # A pool that holds at least one full-length sequence, often barely more: preemption.
    num_blocks = math.ceil(MAX_MODEL_LEN / block_size) + pool_slack // block_size
    scheduler = build_scheduler(scheduler_name, kv_name, preemption_name, block_size,
                                num_blocks, num_host_blocks, max_num_seqs, chunk_budget)
    requests = requests_from_specs(request_specs)
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


def test_a_readmitted_request_holds_seats_for_its_unfinished_samples_only():
    """A request preempted after one of its samples stopped early (an engine's EOS) comes back
    holding a seat for its other sample alone, and every seat is given back at the end."""
    scheduler = build_scheduler("continuous", "paged", "recompute", block_size=4,
                                num_blocks=14, num_host_blocks=0, max_num_seqs=8,
                                chunk_budget=64)
    first, sampled = Request(0, 0.0, 30, 18), Request(1, 0.0, 6, 20, n=2)
    for request in (first, sampled):
        scheduler.add_request(request, 0.0)
    now, stopped = 0.0, None
    while scheduler.has_unfinished():
        plan = scheduler.schedule(now)
        now += 0.01
        if stopped is None and len(sampled.sequences) == 2:
            stopped = {sampled.sequences[1].seq_id}   # the forked sample stops at once
            scheduler.update(plan, StepResult(0.01, stopped_seq_ids=stopped), now)
        else:
            scheduler.update(plan, StepResult(0.01), now)
        assert scheduler.num_running_seqs == sum(
            request.n - sum(seq.is_finished for seq in request.sequences)
            for request in scheduler.running)
    assert sampled.num_preemptions and sampled.finish_time is not None
    assert scheduler.num_running_seqs == 0


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
