"""The presets' numbers in docs/experiments.md, pinned: the simulator on the roofline cost model
(each preset pins it) is deterministic, so each value must come out as the docs report it, to
the docs' rounding. A few jobs per preset (a second or two each), the ones the docs' headline
claims rest on."""
from __future__ import annotations

import pytest

from sim.core.experiment import run_experiment

from factories import make_cfg


def preset_summary(preset: str, *overrides: str) -> dict:
    return run_experiment(make_cfg(f"+experiment={preset}", *overrides)).summary


def test_static_vs_continuous_at_saturation():
    """docs/experiments.md section 1: at 3 req/s static batching serves 0.55 req/s, continuous
    2.21 (4.0x); p99 TTFT 741 s against 46.3 s; p99 TPOT 24 against 66 ms."""
    static = preset_summary("static_vs_continuous", "scheduler=static", "workload.rate=3")
    continuous = preset_summary("static_vs_continuous", "scheduler=continuous", "workload.rate=3")
    assert static["request_throughput"] == pytest.approx(0.55, abs=0.005)
    assert continuous["request_throughput"] == pytest.approx(2.21, abs=0.005)
    assert round(continuous["request_throughput"] / static["request_throughput"], 1) == 4.0
    assert static["p99_ttft_ms"] / 1000 == pytest.approx(741, abs=0.5)
    assert continuous["p99_ttft_ms"] / 1000 == pytest.approx(46.3, abs=0.05)
    assert static["p99_tpot_ms"] == pytest.approx(24, abs=0.5)
    assert continuous["p99_tpot_ms"] == pytest.approx(66, abs=0.5)


def test_chunked_prefill_trade_off_at_14_requests_per_second():
    """docs/experiments.md, chunked prefill at 14 req/s: p99 TPOT 164 -> 34 ms and p99 TTFT
    2,737 -> 7,969 ms from continuous batching to a 256-token budget; both about 10.3 req/s."""
    continuous = preset_summary("chunked_prefill", "batching=continuous", "workload.rate=14")
    chunked = preset_summary("chunked_prefill", "batching=chunked_256", "workload.rate=14")
    assert continuous["p99_tpot_ms"] == pytest.approx(164, abs=0.5)
    assert chunked["p99_tpot_ms"] == pytest.approx(34, abs=0.5)
    assert continuous["p99_ttft_ms"] == pytest.approx(2737, abs=0.5)
    assert chunked["p99_ttft_ms"] == pytest.approx(7969, abs=0.5)
    for summary in (continuous, chunked):
        assert summary["request_throughput"] == pytest.approx(10.3, abs=0.05)


def test_parallel_sampling_shares_a_seventh_of_the_blocks_at_two_samples():
    """docs/experiments.md, parallel sampling at n = 2: peak KV blocks 774 shared, 910 copied
    (14.9 % saved)."""
    shared = preset_summary("parallel_sampling", "kv_cache.share_on_fork=true", "workload.n=2")
    copied = preset_summary("parallel_sampling", "kv_cache.share_on_fork=false", "workload.n=2")
    assert (shared["peak_kv_blocks"], copied["peak_kv_blocks"]) == (774, 910)
    assert round((1 - shared["peak_kv_blocks"] / copied["peak_kv_blocks"]) * 100, 1) == 14.9


def test_closed_loop_sessions_past_saturation():
    """docs/experiments.md section 13, 8 sessions/s: open loop 11.69 req/s and a mean follow-up
    TTFT of 23,592 ms; closed loop 10.15 req/s and 117 ms."""
    open_loop = preset_summary("sessions", "workload=conversation", "workload.rate=8")
    closed_loop = preset_summary("sessions", "workload=sessions", "workload.rate=8")
    assert open_loop["request_throughput"] == pytest.approx(11.69, abs=0.005)
    assert closed_loop["request_throughput"] == pytest.approx(10.15, abs=0.005)
    assert open_loop["mean_ttft_followup_turn_ms"] == pytest.approx(23592, abs=0.5)
    assert closed_loop["mean_ttft_followup_turn_ms"] == pytest.approx(117, abs=0.5)


def test_agents_lose_their_cached_contexts_at_128_at_once():
    """docs/experiments.md section 14, prefix caching on: hit rate 78.3 % and 9.09 req/s with 64
    agents at once, 33.8 % and 6.27 req/s with 128."""
    at_64 = preset_summary("agents", "kv_cache.enable_prefix_caching=true",
                           "workload.concurrency=64")
    at_128 = preset_summary("agents", "kv_cache.enable_prefix_caching=true",
                            "workload.concurrency=128")
    assert at_64["prefix_cache_hit_rate"] == pytest.approx(0.783, abs=0.0005)
    assert at_128["prefix_cache_hit_rate"] == pytest.approx(0.338, abs=0.0005)
    assert at_64["request_throughput"] == pytest.approx(9.09, abs=0.005)
    assert at_128["request_throughput"] == pytest.approx(6.27, abs=0.005)


def test_kv_retention_on_agents_at_2000_blocks():
    """docs/experiments.md section 12, 64 agents against 2,000 blocks: mean TTFT of follow-up /
    first calls 5,378 / 4,795 ms under evict (hit rate 18 %), 2,823 / 8,938 under pin with a
    30 s TTL (67 %), 3,812 / 3,596 under offload to a 64 GiB tier (83 %)."""
    cases = {case: preset_summary("kv_retention", f"+kv_retention_case={case}",
                                  "kv_cache.num_blocks=2000")
             for case in ("evict", "pin_long", "offload")}
    for case, (followup, first, hit_rate) in {"evict": (5378, 4795, 0.18),
                                              "pin_long": (2823, 8938, 0.67),
                                              "offload": (3812, 3596, 0.83)}.items():
        assert cases[case]["mean_ttft_followup_turn_ms"] == pytest.approx(followup, abs=0.5)
        assert cases[case]["mean_ttft_first_turn_ms"] == pytest.approx(first, abs=0.5)
        assert cases[case]["prefix_cache_hit_rate_followup_turn"] == pytest.approx(hit_rate,
                                                                                   abs=0.005)
