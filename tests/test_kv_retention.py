"""Tests for the KV retention policies (policies/memory/retention.py, conf/kv_retention): what a
session's finished turn keeps between turns (evict, pin, offload), their blocks in the paged KV
manager (policies/memory/retained.py) and the session summary (runtime/metrics/session_kv.py)."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from factories import make_cfg
from policies.batching import ChunkedPrefillScheduler, ContinuousBatchingScheduler
from policies.memory import PagedBlockManager
from policies.memory.retention import Evict, Offload, Pin
from policies.preemption import RecomputePreemption
from policies.types import Request, StepResult
from sim.core.experiment import run_experiment
from runtime.metrics.session_kv import held_blocks_over_time
from sim.core.workload import build_workload

BLOCK = 4


def make_scheduler(retention_kind: str, num_blocks: int = 20, ttl_s: float = 100.0,
                   num_offload_blocks: int = 0, scheduler_class=ContinuousBatchingScheduler):
    kv_cache = PagedBlockManager(num_blocks, BLOCK, watermark=0.0, enable_prefix_caching=True,
                                 num_offload_blocks=num_offload_blocks)
    retention = {"evict": lambda: None, "pin": lambda: Pin(kv_cache, ttl_s=ttl_s),
                 "offload": lambda: Offload(kv_cache)}[retention_kind]()
    return scheduler_class(kv_cache, RecomputePreemption(), max_num_seqs=8,
                           max_num_batched_tokens=512, max_model_len=512,
                           kv_retention=retention)


class Driver:
    """Steps a scheduler on a simulated clock (each step 0.01 s), checking the KV manager after
    every step; records every plan and each finished request."""

    def __init__(self, scheduler):
        self.scheduler, self.now, self.plans, self.finished = scheduler, 0.0, [], []

    def step(self):
        plan = self.scheduler.schedule(self.now)
        self.plans.append(plan)
        self.now += 0.01
        self.finished += self.scheduler.update(plan, StepResult(duration=0.01), self.now)
        kv_cache = self.scheduler.kv_cache
        kv_cache.check_invariants()
        assert kv_cache.num_used_blocks() <= kv_cache.num_blocks
        return plan

    def serve(self, request: Request):
        """Queue `request` now and step until it finished."""
        self.scheduler.add_request(request, self.now)
        assert request.rejected_reason is None, request.rejected_reason
        for _ in range(1000):
            if request.finish_time is not None:
                return request
            self.step()
        raise AssertionError("the request never finished")


def request(request_id, token_ids, session=None, turn=0, output_len=2):
    return Request(request_id, 0.0, len(token_ids), output_len, prompt_token_ids=list(token_ids),
                   session_id=session, turn=turn)


def serve_session_around_other_traffic(kind: str, **kwargs):
    """Session 0's turn (8 blocks of prompt), two requests of other traffic of the same size,
    then the session's next turn: under evict the second one evicts the session's blocks (the
    least recently freed), under pin it evicts the first one's."""
    driver = Driver(make_scheduler(kind, **kwargs))
    first = list(range(1000, 1032))
    driver.serve(request(0, first, session=0))
    driver.serve(request(1, range(2000, 2032)))
    driver.serve(request(2, range(3000, 3032)))
    follow_up = driver.serve(request(3, first + list(range(4000, 4008)), session=0, turn=1))
    return driver, follow_up


def test_pin_keeps_the_context_that_other_traffic_evicts_under_evict():
    _, under_evict = serve_session_around_other_traffic("evict")
    driver, under_pin = serve_session_around_other_traffic("pin")
    assert under_evict.num_cached_tokens == 12   # 3 of its 8 blocks survived the LRU
    assert under_pin.num_cached_tokens == 32     # its whole previous prompt
    # Released at the follow-up's admission: only the follow-up's own pin is left.
    retention = driver.scheduler.kv_retention
    assert sum(change for _, change in retention.held_blocks_log()) == 10
    assert driver.scheduler.kv_cache.num_retained_blocks() == 10


def test_a_pin_expires_after_its_ttl_while_the_session_is_idle():
    driver = Driver(make_scheduler("pin", ttl_s=1.0))
    driver.serve(request(0, range(32), session=0))
    kv_cache = driver.scheduler.kv_cache
    assert kv_cache.num_retained_blocks() == 8 and kv_cache.num_used_blocks() == 8
    driver.now += 0.5
    driver.serve(request(1, range(100, 104)))   # a step before the deadline: still pinned
    assert kv_cache.num_retained_blocks() == 8
    driver.now += 1.0
    driver.serve(request(2, range(200, 204)))
    assert kv_cache.num_retained_blocks() == 0 and kv_cache.num_used_blocks() == 0
    log = driver.scheduler.kv_retention.held_blocks_log()
    assert log[-1] == (pytest.approx(log[0][0] + 1.0), -8)   # released at its deadline


def test_a_pin_is_kept_past_its_ttl_once_the_next_turn_waits():
    scheduler = make_scheduler("pin", num_blocks=20, ttl_s=0.02)
    driver = Driver(scheduler)
    prompt = list(range(32))
    driver.serve(request(0, prompt, session=0))
    blocker = request(1, range(500, 540), output_len=8)   # 10 blocks, 12 after 8 steps
    scheduler.add_request(blocker, driver.now)
    driver.step()
    # The next turn arrives within the ttl but cannot be admitted (20 - 8 - 10 < 3 blocks)
    # until the blocker finishes, well past the ttl.
    follow_up = request(2, prompt + list(range(600, 612)), session=0, turn=1)
    scheduler.add_request(follow_up, driver.now)
    for _ in range(5):
        driver.step()
    assert follow_up.first_scheduled_time is None and scheduler.kv_cache.num_retained_blocks() == 8
    while follow_up.finish_time is None:
        driver.step()
    assert follow_up.num_cached_tokens == 32


def test_offload_moves_a_finished_turn_to_the_host_tier_and_loads_it_back():
    driver = Driver(make_scheduler("offload", num_offload_blocks=16))
    prompt = list(range(32))
    driver.serve(request(0, prompt, session=0))
    kv_cache = driver.scheduler.kv_cache
    assert kv_cache.num_offloaded_blocks() == 8 and kv_cache.num_free_blocks() == 20
    assert not kv_cache._evictable_block_ids   # nothing of it left cached on the device
    follow_up = driver.serve(request(1, prompt + list(range(100, 108)), session=0, turn=1))
    stores = [pair for plan in driver.plans for pair in plan.blocks_to_offload]
    loads = [pair for plan in driver.plans for pair in plan.blocks_to_load]
    assert len(stores) == 8 and len(loads) == 8
    assert follow_up.num_cached_tokens == follow_up.num_host_cached_tokens == 32


def test_a_request_without_a_session_is_freed_as_under_evict():
    for kind, offload in (("pin", 0), ("offload", 16)):
        driver = Driver(make_scheduler(kind, num_offload_blocks=offload))
        driver.serve(request(0, range(32)))
        kv_cache = driver.scheduler.kv_cache
        assert kv_cache.num_retained_blocks() == 0 and kv_cache.num_offloaded_blocks() == 0
        assert len(kv_cache._evictable_block_ids) == 8


def conversation_requests(seed: int, num_sessions: int) -> list[Request]:
    return build_workload({
        "kind": "conversation", "num_sessions": num_sessions, "rate": 20.0,
        "turns": {"dist": "uniform", "low": 1, "high": 4},
        "think_time_s": {"dist": "exponential", "mean": 0.2},
        "message_len": {"dist": "uniform", "low": 2, "high": 30},
        "output_len": {"dist": "uniform", "low": 1, "high": 8},
        "max_prompt_len": 120, "shared_prefix_len": 8}, seed=seed, vocab_size=50)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(40, 200),
       ttl_s=st.sampled_from([0.0, 0.05, 0.3, 5.0]), kind=st.sampled_from(["pin", "offload"]),
       chunked=st.booleans())
def test_retention_invariants(seed, num_blocks, ttl_s, kind, chunked):
    """Every step: the KV manager's bookkeeping recounts, memory within the pool; every request
    finishes once; once every pin has expired, no block is held."""
    requests = conversation_requests(seed, 8)
    scheduler = make_scheduler(kind, num_blocks=num_blocks, ttl_s=ttl_s, num_offload_blocks=12,
                               scheduler_class=(ChunkedPrefillScheduler if chunked
                                                else ContinuousBatchingScheduler))
    driver = Driver(scheduler)
    pending = sorted(requests, key=lambda r: r.arrival_time)
    for _ in range(20_000):
        while pending and pending[0].arrival_time <= driver.now:
            scheduler.add_request(pending.pop(0), driver.now)
        if scheduler.has_unfinished():
            driver.step()
        elif pending:
            driver.now = pending[0].arrival_time
        else:
            break
    done = [r.request_id for r in driver.finished]
    assert sorted(done) == sorted(r.request_id for r in requests if r.rejected_reason is None)
    scheduler.kv_retention.expire(math.inf)
    kv_cache = scheduler.kv_cache
    kv_cache.check_invariants()
    assert kv_cache.num_retained_blocks() == 0 and kv_cache.num_used_blocks() == 0
    assert sum(change for _, change in scheduler.kv_retention.held_blocks_log()) == 0


CONVERSATION = ["workload=conversation", "workload.num_sessions=40", "workload.rate=2",
                "++workload.think_time_s={dist: lognormal, mean: 2.0, sigma: 0.5}",
                "kv_cache.enable_prefix_caching=true", "kv_cache.num_blocks=600"]


@pytest.mark.parametrize("retention", [["kv_retention=pin", "kv_retention.ttl_s=1.5"],
                                       ["kv_retention=offload", "kv_cache.offload_gb=4"]])
def test_repeated_steps_come_out_as_steps_one_by_one(retention):
    repeated = run_experiment(make_cfg(*CONVERSATION, *retention), plots=False)
    one_by_one = run_experiment(make_cfg(*CONVERSATION, *retention, "backend.repeated_steps=false"),
                                plots=False)
    drop = ("wall_time_s", "sim_speedup")
    assert ({k: v for k, v in repeated.summary.items() if k not in drop}
            == {k: v for k, v in one_by_one.summary.items() if k not in drop})
    assert repeated.metrics.step_rows == one_by_one.metrics.step_rows


def test_the_summary_splits_first_and_follow_up_turns():
    evict = run_experiment(make_cfg(*CONVERSATION), plots=False).summary
    pin = run_experiment(make_cfg(*CONVERSATION, "kv_retention=pin"), plots=False).summary
    assert evict["prefix_cache_hit_rate_first_turn"] == 0.0   # no shared prefix
    assert evict["prefix_cache_hit_rate_followup_turn"] > 0.3
    assert evict["idle_session_blocks_max"] == evict["idle_session_blocks_mean"] == 0.0
    assert 0 < pin["idle_session_blocks_mean"] < pin["idle_session_blocks_max"] <= 600
    assert evict["num_followup_turns"] == pin["num_followup_turns"] > 0
    assert evict["mean_ttft_followup_turn_ms"] > 0 and evict["mean_ttft_first_turn_ms"] > 0
    plain = run_experiment(make_cfg("workload.num_requests=20"), plots=False).summary
    assert "idle_session_blocks_mean" not in plain and "mean_ttft_first_turn_ms" not in plain


def test_held_blocks_over_time_against_a_step_function():
    # Level 0 until 1, 5 until 3 (2 more pinned and 2 released at 2 count together), then 2.
    logs = [[(1.0, 5), (2.0, 2), (3.0, -3)], [(2.0, -2)]]
    mean, peak = held_blocks_over_time(logs, 0.0, 4.0)
    assert mean == pytest.approx((5 * 2 + 2 * 1) / 4) and peak == 5.0
    assert held_blocks_over_time([], 0.0, 1.0) == (0.0, 0.0)


@pytest.mark.parametrize("overrides, message", [
    (["kv_retention=pin"], "kv_retention=pin needs kv_cache.enable_prefix_caching=true"),
    (["kv_retention=offload", "kv_cache.enable_prefix_caching=true"],
     "kv_retention=offload needs kv_cache.offload_gb > 0"),
    (["kv_retention=pin", "kv_cache=contiguous"], "ContiguousAllocator lacks enable_prefix_caching, retain"),
    (["kv_retention=pin", "kv_cache.enable_prefix_caching=true", "kv_retention.ttl_s=-1"],
     "kv_retention.ttl_s must be a number >= 0"),
    (["kv_retention=pin", "kv_cache.enable_prefix_caching=true",
      "kv_retention.max_pool_fraction=0"], "kv_retention.max_pool_fraction must be a number in"),
])
def test_bad_settings_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        run_experiment(make_cfg("workload.num_requests=5", *overrides), plots=False)


def test_evict_builds_no_retention_and_changes_nothing():
    base = ["workload=conversation", "workload.num_sessions=10",
            "kv_cache.enable_prefix_caching=true", "kv_cache.num_blocks=300"]
    plain = run_experiment(make_cfg(*base), plots=False)
    assert plain.replicas[0].scheduler.kv_retention is None
    assert isinstance(Evict(None), Evict) and not Evict.keeps_blocks


def test_the_engine_answers_the_same_under_every_retention():
    """backend=engine on the tiny Llama, greedy: 3 sessions of 3 turns, a minute apart (each turn finished before the next)."""
    overrides = ["backend=engine", "model=tiny-llama", "hardware=cpu", "workload=conversation",
                 "workload.num_sessions=3", "workload.rate=inf",
                 "++workload.turns={dist: fixed, value: 3}",
                 "++workload.think_time_s={dist: fixed, value: 60.0}",
                 "++workload.message_len={dist: uniform, low: 8, high: 24}",
                 "++workload.output_len={dist: uniform, low: 4, high: 8}",
                 "workload.max_prompt_len=512", "kv_cache.block_size=4",
                 "kv_cache.enable_prefix_caching=true", "kv_cache.offload_gb=0.01"]
    runs = {kind: run_experiment(make_cfg(*overrides, f"kv_retention={kind}"), plots=False)
            for kind in ("evict", "pin", "offload")}
    answers = {kind: [[s.output_token_ids for s in r.sequences] for r in run.requests]
               for kind, run in runs.items()}
    assert answers["pin"] == answers["evict"] == answers["offload"]
    assert all(len(a[0]) > 0 for a in answers["evict"])
    assert runs["pin"].summary["idle_session_blocks_max"] > 0
    assert runs["offload"].summary["offload_bytes"] > 0
    assert runs["offload"].summary["reload_bytes"] > 0
