"""Prefix-aware routing and the prefix cache's host tier: the router against stand-in replicas,
the tier under every scheduler on random multi-turn prompts (invariants every step), the cost
models' charge for the tier's stores and loads, and whole simulator runs on `workload=conversation`
(the router raises the hit rate over round robin; the tier raises it when the device cache is
small). The tier's block-level contents are checked in test_memory.py, the engine's real copies
in test_engine.py."""
from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from policies.memory import ContiguousAllocator, PagedBlockManager
from policies.routing import PrefixAffinityRouter
from policies.types import Request, StepPlan, StepResult
from sim.cost.profiled.cost_model import ProfiledCostModel
from sim.cost.profiled.step_features import STEP_FEATURES
from runtime.policy_config import config_names
from sim.core.experiment import run_experiment
from sim.cost.roofline import RooflineCostModel
from runtime.specs import GB
from runtime.kv_sizing import offload_seconds_per_block

from factories import (MAX_MODEL_LEN, build_scheduler, check_outcome, drive, hardware_spec,
                       make_cfg, make_seq, model_spec)


# ---------------------------------------------------------------- the router

class StandInReplica:
    """A replica as a router sees it: an id, a queue length and a KV manager."""

    def __init__(self, replica_id: int, num_outstanding: int, kv_cache):
        self.replica_id, self.num_outstanding, self.kv_cache = replica_id, num_outstanding, kv_cache


def cached_manager(*prompts: list[int]) -> PagedBlockManager:
    """A paged manager (blocks of 4) whose prefix cache holds these prompts, computed."""
    manager = PagedBlockManager(64, 4, watermark=0, enable_prefix_caching=True)
    for seq_id, token_ids in enumerate(prompts):
        seq = make_seq(seq_id, len(token_ids), prompt_token_ids=token_ids)
        assert manager.allocate_slots(seq, len(token_ids))
        seq.num_computed_tokens = len(token_ids)
    return manager


PROMPT = list(range(100, 130))


def route(router, replicas, token_ids=PROMPT) -> int:
    return router.route(Request(0, 0.0, len(token_ids), 8, prompt_token_ids=token_ids), replicas)


def test_num_cached_prefix_tokens_reads_the_hash_table():
    manager = cached_manager(PROMPT[:12], [7] * 20)
    assert manager.num_cached_prefix_tokens(PROMPT) == 12
    assert manager.num_cached_prefix_tokens(PROMPT[:12]) == 8       # one token left to compute
    assert manager.num_cached_prefix_tokens([1] + PROMPT) == 0
    assert manager.num_cached_prefix_tokens([]) == 0
    assert PagedBlockManager(8, 4).num_cached_prefix_tokens(PROMPT) == 0   # cache off
    assert ContiguousAllocator(8, 4, max_model_len=32).num_cached_prefix_tokens(PROMPT) == 0


def test_prefix_affinity_picks_the_longest_cached_prefix():
    replicas = [StandInReplica(0, 0, cached_manager()),
                StandInReplica(1, 3, cached_manager(PROMPT[:8])),
                StandInReplica(2, 2, cached_manager(PROMPT[:20]))]
    router = PrefixAffinityRouter()
    assert route(router, replicas) == 2
    # Nothing cached anywhere: the least loaded, ties to the lowest id.
    assert route(router, replicas, [9] * 30) == 0
    replicas[0].num_outstanding = 2
    assert route(router, replicas, [9] * 30) == 0


def test_prefix_affinity_load_bound_skips_a_flooded_replica():
    holder = StandInReplica(1, 0, cached_manager(PROMPT))
    idle = StandInReplica(0, 0, cached_manager())
    router = PrefixAffinityRouter(load_factor=2.0, load_slack=3)
    for load in (0, 1, 3):
        holder.num_outstanding = load
        assert route(router, [idle, holder]) == 1               # within 2 x 0 + 3
    holder.num_outstanding = 4
    assert route(router, [idle, holder]) == 0
    idle.num_outstanding = 1                                     # bound 2 x 1 + 3 = 5
    assert route(router, [idle, holder]) == 1


@pytest.mark.parametrize("kwargs, message", [
    (dict(load_factor=0.5), r"cluster\.router\.load_factor must be a number in \[1, inf\)"),
    (dict(load_slack=-1), "cluster.router.load_slack must be a non-negative integer"),
])
def test_prefix_affinity_rejects_bad_bounds(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrefixAffinityRouter(**kwargs)


# ---------------------------------------------------------------- every scheduler with the tier

SESSIONS = [list(range(1000 * s, 1000 * s + MAX_MODEL_LEN)) for s in range(4)]
turn_strategy = st.tuples(st.floats(0, 2, allow_nan=False),  # arrival
                          st.integers(0, 3),                   # session
                          st.integers(1, 90),                  # prompt_len
                          st.integers(1, 30),                  # output_len
                          st.sampled_from([1, 1, 2]))          # n


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scheduler_name=st.sampled_from(config_names("scheduler")),
       preemption_name=st.sampled_from(["recompute", "swap"]),
       block_size=st.sampled_from([1, 4, 16]), pool_slack=st.integers(0, 100),
       num_offload_blocks=st.integers(1, 40),
       turns=st.lists(turn_strategy, min_size=1, max_size=12))
def test_every_scheduler_keeps_its_invariants_with_a_host_tier(
        scheduler_name, preemption_name, block_size, pool_slack, num_offload_blocks, turns):
    """Prompts that are prefixes of four sessions' token streams, in pools small enough to evict
    and preempt: every request done once, no block or tier slot lost, the manager's invariants
    every step; every load reads a slot some store filled, and loaded tokens are cached ones."""
    num_blocks = math.ceil(MAX_MODEL_LEN / block_size) + pool_slack // block_size
    scheduler = build_scheduler(scheduler_name, "paged", preemption_name, block_size, num_blocks,
                                16, 8, 32, prefix_caching=True,
                                num_offload_blocks=num_offload_blocks)
    requests = [Request(i, arrival, prompt_len, output_len, n=n, priority=i % 3,
                        predicted_output_len=output_len,
                        prompt_token_ids=SESSIONS[session][:prompt_len])
                for i, (arrival, session, prompt_len, output_len, n) in enumerate(turns)]
    stored_slots: set[int] = set()

    def execute(plan: StepPlan) -> StepResult:
        assert len({slot for _, slot in plan.blocks_to_offload}) == len(plan.blocks_to_offload)
        stored_slots.update(slot for _, slot in plan.blocks_to_offload)
        assert all(slot in stored_slots for slot, _ in plan.blocks_to_load)
        loaded = {block for _, block in plan.blocks_to_load}
        assert len(loaded) == len(plan.blocks_to_load)
        tables = scheduler.kv_cache.block_tables
        assert loaded <= {block for seq in plan.seqs for block in tables[seq.seq_id]}
        return StepResult(0.01)

    finished_ids = drive(scheduler, requests, execute=execute)
    check_outcome(scheduler, requests, finished_ids)
    for request in requests:
        assert 0 <= request.num_host_cached_tokens <= request.num_cached_tokens
        assert request.num_host_cached_tokens % block_size == 0
    manager = scheduler.kv_cache
    assert manager.take_pending_offload() == ([], [])
    assert manager.num_offloaded_blocks() <= num_offload_blocks


def test_a_small_pool_with_a_tier_loads_hits_back():
    """The property test's setting does reach the tier: a session's later turns, after others
    pushed its blocks out of a small pool, are served from host memory."""
    scheduler = build_scheduler("continuous", "paged", "recompute", 4, 40, 0, 4, 128,
                                prefix_caching=True, num_offload_blocks=64)
    requests = [Request(i, 0.5 * i, 60 + 4 * (i // 4), 4,
                        prompt_token_ids=SESSIONS[i % 4][:60 + 4 * (i // 4)]) for i in range(12)]
    finished_ids = drive(scheduler, requests)
    check_outcome(scheduler, requests, finished_ids)
    assert sum(request.num_host_cached_tokens for request in requests) > 0


# ---------------------------------------------------------------- what the tier costs

def offload_plan(num_stores: int, num_loads: int) -> StepPlan:
    plan = StepPlan(blocks_to_offload=[(i, i) for i in range(num_stores)],
                    blocks_to_load=[(i, 10 + i) for i in range(num_loads)])
    plan.num_decode_seqs, plan.decode_context_tokens = 4, 4 * 300
    return plan


def linear_profile() -> dict:
    """A profile's content: every core feature at 10 us a unit, 2 ms a step."""
    return {"schema": 1, "features": list(STEP_FEATURES),
            "model": {"kind": "linear", "intercept_s": 2e-3,
                      "coefficients_s": {name: 1e-5 for name in STEP_FEATURES}}}


def test_both_cost_models_charge_the_tier_at_its_bandwidth():
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    per_block = 16 * model.kv_bytes_per_token / (8 * GB)
    assert offload_seconds_per_block(model, hardware, 16, bandwidth_gbps=8) == pytest.approx(
        per_block)
    assert offload_seconds_per_block(model, hardware, 16) == pytest.approx(
        16 * model.kv_bytes_per_token / (hardware.host_to_device_gbps * GB))
    roofline = RooflineCostModel(model, hardware, offload_bandwidth_gbps=8)
    profiled = ProfiledCostModel(linear_profile(), sample_residuals=False, model=model,
                                 hardware=hardware, block_size=16, offload_bandwidth_gbps=8)
    for cost_model in (roofline, profiled):
        without = cost_model.step_time(offload_plan(0, 0))
        assert cost_model.step_time(offload_plan(3, 2)) == pytest.approx(without + 5 * per_block)
    assert roofline.step_time(StepPlan(blocks_to_load=[(0, 0)])) == pytest.approx(
        roofline.step_overhead_s + per_block)
    with pytest.raises(ValueError, match="built without model, hardware and block_size"):
        ProfiledCostModel(linear_profile(), sample_residuals=False).step_time(
            offload_plan(1, 0))


# ---------------------------------------------------------------- whole runs

CONVERSATION = ("workload=conversation", "workload.num_sessions=40", "workload.rate=2",
                "kv_cache.enable_prefix_caching=true")


def test_prefix_affinity_raises_the_hit_rate_over_round_robin():
    hit_rates = {}
    for router in ("round_robin", "prefix_affinity"):
        summary = run_experiment(make_cfg(*CONVERSATION, "cluster.num_replicas=4",
                                          f"cluster.router={router}"), plots=False).summary
        assert summary["completed"] == summary["num_requests"]
        hit_rates[router] = summary["prefix_cache_hit_rate"]
    assert hit_rates["prefix_affinity"] > 1.5 * hit_rates["round_robin"] > 0


def test_the_host_tier_raises_hits_when_the_device_cache_is_small():
    small = ("kv_cache.num_blocks=200",)
    without = run_experiment(make_cfg(*CONVERSATION, *small), plots=False).summary
    tiered = run_experiment(make_cfg(*CONVERSATION, *small, "kv_cache.offload_gb=4"),
                            plots=False).summary
    assert without["prefix_cache_host_hit_rate"] == 0 and "offload_bytes" not in without
    assert tiered["prefix_cache_host_hit_rate"] > 0 and tiered["reload_bytes"] > 0
    assert tiered["prefix_cache_hit_rate"] > 2 * without["prefix_cache_hit_rate"]
    assert tiered["prefix_cache_hit_rate"] == pytest.approx(
        tiered["prefix_cache_device_hit_rate"] + tiered["prefix_cache_host_hit_rate"])
    # The loads took their time: the same run with a 1000x slower link takes longer.
    slow = run_experiment(make_cfg(*CONVERSATION, *small, "kv_cache.offload_gb=4",
                                   "kv_cache.offload_bandwidth_gbps=0.032"), plots=False).summary
    assert slow["mean_ttft_ms"] > tiered["mean_ttft_ms"]


@pytest.mark.parametrize("overrides, message", [
    (("kv_cache.offload_gb=1",), "needs kv_cache.enable_prefix_caching=true"),
    (("kv_cache.enable_prefix_caching=true", "kv_cache.offload_gb=-1"),
     "kv_cache.offload_gb must be a number >= 0"),
    (("kv_cache.enable_prefix_caching=true", "kv_cache.offload_gb=1",
      "kv_cache.offload_bandwidth_gbps=0"), "kv_cache.offload_bandwidth_gbps must be a positive"),
])
def test_bad_offload_settings_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        run_experiment(make_cfg("workload.num_requests=5", *overrides), plots=False)
