"""Tests for KV retention with agents (issue 32): what the scheduler does with the blocks a
`pin` keeps (policies/batching/base.py: a kept turn goes ahead of a head that cannot fit, and
releases idle sessions' pins to fit; a running request's growth releases pins before it is
preempted), the agent workload's `final_turn` that no policy keeps, and the kv_retention
preset's regime in small: pin and offload beat evict on follow-up TTFT in a tight pool, and a
long TTL costs first calls."""
from __future__ import annotations

import pytest

from factories import make_cfg
from policies.batching import ContinuousBatchingScheduler
from policies.memory import PagedBlockManager
from policies.memory.retention import Pin
from policies.preemption import RecomputePreemption
from sim.core.experiment import run_experiment
from sim.core.workload import build_session_source
from test_kv_retention import BLOCK, Driver, make_scheduler, request


def test_a_final_turn_is_not_kept():
    for kind, offload in (("pin", 0), ("offload", 16)):
        driver = Driver(make_scheduler(kind, num_offload_blocks=offload))
        final = request(0, range(32), session=0)
        final.final_turn = True
        driver.serve(final)
        kv_cache = driver.scheduler.kv_cache
        assert kv_cache.num_retained_blocks() == 0 and kv_cache.num_offloaded_blocks() == 0
        driver.serve(request(1, range(100, 132), session=1))   # not final: kept
        assert kv_cache.num_retained_blocks() + kv_cache.num_offloaded_blocks() == 8


def test_the_agent_workload_marks_each_sessions_last_call_final():
    source = build_session_source({
        "kind": "agent", "num_sessions": 12, "rate": 1.0,
        "steps": {"dist": "uniform", "low": 1, "high": 5},
        "prompt_len": {"dist": "uniform", "low": 8, "high": 40},
        "output_len": {"dist": "uniform", "low": 2, "high": 8},
        "tool_output_len": {"dist": "uniform", "low": 4, "high": 60},
        "tool_latency_s": {"dist": "exponential", "mean": 0.5},
        "max_prompt_len": 200}, seed=3, vocab_size=100)
    assert any(len(turns) > 1 for turns in source.sessions)
    for turns in source.sessions:
        assert [r.final_turn for r in turns] == [False] * (len(turns) - 1) + [True]
    # A chat user's last message is not known as such.
    chats = build_session_source({"kind": "sessions", "num_sessions": 5, "rate": 1.0,
                            "turns": {"dist": "fixed", "value": 3},
                            "think_time_s": {"dist": "fixed", "value": 1.0},
                            "message_len": {"dist": "fixed", "value": 10},
                            "output_len": {"dist": "fixed", "value": 4}},
                           seed=0, vocab_size=100)
    assert not any(r.final_turn for r in chats.all_requests())


def test_a_kept_turn_goes_ahead_of_a_head_that_cannot_fit():
    scheduler = make_scheduler("pin", num_blocks=30)
    driver = Driver(scheduler)
    prompt = list(range(32))
    driver.serve(request(0, prompt, session=0))          # 8 blocks pinned
    running = request(1, range(500, 508), output_len=20)  # 2 blocks, 7 at its end
    scheduler.add_request(running, driver.now)
    driver.step()
    head = request(2, range(600, 688))                    # 22 blocks: more than is free
    follow_up = request(3, prompt + list(range(700, 704)), session=0, turn=1)
    scheduler.add_request(head, driver.now)
    scheduler.add_request(follow_up, driver.now)
    driver.step()
    # Its context is on the device: only its new block is needed, which the head cannot use.
    assert follow_up.first_scheduled_time is not None and head.first_scheduled_time is None
    assert follow_up.num_cached_tokens == 32
    while head.finish_time is None:
        driver.step()
    assert running.num_preemptions == follow_up.num_preemptions == 0


def test_a_kept_turn_releases_an_idle_sessions_pin_to_fit():
    scheduler = make_scheduler("pin", num_blocks=24)
    driver = Driver(scheduler)
    waits_on_its_tool = list(range(32))
    returns = list(range(100, 132))
    driver.serve(request(0, waits_on_its_tool, session=0))   # 8 blocks pinned
    driver.serve(request(1, returns, session=1))             # 8 more
    running = request(2, range(500, 524), output_len=30)     # 6 blocks after its prefill
    scheduler.add_request(running, driver.now)
    driver.step()
    assert scheduler.kv_cache.num_free_blocks() == 2
    follow_up = request(3, returns + list(range(200, 216)), session=1, turn=1)   # 4 new blocks
    scheduler.add_request(follow_up, driver.now)
    driver.step()
    assert follow_up.first_scheduled_time is not None and follow_up.num_cached_tokens == 32
    # Session 0's pin went (its tool still runs); session 1's blocks are its turn's now.
    assert scheduler.kv_cache.num_retained_blocks() == 0
    assert running.num_preemptions == 0


def test_a_kept_turn_refused_its_seat_releases_no_pin():
    kv_cache = PagedBlockManager(40, BLOCK, watermark=0.0, enable_prefix_caching=True)
    scheduler = ContinuousBatchingScheduler(
        kv_cache, RecomputePreemption(), max_num_seqs=1, max_num_batched_tokens=512,
        max_model_len=512, kv_retention=Pin(kv_cache, ttl_s=100.0))
    driver = Driver(scheduler)
    returns = list(range(100, 132))
    driver.serve(request(0, range(32), session=0))
    driver.serve(request(1, returns, session=1))
    running = request(2, range(500, 508), output_len=10)    # the only seat
    scheduler.add_request(running, driver.now)
    driver.step()
    follow_up = request(3, returns + list(range(200, 204)), session=1, turn=1)
    scheduler.add_request(follow_up, driver.now)
    driver.step()
    assert follow_up.first_scheduled_time is None
    assert kv_cache.num_retained_blocks() == 16   # session 0's pin is no use to it: kept
    while follow_up.finish_time is None:
        driver.step()
    assert follow_up.num_cached_tokens == 32


def test_a_running_request_releases_a_pin_before_it_is_preempted():
    scheduler = make_scheduler("pin", num_blocks=14)
    driver = Driver(scheduler)
    driver.serve(request(0, range(32), session=0))           # 8 of 14 blocks pinned
    # 2 blocks at admission, 7 at its end: past the 6 left, with nothing else to preempt.
    running = driver.serve(request(1, range(500, 508), output_len=20))
    assert running.num_preemptions == 0
    assert scheduler.kv_cache.num_retained_blocks() == 0


# The preset's regime (conf/experiment/kv_retention.yaml) in small: 32 agents whose contexts
# (~2,000 tokens) need ~4,000 blocks, against a pool of 1,200.
AGENTS = ["cost_model=roofline", "workload=agent", "workload.num_sessions=64",
          "workload.concurrency=32", "kv_cache.enable_prefix_caching=true",
          "kv_cache.num_blocks=1200"]


@pytest.fixture(scope="module")
def agent_runs():
    return {case: run_experiment(make_cfg(*AGENTS, f"+kv_retention_case={case}"),
                                 plots=False).summary
            for case in ("evict", "pin_short", "pin_long", "offload")}


def test_pin_and_offload_beat_evict_on_follow_up_calls_in_a_tight_pool(agent_runs):
    evict = agent_runs["evict"]["mean_ttft_followup_turn_ms"]
    for case in ("pin_short", "pin_long", "offload"):
        assert agent_runs[case]["mean_ttft_followup_turn_ms"] < 0.9 * evict, case
        assert (agent_runs[case]["prefix_cache_hit_rate_followup_turn"]
                > agent_runs["evict"]["prefix_cache_hit_rate_followup_turn"] + 0.1), case
    assert agent_runs["evict"]["completed"] == agent_runs["pin_long"]["completed"]


def test_a_long_ttl_costs_first_calls(agent_runs):
    first = {case: run["mean_ttft_first_turn_ms"] for case, run in agent_runs.items()}
    assert first["pin_long"] > first["pin_short"] > first["evict"]
    assert (agent_runs["pin_long"]["idle_session_blocks_mean"]
            > agent_runs["pin_short"]["idle_session_blocks_mean"] > 0)
