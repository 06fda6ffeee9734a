"""Speculation on the policy side: the speculation policies, the KV managers giving back rejected
drafts' slots, and every scheduler × KV manager × preemption mode with random acceptance
patterns (no block leaked, no draft past the output length, every request finished exactly once).
"""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from policies.batching import ChunkedPrefillScheduler, ContinuousBatchingScheduler
from policies.memory import ContiguousAllocator, PagedBlockManager
from policies.preemption import RecomputePreemption
from policies.protocols import KVCacheManager, SpeculationPolicy
from policies.speculation import (AcceptanceCounts, AdaptiveSpeculation, FixedSpeculation,
                                  NoSpeculation, expected_tokens_per_step)
from policies.types import Request, StepResult
from runtime.metrics import MetricsCollector, StepRecorder

from factories import (MAX_MODEL_LEN, POLICY_STRATEGIES, build_scheduler, check_outcome, drive,
                       make_seq, requests_from_specs)


# ---------------------------------------------------------------- the policies

def test_builtins_satisfy_the_protocol():
    for policy in (NoSpeculation(), FixedSpeculation(3), AdaptiveSpeculation(4)):
        assert isinstance(policy, SpeculationPolicy)
    assert isinstance(PagedBlockManager(4, 4), KVCacheManager)
    assert isinstance(ContiguousAllocator(4, 4, max_model_len=16), KVCacheManager)


def test_no_and_fixed_speculation():
    assert NoSpeculation().max_num_speculative_tokens == 0
    assert NoSpeculation().num_speculative_tokens(5) == 0
    assert FixedSpeculation(0).max_num_speculative_tokens == 0  # plain decoding
    fixed = FixedSpeculation(4)
    assert fixed.max_num_speculative_tokens == 4
    assert [fixed.num_speculative_tokens(b) for b in (1, 64, 1024)] == [4, 4, 4]
    fixed.observe([4, 4, 2], [4, 1, 0])
    assert fixed.acceptance.position_trials == [3, 2, 1, 1]
    assert fixed.acceptance.position_accepts == [2, 1, 1, 1]


@pytest.mark.parametrize("build, message", [
    (lambda: FixedSpeculation(-1), "speculation.num_speculative_tokens must be a non-negative"),
    (lambda: FixedSpeculation(2.5), "speculation.num_speculative_tokens must be a non-negative"),
    (lambda: AdaptiveSpeculation(0), "speculation.max_num_speculative_tokens must be a positive"),
    (lambda: AdaptiveSpeculation(4, compute_bound_tokens=0), "speculation.compute_bound_tokens"),
    (lambda: AdaptiveSpeculation(4, draft_cost_ratio=-1), "speculation.draft_cost_ratio"),
    (lambda: AdaptiveSpeculation(4, initial_acceptance_rate=1.5),
     "speculation.initial_acceptance_rate must be a number in [0, 1], got 1.5"),
    (lambda: AdaptiveSpeculation(4, decay=0), "speculation.decay must be a number in (0, 1]"),
])
def test_bad_arguments_are_one_clear_error(build, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        build()


def test_observe_rejects_impossible_outcomes():
    for policy in (FixedSpeculation(2), AdaptiveSpeculation(2)):
        with pytest.raises(ValueError, match="3 accepted of 2 proposed"):
            policy.observe([2], [3])
        with pytest.raises(ValueError, match="at most 2 per step"):
            policy.observe([3], [0])


@given(rate=st.floats(0, 0.999), k=st.integers(0, 12))
def test_expected_tokens_matches_the_closed_form(rate, k):
    expected = expected_tokens_per_step([rate] * k, k)
    assert expected == pytest.approx((1 - rate ** (k + 1)) / (1 - rate))


def test_acceptance_counts_give_the_statistics_file():
    counts = AcceptanceCounts(3)
    counts.record([3, 3, 3, 1], [0, 3, 1, 1])
    assert counts.position_trials == [4, 2, 1]
    assert counts.position_accepts == [3, 1, 1]
    assert counts.acceptance_rates() == [0.75, 0.5, 1.0]
    stats = counts.to_statistics("ngram", "llama-2-7b", "unit test")
    assert stats["num_speculative_tokens"] == 3
    assert stats["position_trials"] == [4, 2, 1] and stats["drafter"] == "ngram"


def adaptive_after(acceptance_rate: float, steps: int = 200, **kwargs) -> AdaptiveSpeculation:
    """An adaptive policy that has seen `steps` steps of 8 sequences proposing 4 drafts with
    `acceptance_rate` i.i.d. per position, as a deterministic fraction of the trials."""
    policy = AdaptiveSpeculation(4, **kwargs)
    for step in range(steps):
        accepted = []
        for seq in range(8):
            num = 0
            # A low-discrepancy pattern so each position is accepted at ~acceptance_rate.
            while num < 4 and ((step * 8 + seq) * 0.618 * (num + 1)) % 1 < acceptance_rate:
                num += 1
            accepted.append(num)
        policy.observe([4] * 8, accepted)
    return policy


@pytest.mark.parametrize("per_sequence_cost_ratio", [0.0, 0.02])
def test_adaptive_k_falls_as_the_batch_grows(per_sequence_cost_ratio):
    """To 0 when verification is all a large batch pays for; to a smaller k when each
    sequence's KV read costs more than its verification tokens (speculation amortises it)."""
    policy = adaptive_after(0.8, per_sequence_cost_ratio=per_sequence_cost_ratio)
    ks = [policy.num_speculative_tokens(batch) for batch in (1, 8, 32, 64, 128, 256, 1024)]
    assert ks == sorted(ks, reverse=True), ks
    assert ks[0] == 4 > ks[-1], ks
    assert (ks[-1] == 0) == (per_sequence_cost_ratio == 0), ks
    assert policy.num_speculative_tokens(0) == 0


def test_adaptive_k_rises_with_acceptance():
    low, high = adaptive_after(0.2), adaptive_after(0.9)
    assert low.acceptance_estimates()[0] < 0.35 < 0.8 < high.acceptance_estimates()[0]
    for batch in (1, 16, 64):
        assert low.num_speculative_tokens(batch) <= high.num_speculative_tokens(batch)
    for batch in (1, 96):
        assert low.num_speculative_tokens(batch) < high.num_speculative_tokens(batch)


def test_adaptive_draft_cost_lowers_k():
    cheap = adaptive_after(0.6, draft_cost_ratio=0.0)
    dear = adaptive_after(0.6, draft_cost_ratio=0.5)
    assert dear.num_speculative_tokens(1) < cheap.num_speculative_tokens(1)


def test_adaptive_forgets_toward_its_prior_without_observations():
    policy = adaptive_after(0.0)
    assert policy.num_speculative_tokens(1) == 0
    for _ in range(1000):
        policy.observe([], [])
    assert policy.acceptance_estimates()[0] == pytest.approx(policy.initial_acceptance_rate,
                                                             abs=0.01)
    assert policy.num_speculative_tokens(1) > 0


# ---------------------------------------------------------------- KV managers give slots back

def build_manager(kind: str, num_blocks: int, block_size: int):
    if kind == "paged":
        return PagedBlockManager(num_blocks, block_size)
    if kind == "paged_prefix":
        return PagedBlockManager(num_blocks, block_size, enable_prefix_caching=True)
    return ContiguousAllocator(num_blocks, block_size, max_model_len=num_blocks * block_size)


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["paged", "paged_prefix", "contiguous"]),
       block_size=st.sampled_from([1, 3, 4, 16]),
       steps=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 8), st.integers(0, 8)),
                      min_size=1, max_size=12))
def test_trim_leaves_the_manager_as_if_only_the_kept_slots_were_allocated(kind, block_size,
                                                                           steps):
    """Allocate a decode's slots plus k drafts, keep j, trim; the reference allocated exactly
    the kept slots. Both must agree on blocks used, tokens stored and the table's length."""
    num_blocks = 1000
    trimmed, reference = (build_manager(kind, num_blocks, block_size) for _ in range(2))
    seq = make_seq(0, 1, output_len=64)
    length = 1
    for num_new, num_drafts, num_kept in steps:
        length += num_new
        assert trimmed.allocate_slots(seq, length + num_drafts)
        trimmed.check_invariants()
        length += min(num_kept, num_drafts)
        trimmed.trim_slots(seq, length)
        assert reference.allocate_slots(seq, length)
        trimmed.check_invariants()
        assert trimmed.num_used_blocks() == reference.num_used_blocks()
        assert trimmed.num_tokens_stored() == reference.num_tokens_stored() == length
        assert len(trimmed.block_tables[0]) == len(reference.block_tables[0])
    trimmed.free(seq)
    trimmed.check_invariants()
    assert trimmed.num_free_blocks() == num_blocks


def test_paged_trim_frees_whole_blocks_and_reopens_the_fast_path():
    manager = PagedBlockManager(10, 4)
    seq = make_seq(0, 5, output_len=64)
    assert manager.allocate_slots(seq, 5 + 6)  # 11 slots: 3 blocks
    assert manager.num_used_blocks() == 3
    manager.trim_slots(seq, 6)                 # 2 blocks
    manager.check_invariants()
    assert manager.num_used_blocks() == 2 and manager.num_tokens_stored() == 6
    manager.trim_slots(seq, 8)                 # longer than what is left: nothing to do
    assert manager.num_tokens_stored() == 6
    seq.num_tokens = 7
    assert manager.append_slots([seq]) == 1    # inside its own last block
    manager.check_invariants()
    assert manager.num_used_blocks() == 2


def test_trim_errors_name_the_bad_value():
    for manager in (PagedBlockManager(4, 4), ContiguousAllocator(4, 4, max_model_len=16)):
        seq = make_seq(3, 4, output_len=64)
        with pytest.raises(ValueError, match="trim_slots: seq 3 holds no device blocks"):
            manager.trim_slots(seq, 2)
        manager.allocate_slots(seq, 4)
        with pytest.raises(ValueError, match="trim_slots: num_tokens must be a positive integer"):
            manager.trim_slots(seq, 0)


def test_contiguous_trim_keeps_the_reservation():
    manager = ContiguousAllocator(16, 4, max_model_len=32)
    seq = make_seq(0, 5, output_len=64)
    assert manager.allocate_slots(seq, 9)
    manager.trim_slots(seq, 6)
    manager.check_invariants()
    assert manager.num_used_blocks() == 8 and manager.num_tokens_stored() == 6


# ---------------------------------------------------------------- the scheduler

def decoding_scheduler(speculation, *, num_blocks=64, block_size=4,
                       scheduler_class=ContinuousBatchingScheduler, max_model_len=128,
                       requests=((10, 20),)):
    """A scheduler whose requests (prompt_len, output_len) have prefilled and sampled their
    first token: the next plan decodes them all."""
    kv_cache = PagedBlockManager(num_blocks, block_size, watermark=0.0)
    scheduler = scheduler_class(kv_cache, RecomputePreemption(), max_num_seqs=16,
                                max_num_batched_tokens=256, max_model_len=max_model_len,
                                speculation=speculation)
    for request_id, (prompt_len, output_len) in enumerate(requests):
        scheduler.add_request(Request(request_id, 0.0, prompt_len, output_len), 0.0)
    plan = scheduler.schedule(0.0)
    assert plan.num_prefill_seqs == len(requests) and not plan.spec_lens
    scheduler.update(plan, StepResult(0.01), 0.01)
    return scheduler


def test_a_decode_speculates_and_keeps_its_accepted_drafts():
    scheduler = decoding_scheduler(FixedSpeculation(3))
    kv_cache = scheduler.kv_cache
    seq = scheduler.running[0].sequences[0]
    assert (seq.num_tokens, seq.num_output_tokens) == (11, 1)
    plan = scheduler.schedule(0.01)
    assert plan.spec_lens == {seq.seq_id: 3}
    assert (plan.num_draft_tokens, plan.max_draft_len, plan.num_batched_tokens) == (3, 3, 4)
    assert kv_cache._slots[seq.seq_id].num_allocated == 14   # last token + 3 drafts
    recorder = StepRecorder(MetricsCollector())
    outputs_before, times_before = [seq.num_output_tokens], [seq.last_token_time]
    scheduler.update(plan, StepResult(0.02, num_accepted={seq.seq_id: 2}), 0.03)
    recorder.record_itls(plan.seqs, outputs_before, times_before, 0.03)
    assert (seq.num_tokens, seq.num_computed_tokens, seq.num_output_tokens) == (14, 13, 4)
    assert kv_cache._slots[seq.seq_id].num_allocated == 14
    # The three tokens of one step share one inter-token time.
    [(itl, count)] = recorder.itl_counts.items()
    assert itl == pytest.approx(0.02) and count == 3
    assert scheduler.speculation.acceptance.position_accepts == [1, 1, 0]
    plan = scheduler.schedule(0.03)
    scheduler.update(plan, StepResult(0.02, num_accepted={seq.seq_id: 0}), 0.05)
    assert (seq.num_tokens, seq.num_computed_tokens) == (15, 14)
    assert kv_cache._slots[seq.seq_id].num_allocated == 15   # the 2 rejected drafts went back
    kv_cache.check_invariants()


def test_engine_results_gain_their_sampled_tokens():
    """The engine returns token ids (accepted drafts + one), and num_accepted for metrics."""
    scheduler = decoding_scheduler(FixedSpeculation(2))
    seq = scheduler.running[0].sequences[0]
    seq.output_token_ids = [7]
    plan = scheduler.schedule(0.01)
    result = StepResult(0.02, sampled_token_ids={seq.seq_id: [8, 9, 10]},
                        num_accepted={seq.seq_id: 2})
    scheduler.update(plan, result, 0.03)
    assert seq.output_token_ids == [7, 8, 9, 10]
    assert (seq.num_tokens, seq.num_computed_tokens) == (14, 13)
    # Stopped at an EOS among the drafts: fewer tokens, the sequence finishes.
    plan = scheduler.schedule(0.03)
    result = StepResult(0.02, sampled_token_ids={seq.seq_id: [2]}, stopped_seq_ids={seq.seq_id},
                        num_accepted={seq.seq_id: 1})
    assert scheduler.update(plan, result, 0.05) == [seq.request]
    assert scheduler.kv_cache.num_used_blocks() == 0


def test_no_draft_passes_the_output_length_or_max_model_len():
    scheduler = decoding_scheduler(FixedSpeculation(8), requests=((10, 4), (120, 8)))
    short, long = (request.sequences[0] for request in scheduler.running)
    plan = scheduler.schedule(0.01)
    # 1 output + k + 1 <= 4 -> k = 2; 121 tokens + k <= 128 -> k = 7 (its output allows 6).
    assert plan.spec_lens == {short.seq_id: 2, long.seq_id: 6}


def test_a_short_budget_lowers_k_and_keeps_every_decode():
    requests = tuple((10, 50) for _ in range(4))
    scheduler = decoding_scheduler(FixedSpeculation(4), requests=requests,
                                   scheduler_class=ChunkedPrefillScheduler)
    scheduler.max_num_batched_tokens = 11
    plan = scheduler.schedule(0.01)
    assert plan.num_decode_seqs == 4
    # 11 tokens for 4 decodes: one each, and (11 - 4) // 4 = 1 draft each.
    assert set(plan.spec_lens.values()) == {1} and len(plan.spec_lens) == 4
    assert plan.num_batched_tokens <= 11


def test_drafts_that_do_not_fit_are_dropped_instead_of_preempting():
    # 5 blocks of 4: two 8-token sequences hold 2 blocks each; 4 drafts need a third block.
    scheduler = decoding_scheduler(FixedSpeculation(4), num_blocks=5, requests=((7, 8),) * 2)
    first, second = (request.sequences[0] for request in scheduler.running)
    plan = scheduler.schedule(0.01)
    assert plan.num_decode_seqs == 2 and not plan.preempted_recompute
    assert plan.spec_lens == {first.seq_id: 4}
    assert scheduler.kv_cache.num_used_blocks() == 5
    scheduler.kv_cache.check_invariants()


def test_no_speculation_policy_is_the_plain_path():
    scheduler = decoding_scheduler(NoSpeculation())
    plan = scheduler.schedule(0.01)
    assert plan.spec_lens == {} and plan.num_draft_tokens == 0 and plan.num_decode_seqs == 1


def test_a_plan_with_drafts_needs_acceptances():
    scheduler = decoding_scheduler(FixedSpeculation(2))
    plan = scheduler.schedule(0.01)
    with pytest.raises(ValueError, match="no num_accepted"):
        scheduler.update(plan, StepResult(0.01), 0.02)


def test_a_bad_policy_is_one_clear_error():
    class Greedy:
        max_num_speculative_tokens = 2

        def num_speculative_tokens(self, num_decodes):
            return 5

        def observe(self, proposed, accepted):
            pass

    scheduler = decoding_scheduler(Greedy())
    with pytest.raises(ValueError, match=r"Greedy.num_speculative_tokens returned 5; .*\[0, 2\]"):
        scheduler.schedule(0.01)
    with pytest.raises(ValueError, match=r"^speculation: object lacks max_num_speculative_tokens, "
                                         r"num_speculative_tokens, observe \(SpeculationPolicy, "):
        ContinuousBatchingScheduler(PagedBlockManager(8, 4), RecomputePreemption(),
                                    max_model_len=8, max_num_batched_tokens=8,
                                    speculation=object())
    Greedy.max_num_speculative_tokens = -1
    with pytest.raises(ValueError, match="max_num_speculative_tokens must be a non-negative"):
        decoding_scheduler(Greedy())


def test_remove_request_drops_its_drafts():
    scheduler = decoding_scheduler(FixedSpeculation(2), requests=((10, 20), (10, 20)))
    first, second = scheduler.running
    plan = scheduler.schedule(0.01)
    assert plan.num_draft_tokens == 4
    plan.remove_request(first)
    assert plan.spec_lens == {second.sequences[0].seq_id: 2}
    assert (plan.num_draft_tokens, plan.max_draft_len, plan.num_decode_seqs) == (2, 2, 1)


# ---------------------------------------------------------------- random runs

def acceptance_executor(pattern: list[int], step_duration: float = 0.01):
    """A stand-in executor: the i-th speculating sequence of the run accepts
    min(pattern[i % len(pattern)], k) drafts."""
    draws = iter(range(10 ** 9))

    def execute(plan):
        num_accepted = {seq_id: min(pattern[next(draws) % len(pattern)], k)
                        for seq_id, k in plan.spec_lens.items()}
        return StepResult(step_duration, num_accepted=num_accepted)
    return execute


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    **POLICY_STRATEGIES,
    speculation=st.one_of(st.integers(1, 6).map(FixedSpeculation),
                          st.integers(1, 6).map(lambda k: AdaptiveSpeculation(
                              k, compute_bound_tokens=16))),
    pattern=st.lists(st.integers(0, 6), min_size=1, max_size=30),
)
def test_every_policy_keeps_its_invariants_while_speculating(
        scheduler_name, kv_name, preemption_name, block_size, pool_slack, num_host_blocks,
        max_num_seqs, chunk_budget, request_specs, speculation, pattern):
    num_blocks = math.ceil(MAX_MODEL_LEN / block_size) + pool_slack // block_size
    scheduler = build_scheduler(scheduler_name, kv_name, preemption_name, block_size,
                                num_blocks, num_host_blocks, max_num_seqs, chunk_budget,
                                speculation=speculation)
    requests = requests_from_specs(request_specs)
    finished_ids = drive(scheduler, requests, execute=acceptance_executor(pattern))
    check_outcome(scheduler, requests, finished_ids)


def test_a_sample_swapped_out_in_the_step_that_gave_it_a_chunk_resumes():
    """Found by the property test: a request's forked sample got a 28-token chunk, the request
    was swapped out in the same step, and after its swap in a 27-token budget asked for fewer
    slots than its table held. A victim now gives back the slots of this step first."""
    scheduler = build_scheduler("chunked_prefill", "contiguous_oracle", "swap", block_size=4,
                                num_blocks=34, num_host_blocks=22, max_num_seqs=6,
                                chunk_budget=32, speculation=FixedSpeculation(1))
    specs = [(0.0, 23, 14, 2), (0.125, 6, 1, 1), (0.0625, 27, 2, 4), (0.03125, 21, 8, 4)]
    requests = [Request(i, arrival, prompt_len, output_len, n=n)
                for i, (arrival, prompt_len, output_len, n) in enumerate(specs)]
    finished_ids = drive(scheduler, requests, execute=acceptance_executor([0, 1]))
    check_outcome(scheduler, requests, finished_ids)
    assert sum(request.num_preemptions for request in requests) > 0


def test_speculation_shortens_runs_and_preempts_in_small_pools():
    """The random runs above really speculate, accept, reject and preempt."""
    for preemption_name in ("recompute", "swap"):
        speculation = FixedSpeculation(4)
        scheduler = build_scheduler("continuous", "paged", preemption_name, block_size=4,
                                    num_blocks=40, num_host_blocks=64, max_num_seqs=8,
                                    chunk_budget=64, speculation=speculation)
        requests = [Request(i, 0.0, 60, 40) for i in range(6)]
        finished_ids = drive(scheduler, requests, execute=acceptance_executor([0, 4, 2, 1]))
        check_outcome(scheduler, requests, finished_ids)
        assert sum(r.num_preemptions for r in requests) > 0
        trials, accepts = (speculation.acceptance.position_trials,
                           speculation.acceptance.position_accepts)
        assert 0 < accepts[0] < trials[0] and accepts[3] > 0


# ---------------------------------------------------------------- the simulator's side

import json  # noqa: E402  (the simulator's tests below need these; the policies' do not)
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from omegaconf import open_dict  # noqa: E402

from policies.types import StepPlan  # noqa: E402
from sim.cost.roofline import RooflineCostModel  # noqa: E402
from sim.core.executor import SimExecutor  # noqa: E402
from sim.core.experiment import run_experiment  # noqa: E402
from sim.core.acceptance import AcceptanceModel  # noqa: E402

from factories import (hardware_spec, make_cfg, model_spec,  # noqa: E402
                       summary_without_wall_time)

# The simulator's runs below: 120 requests at 4 per second.
SMALL_RUN = ("workload.num_requests=120", "workload.rate=4")


def truncated_geometric_pmf(probabilities: list[float], k: int) -> np.ndarray:
    """P(exactly j of k drafts accepted), j = 0..k, for conditional position probabilities."""
    pmf, all_accepted = [], 1.0
    for j in range(k + 1):
        reject_next = 1.0 - probabilities[j] if j < k else 1.0
        pmf.append(all_accepted * reject_next)
        if j < k:
            all_accepted *= probabilities[j]
    return np.asarray(pmf)


@pytest.mark.parametrize("probabilities", [[0.7], [0.9, 0.6, 0.3], [1.0, 0.0]])
def test_acceptance_draws_follow_the_position_probabilities(probabilities):
    """Counts are drawn (not the mean): their histogram matches the exact distribution."""
    model = AcceptanceModel(probabilities, seed=1)
    k, num_draws = 4, 40_000
    per_position = model.probabilities(k).tolist()
    draws = np.asarray(model.draw({seq_id: k for seq_id in range(num_draws)}))
    frequencies = np.bincount(draws, minlength=k + 1) / num_draws
    pmf = truncated_geometric_pmf(per_position, k)
    # Five standard errors of a frequency: never fails by chance in practice, catches any bias.
    assert np.all(np.abs(frequencies - pmf) <= 5 * np.sqrt(pmf * (1 - pmf) / num_draws) + 1e-12)
    assert draws.mean() == pytest.approx(model.mean_accepted(k), abs=0.03)


@settings(max_examples=50, deadline=None)
@given(probabilities=st.lists(st.floats(0, 1), min_size=1, max_size=6),
       spec_lens=st.lists(st.integers(1, 9), max_size=40), seed=st.integers(0, 2 ** 32))
def test_acceptance_draws_stay_within_each_k_and_repeat_with_the_seed(probabilities, spec_lens,
                                                                     seed):
    for runs in (None, probabilities):
        for shifts in (None, [-1.5, 0.3, 2.0]):   # sequences alike, or each with its own rates
            model = AcceptanceModel(probabilities, seed, run_probabilities=runs,
                                    sequence_shifts=shifts)
            draws = model.draw(dict(enumerate(spec_lens)))
            assert len(draws) == len(spec_lens)
            assert all(0 <= accepted <= k for accepted, k in zip(draws, spec_lens))
            again = AcceptanceModel(probabilities, seed, run_probabilities=runs,
                                    sequence_shifts=shifts)
            assert draws == again.draw(dict(enumerate(spec_lens)))
            if probabilities[0] == 0.0:
                assert not any(draws)


def test_runs_accept_what_is_left_of_each_run():
    """Runs of exactly 2 acceptable positions (fresh rates 1, 1, 0): k = 1 accepts 1 and its
    bonus token ends the run, so the next step meets the rejected position; k = 2 takes the
    whole run and the bonus is the rejected position; k = 3 stops at it."""
    def steps(k, num_steps=6):
        model = AcceptanceModel([0.5], seed=0, run_probabilities=[1.0, 1.0, 0.0])
        return [model.draw({7: k})[0] for _ in range(num_steps)]
    assert steps(1) == [1, 0, 1, 0, 1, 0]
    assert steps(2) == [2] * 6
    assert steps(3) == [2] * 6
    # Sequences keep their own place in their runs.
    model = AcceptanceModel([0.5], seed=0, run_probabilities=[1.0, 1.0, 0.0])
    assert model.draw({1: 1, 2: 3}) == [1, 2] and model.draw({1: 1, 2: 1}) == [0, 1]


def test_runs_of_a_constant_rate_are_independent_draws():
    """A renewal process whose every position is accepted with p is i.i.d. acceptance: per step
    the counts follow the truncated geometric law whatever the state."""
    p, k, num_steps = 0.7, 4, 30_000
    model = AcceptanceModel([p], seed=3, run_probabilities=[p])
    draws = np.asarray([model.draw({0: k})[0] for _ in range(num_steps)])
    frequencies = np.bincount(draws, minlength=k + 1) / num_steps
    pmf = truncated_geometric_pmf([p] * k, k)
    assert np.all(np.abs(frequencies - pmf) <= 5 * np.sqrt(pmf * (1 - pmf) / num_steps))


def test_fresh_counts_are_the_steps_after_a_rejection(tmp_path):
    counts = AcceptanceCounts(3)
    counts.record([3, 3, 2], [1, 3, 0], fresh=[True, False, True])
    assert counts.position_trials == [3, 2, 1] and counts.position_accepts == [2, 1, 1]
    assert counts.fresh_position_trials == [2, 1, 0]
    assert counts.fresh_position_accepts == [1, 0, 0]
    path = write_statistics(tmp_path / "acc.json", **counts.to_statistics("d", "t", "test"))
    model = AcceptanceModel.from_file(path)
    assert model.run_probabilities == pytest.approx([0.5, 0.0])
    # Files without the fresh counts (older ones) draw independently per step.
    assert AcceptanceModel.from_file(write_statistics(
        tmp_path / "old.json", num_speculative_tokens=1, position_trials=[4],
        position_accepts=[3])).run_probabilities is None


BASE_FRESH_RATES = np.array([0.9, 0.8, 0.75, 0.7, 0.7, 0.7, 0.7, 0.7])


def heterogeneous_sequences(spread: float, num_sequences: int, num_runs: int, seed: int):
    """(fresh trials, fresh accepts, tail trials, tail accepts) of sequences that each walk
    num_runs runs with the base rates' log-odds shifted by their own z ~ N(0, spread^2): a
    run's first 8 positions are its fresh step's, what follows is at the last rate."""
    rng = np.random.default_rng(seed)
    sequences = []
    for _ in range(num_sequences):
        log_odds = np.log(BASE_FRESH_RATES / (1 - BASE_FRESH_RATES)) + rng.normal(0, spread)
        rates = 1 / (1 + np.exp(-log_odds))
        trials, accepts = np.zeros(8), np.zeros(8)
        tail_trials = tail_accepts = 0
        for _ in range(num_runs):
            position = 0
            while True:
                rate = rates[min(position, 7)]
                if position < 8:
                    trials[position] += 1
                else:
                    tail_trials += 1
                if rng.random() >= rate:
                    break
                if position < 8:
                    accepts[position] += 1
                else:
                    tail_accepts += 1
                position += 1
        sequences.append((trials, accepts, tail_trials, tail_accepts))
    return sequences


@pytest.mark.parametrize("spread", [0.0, 1.0])
def test_sequence_shifts_are_recovered_from_per_sequence_counts(spread):
    """The spread, the rates of a sequence with no shift (not the pooled ones: sequences that
    reject often weigh more in those) and each sequence's own shift come back from simulated
    counts."""
    from sim.core.acceptance import fit_sequence_shifts
    sequences = heterogeneous_sequences(spread, 60, 40, seed=2)
    shifts, rates, fitted = fit_sequence_shifts(sequences)
    assert fitted == pytest.approx(spread, abs=0.3)
    assert rates == pytest.approx(BASE_FRESH_RATES.tolist(), abs=0.06)
    assert len(shifts) == 60 and np.std(shifts) <= spread + 0.1
    if spread:   # the sequences that accepted more got the larger shifts
        acceptance = [accepts.sum() / trials.sum() for trials, accepts, _, _ in sequences]
        assert np.corrcoef(shifts, acceptance)[0, 1] > 0.8
    assert fit_sequence_shifts(heterogeneous_sequences(spread, 1, 40, seed=2))[0] == []


def test_sequence_shifts_make_some_sequences_accept_more_than_others(tmp_path):
    """With shifts each sequence keeps its own rates: the per-sequence means vary far more than
    draws that treat every sequence alike, around a similar overall mean; a statistics file with
    `sequences` fits the shifts, and a bad entry is named."""
    runs = BASE_FRESH_RATES.tolist()
    means = {}
    shifts = np.random.default_rng(0).normal(0, 1.0, 40).tolist()
    for name, sequence_shifts in (("alike", None), ("shifted", shifts)):
        model = AcceptanceModel([0.8], seed=4, run_probabilities=runs,
                                sequence_shifts=sequence_shifts)
        per_seq = np.array([[model.draw({seq_id: 4})[0] for _ in range(60)]
                            for seq_id in range(150)])
        means[name] = per_seq.mean(axis=1)
        assert model.reseeded(5).sequence_shifts == (sequence_shifts or [])
    assert means["shifted"].var() > 3 * means["alike"].var()
    assert means["shifted"].mean() == pytest.approx(means["alike"].mean(), rel=0.15)

    # Spread over every step: the tail's counts go with the last position's.
    sequences = [{"fresh_position_trials": trials.tolist(),
                  "fresh_position_accepts": accepts.tolist(),
                  "position_trials": (trials + np.eye(8)[7] * tail_trials).tolist(),
                  "position_accepts": (accepts + np.eye(8)[7] * tail_accepts).tolist()}
                 for trials, accepts, tail_trials, tail_accepts
                 in heterogeneous_sequences(1.0, 40, 40, seed=3)]
    fields = dict(num_speculative_tokens=8, position_trials=[10] * 8, position_accepts=[8] * 8,
                  fresh_position_trials=[10] * 8, fresh_position_accepts=[8] * 8)
    model = AcceptanceModel.from_file(write_statistics(tmp_path / "s.json", **fields,
                                                       sequences=sequences))
    assert len(model.sequence_shifts) == 40 and 0.5 <= np.std(model.sequence_shifts) <= 1.6
    assert AcceptanceModel.from_file(write_statistics(tmp_path / "n.json", **fields)
                                     ).sequence_shifts == []
    sequences[1] = {"fresh_position_trials": [1] * 8}
    with pytest.raises(ValueError, match=r"sequences\[1\]"):
        AcceptanceModel.from_file(write_statistics(tmp_path / "b.json", **fields,
                                                   sequences=sequences))
    with pytest.raises(ValueError, match="shifts"):
        AcceptanceModel([0.8], sequence_shifts=[0.1, float("nan")])


def write_statistics(path: Path, **fields) -> Path:
    path.write_text(json.dumps(fields))
    return path


def test_acceptance_model_reads_the_engine_statistics(tmp_path):
    counts = AcceptanceCounts(4)
    counts.record([4, 4, 4, 4, 2], [4, 2, 0, 1, 2])
    path = write_statistics(tmp_path / "acc.json",
                            **counts.to_statistics("ngram", "tiny-llama", "unit test"))
    model = AcceptanceModel.from_file(path)
    # Position 3 is examined by the two k = 4 sequences that accepted 2 or more, one passes.
    assert model.position_probabilities == pytest.approx([4 / 5, 3 / 4, 1 / 2, 1.0])
    assert model.probabilities(6).tolist() == pytest.approx([0.8, 0.75, 0.5, 1.0, 1.0, 1.0])
    assert "ngram" in model.source
    # A position never examined takes the last measured probability.
    path = write_statistics(tmp_path / "short.json", num_speculative_tokens=3,
                            position_trials=[10, 5, 0], position_accepts=[5, 2, 0])
    assert AcceptanceModel.from_file(path).probabilities(3).tolist() == pytest.approx(
        [0.5, 0.4, 0.4])


@pytest.mark.parametrize("fields, message", [
    (dict(num_speculative_tokens=2, position_trials=[4, 2]), r"missing key\(s\) \['position_accepts'\]"),
    (dict(num_speculative_tokens=2, position_trials=[4, 2], position_accepts=[4, 3]),
     r"position_accepts\[2\] / position_trials\[2\] must be a probability in \[0, 1\], got 1.5"),
    (dict(num_speculative_tokens=2, position_trials=[4], position_accepts=[4, 3]),
     "position_trials must be a list of 2 non-negative counts"),
    (dict(num_speculative_tokens=1, position_trials=[0], position_accepts=[0]),
     "position 1 was never examined"),
    (dict(num_speculative_tokens=0, position_trials=[], position_accepts=[]),
     "num_speculative_tokens must be a positive integer, got 0"),
])
def test_bad_statistics_files_are_one_clear_error(tmp_path, fields, message):
    path = write_statistics(tmp_path / "bad.json", **fields)
    with pytest.raises(ValueError, match=message):
        AcceptanceModel.from_file(path)


def test_acceptance_model_errors():
    with pytest.raises(ValueError, match="speculation.acceptance_rate must be a probability in "
                                         r"\[0, 1\], got 1.5"):
        AcceptanceModel.iid(1.5)
    with pytest.raises(ValueError, match="no such file"):
        AcceptanceModel.from_file("/nonexistent/acc.json")


def spec_plan(num_seqs: int, context_len: int, k: int) -> StepPlan:
    """A decode step of `num_seqs` sequences at `context_len`, each with k drafts."""
    plan = StepPlan(num_decode_seqs=num_seqs, decode_context_tokens=num_seqs * context_len)
    plan.add_drafts({seq_id: k for seq_id in range(num_seqs)} if k else {})
    return plan


def test_sim_executor_draws_acceptances_for_speculating_plans():
    cost_model = RooflineCostModel(model_spec("llama-2-7b"), hardware_spec("a100-80gb"))
    executor = SimExecutor(cost_model, AcceptanceModel.iid(0.5, seed=0))
    plan = spec_plan(3, 100, 4)
    result = executor.execute(plan)
    assert set(result.num_accepted) == {0, 1, 2}
    assert all(0 <= accepted <= 4 for accepted in result.num_accepted.values())
    assert executor.execute(spec_plan(3, 100, 0)).num_accepted is None
    with pytest.raises(ValueError, match="no acceptance model"):
        SimExecutor(cost_model).execute(plan)


def test_verification_is_nearly_free_while_memory_bound_and_not_once_compute_bound():
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    cost = RooflineCostModel(model, hardware, draft_model="ngram", ngram_overhead_s_per_seq=0.0)
    small_plain, small_spec = cost.step_time(spec_plan(1, 512, 0)), cost.step_time(spec_plan(1, 512, 4))
    assert small_plain < small_spec < 1.05 * small_plain
    # 256 x 5 verification tokens: the linear layers are compute-bound, ~5x the decode's work.
    big_plain, big_spec = cost.step_time(spec_plan(256, 32, 0)), cost.step_time(spec_plan(256, 32, 4))
    assert big_spec > 3 * big_plain
    # Draft attention: 4 more queries per sequence over its context, not 4 more contexts read.
    long_plain = cost.step_time(spec_plan(8, 4000, 0))
    assert cost.step_time(spec_plan(8, 4000, 4)) < 1.2 * long_plain


def test_draft_cost_is_sequential_draft_model_steps_or_an_ngram_lookup():
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    draft = model_spec("llama-68m")
    no_draft_cost = RooflineCostModel(model, hardware)
    with_draft = RooflineCostModel(model, hardware, draft_model=draft)
    draft_alone = RooflineCostModel(draft, hardware,
                                    step_overhead_s=with_draft.drafting.draft_step_overhead_s,
                                    per_sequence_overhead_s=0.0)
    for k in (1, 2, 5):
        plan = spec_plan(16, 300, k)
        draft_time = with_draft.step_time(plan) - no_draft_cost.step_time(plan)
        assert draft_time == pytest.approx(k * draft_alone.step_time(spec_plan(16, 300, 0)))
    ngram = RooflineCostModel(model, hardware, draft_model="ngram", ngram_overhead_s_per_seq=1e-4)
    plan = spec_plan(16, 300, 3)
    assert ngram.step_time(plan) - no_draft_cost.step_time(plan) == pytest.approx(16 * 1e-4)
    with pytest.raises(ValueError, match="draft_model must be 'ngram', 'medusa', 'lookahead', "
                                         "a model spec or null, got 'gpt-5'"):
        RooflineCostModel(model, hardware, draft_model="gpt-5")


def test_speculation_none_is_the_run_without_speculation():
    cfg = make_cfg(*SMALL_RUN)
    plain = run_experiment(cfg)
    with open_dict(cfg):
        del cfg["speculation"]
    assert summary_without_wall_time(run_experiment(cfg)) == summary_without_wall_time(plain)
    assert summary_without_wall_time(
        run_experiment(make_cfg(*SMALL_RUN, "speculation=fixed",
                                "speculation.num_speculative_tokens=0"))
    ) == summary_without_wall_time(plain)
    assert plain.summary["num_draft_tokens"] == 0 and plain.summary["spec_acceptance_rate"] == 0.0
    assert plain.summary["mean_tokens_per_decode_step"] == 1.0


def test_fixed_speculation_in_the_simulator(tmp_path):
    plain = run_experiment(make_cfg(*SMALL_RUN)).summary
    result = run_experiment(make_cfg(*SMALL_RUN, "speculation=fixed",
                                     "speculation.acceptance_rate=0.7"), tmp_path)
    summary = result.summary
    assert summary["completed"] == 120
    # k = 4 at 0.7: 0.7 + 0.49 + 0.343 + 0.2401 = 1.77 accepted of 4 (a few k are capped near
    # the end of an output).
    assert summary["spec_acceptance_rate"] == pytest.approx(1.7731 / 4, abs=0.03)
    assert summary["mean_tokens_per_decode_step"] == pytest.approx(2.77, abs=0.1)
    assert summary["mean_tpot_ms"] < 0.6 * plain["mean_tpot_ms"]
    assert summary["total_output_tokens"] == plain["total_output_tokens"]
    steps = np.genfromtxt(tmp_path / "steps.csv", delimiter=",", names=True)
    assert steps["num_draft_tokens"].sum() == summary["num_draft_tokens"]
    assert steps["num_accepted_tokens"].sum() == summary["num_accepted_tokens"]
    assert np.all(steps["num_accepted_tokens"] <= steps["num_draft_tokens"])
    assert summary_without_wall_time(result) == summary_without_wall_time(
        run_experiment(make_cfg(*SMALL_RUN, "speculation=fixed",
                                "speculation.acceptance_rate=0.7")))


def test_adaptive_speculation_and_a_measured_profile_in_the_simulator(tmp_path):
    counts = AcceptanceCounts(3)
    counts.record([3] * 10, [3, 3, 2, 3, 1, 3, 3, 0, 3, 2])
    path = write_statistics(tmp_path / "acc.json",
                            **counts.to_statistics("llama-68m", "llama-2-7b", "unit test"))
    summary = run_experiment(make_cfg(*SMALL_RUN, "speculation=adaptive",
                                      "speculation.draft_model=llama-68m",
                                      f"speculation.acceptance_profile={path}")).summary
    assert summary["completed"] == 120 and summary["num_draft_tokens"] > 0
    assert summary["mean_tokens_per_decode_step"] > 2.0


class HalfOfMax(FixedSpeculation):
    """A user's own speculation policy, plugged in by `speculation._target_`."""

    def num_speculative_tokens(self, num_decodes):
        return self.max_num_speculative_tokens // 2


def test_a_users_speculation_policy_plugs_in():
    summary = run_experiment(make_cfg(
        *SMALL_RUN, "speculation=fixed",
        "speculation._target_=test_speculation_policies.HalfOfMax",
        "speculation.num_speculative_tokens=2")).summary
    # k = 1 every step: acceptance is the i.i.d. rate itself.
    assert summary["spec_acceptance_rate"] == pytest.approx(0.7, abs=0.05)


@pytest.mark.parametrize("overrides, message", [
    (["speculation.draft_model=gpt-5"], "speculation.draft_model must be ngram, medusa, "
                                        "lookahead or a conf/model name .* got 'gpt-5'"),
    (["speculation.acceptance_rate=1.5"], r"speculation.acceptance_rate must be a probability in "
                                          r"\[0, 1\], got 1.5"),
    (["speculation.acceptance_rate=null"], "speculation.acceptance_rate .* or "
                                           "speculation.acceptance_profile .* is required"),
    (["speculation.num_speculative_tokens=-2"], "speculation.num_speculative_tokens must be a "
                                                "non-negative integer, got -2"),
    (["speculation._target_=nowhere.Policy"], "speculation._target_=nowhere.Policy"),
])
def test_bad_speculation_config_is_one_clear_error(overrides, message):
    with pytest.raises(ValueError, match=message):
        run_experiment(make_cfg(*SMALL_RUN, "speculation=fixed", *overrides))


def test_a_profile_from_before_speculation_still_loads(tmp_path, caplog):
    """Its draft features cost 0, and the log says so; the fitted ones predict as before."""
    from sim.cost.profiled.cost_model import ProfiledCostModel
    from sim.cost.profiled.step_features import STEP_FEATURES
    old_features = [name for name in STEP_FEATURES
                    if name not in ("num_draft_tokens", "speculating", "draft_model_steps")]
    coefficients = {name: 0.0 for name in old_features} | {"num_decode_seqs": 1e-3}
    path = tmp_path / "old.json"
    path.write_text(json.dumps({
        "schema": 1, "metadata": {}, "features": old_features,
        "model": {"kind": "linear", "intercept_s": 1e-3, "coefficients_s": coefficients},
        "residuals": {"kind": "relative", "samples": []}, "feature_ranges": {}}))
    with caplog.at_level("WARNING"):
        cost_model = ProfiledCostModel(str(path), draft_model="ngram")
    assert "num_draft_tokens" in caplog.text and "draft_model_steps" in caplog.text
    assert cost_model.step_time(spec_plan(4, 100, 3)) == pytest.approx(1e-3 + 4e-3)
    assert cost_model.step_time(spec_plan(4, 100, 0)) == pytest.approx(1e-3 + 4e-3)
