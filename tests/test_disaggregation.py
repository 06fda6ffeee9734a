"""Pools and prefill/decode disaggregation in the simulator (sim/core/cluster.py): the default is
one mixed pool; every disaggregated request is prefilled on the prefill pool, transferred once
and decoded to its length on the decode pool; no block leaks; transfers share links one at a
time; repeated steps change nothing; disaggregation takes prefill stalls out of TPOT and
pays for it in TTFT."""
from __future__ import annotations

import json
from collections import defaultdict

import pytest

from policies.batching import ContinuousBatchingScheduler
from sim.core.experiment import run_experiment

from factories import make_cfg, model_spec

# Long prompts, short outputs: prefills stall a colocated replica's decodes most.
LONG_PROMPTS = ["++workload.prompt_len={dist: uniform, low: 3000, high: 3800}",
                "++workload.output_len={dist: uniform, low: 32, high: 96}"]
MIXED_LENGTHS = ["++workload.prompt_len={dist: uniform, low: 200, high: 2500}",
                 "++workload.output_len={dist: uniform, low: 16, high: 200}"]
WALL_KEYS = ("wall_time_s", "sim_speedup")


def run(*overrides: str):
    return run_experiment(make_cfg(*overrides), plots=False)


def without_wall(summary: dict) -> dict:
    return {key: value for key, value in summary.items() if key not in WALL_KEYS}


def test_one_mixed_pool_runs_as_the_default_cluster():
    plain = run("workload.num_requests=150", "cluster.num_replicas=2", "workload.rate=15").summary
    pooled = run("workload.num_requests=150", "workload.rate=15",
                 "cluster.pools=[{name: main, role: mixed, num_replicas: 2}]").summary
    per_pool = pooled.pop("per_pool")
    assert without_wall(pooled) == without_wall(plain)
    assert per_pool["main"]["num_steps"] == plain["num_steps"]
    assert "num_kv_transfers" not in pooled


def _disaggregated_run(*overrides: str):
    return run("cluster=disaggregated", "workload.num_requests=120", *MIXED_LENGTHS, *overrides)


CONSERVATION_CASES = {
    "ample": ["workload.rate=4"],
    "two_by_two_shared_link": ["workload.rate=10", "cluster.prefill.num_replicas=2",
                               "cluster.decode.num_replicas=2",
                               "cluster.kv_transfer.topology=shared",
                               "cluster.kv_transfer.bandwidth_gbps=5"],
    # The decode pool preempts (by recompute) and hand-offs wait for its room.
    "tight_decode_pool": ["workload.rate=10", "cluster.prefill.num_replicas=2",
                          "+cluster.pools.1.kv_cache={num_blocks: 400}"],
    # Chunked prefill in a small prefill pool: prefills preempt each other there.
    "tight_prefill_pool": ["workload.rate=10", "scheduler=chunked_prefill",
                           "+cluster.pools.0.kv_cache={num_blocks: 250}",
                           "cluster.decode.num_replicas=2"],
}


@pytest.mark.parametrize("case", list(CONSERVATION_CASES))
def test_every_request_is_prefilled_transferred_once_and_decoded_without_leaks(case):
    result = _disaggregated_run(*CONSERVATION_CASES[case])
    summary, requests = result.summary, result.requests
    prefill_ids = {r.replica_id for r in result.replicas if r.role == "prefill"}
    decode_ids = {r.replica_id for r in result.replicas if r.role == "decode"}
    assert summary["completed"] == len(requests) and summary["rejected"] == 0
    assert summary["num_kv_transfers"] == len(requests)
    bytes_per_token = model_spec("llama-2-7b").kv_bytes_per_token
    for request in requests:
        assert request.prefill_replica_id in prefill_ids and request.replica_id in decode_ids
        assert request.num_output_tokens == request.output_len
        assert (request.first_token_time <= request.kv_handoff_time
                <= request.kv_transfer_start_time < request.kv_transfer_end_time
                < request.finish_time)
        assert request.kv_transfer_bytes == request.prompt_len * bytes_per_token
    assert summary["kv_transfer_bytes"] == sum(r.kv_transfer_bytes for r in requests)
    # No block left behind in any pool, nothing left in flight.
    for replica in result.replicas:
        scheduler = replica.scheduler
        assert scheduler.kv_cache.num_used_blocks() == 0
        scheduler.kv_cache.check_invariants()
        assert not (scheduler.handoff.handed_off or scheduler.receiving or scheduler.has_unfinished())
        assert replica.num_pending_transfers == 0
    prefill, decode = summary["per_pool"]["prefill"], summary["per_pool"]["decode"]
    assert prefill["num_decode_seqs"] == 0
    if summary["num_preemptions"] == 0:
        # Each prompt prefilled once, on the prefill pool; every later token a decode there.
        assert prefill["num_prefill_tokens"] == sum(r.prompt_len for r in requests)
        assert decode["num_prefill_tokens"] == 0
        assert decode["num_decode_seqs"] == sum(r.output_len - 1 for r in requests)
    elif case == "tight_decode_pool":
        assert prefill["num_prefill_tokens"] == sum(r.prompt_len for r in requests)
        assert decode["num_prefill_tokens"] > 0   # the recomputed ones


@pytest.mark.parametrize("case", ["two_by_two_shared_link", "tight_decode_pool", "ample"])
def test_transfers_never_share_a_link_at_once(case):
    result = _disaggregated_run(*CONSERVATION_CASES[case])
    shared = "cluster.kv_transfer.topology=shared" in CONSERVATION_CASES[case]
    busy = defaultdict(list)
    for request in result.requests:
        interval = (request.kv_transfer_start_time, request.kv_transfer_end_time)
        if shared:
            busy["shared"].append(interval)
        else:
            busy[request.prefill_replica_id].append(interval)
            busy[request.replica_id].append(interval)
    contended = 0
    for intervals in busy.values():
        intervals.sort()
        for (_, end), (start, _) in zip(intervals, intervals[1:]):
            assert start >= end
            contended += start == end
    if shared:
        assert contended > 0   # the slow shared link made transfers queue


@pytest.mark.parametrize("overrides", [
    [],
    ["+cluster.pools.1.kv_cache={num_blocks: 400}", "workload.rate=10"],
    ["cluster.prefill.num_replicas=2", "cluster.decode.num_replicas=2", "workload.rate=10",
     "cluster.kv_transfer.topology=shared", "kv_cache.num_blocks=700"],
    ["cluster.disaggregate=long_prompts", "cluster.kv_transfer.overlap=true"],
])
def test_repeated_decode_steps_change_nothing(overrides):
    """A decode replica's repeated steps end where a transfer could land: the run is the one
    that plans every step on its own."""
    repeated = _disaggregated_run(*overrides)
    step_by_step = _disaggregated_run(*overrides, "backend.repeated_steps=false")
    assert without_wall(repeated.summary) == without_wall(step_by_step.summary)
    assert repeated.metrics.step_rows == step_by_step.metrics.step_rows


def test_disaggregation_takes_prefill_stalls_out_of_tpot_and_pays_in_ttft():
    common = ["workload.num_requests=200", "workload.rate=2", *LONG_PROMPTS]
    colocated = run(*common, "cluster.num_replicas=2").summary
    disaggregated = run(*common, "cluster=disaggregated").summary
    assert disaggregated["p99_tpot_ms"] < 0.6 * colocated["p99_tpot_ms"]   # (0.57 on vLLM 0.14 A100 kernels)
    # One prefill replica instead of two, and the copy before the second token.
    assert disaggregated["mean_ttft_ms"] > colocated["mean_ttft_ms"]
    assert disaggregated["mean_kv_transfer_ms"] > 0


def test_a_transfer_takes_latency_plus_bytes_over_bandwidth_before_the_second_token():
    common = ["cluster=disaggregated", "workload.num_requests=20", "workload.rate=0.2",
              *LONG_PROMPTS, "cluster.kv_transfer.latency_ms=2"]
    slow = run(*common, "cluster.kv_transfer.bandwidth_gbps=10")
    fast = run(*common, "cluster.kv_transfer.bandwidth_gbps=100")
    overlapped = run(*common, "cluster.kv_transfer.bandwidth_gbps=10",
                     "cluster.kv_transfer.overlap=true")
    for request, fast_request, overlapped_request in zip(slow.requests, fast.requests,
                                                         overlapped.requests):
        copy_s = request.kv_transfer_end_time - request.kv_transfer_start_time
        assert copy_s == pytest.approx(0.002 + request.kv_transfer_bytes / 10e9)
        # Nothing else waits at this load: the decode replica admits the request at the end of
        # its step in flight (one decode), and the prefill is the same whatever the bandwidth.
        assert 0 <= request.kv_transfer_start_time - request.kv_handoff_time < 0.05
        assert request.first_token_time == fast_request.first_token_time
        second_token_gap = request.finish_time - request.first_token_time
        assert second_token_gap > copy_s
        overlapped_copy = (overlapped_request.kv_transfer_end_time
                           - overlapped_request.kv_transfer_start_time)
        assert 0.002 < overlapped_copy < copy_s
    assert slow.summary["mean_tpot_ms"] > fast.summary["mean_tpot_ms"]
    assert slow.summary["mean_ttft_ms"] == fast.summary["mean_ttft_ms"]


def test_zero_bandwidth_refuses_to_run():
    with pytest.raises(ValueError, match=r"cluster.kv_transfer.bandwidth_gbps is 0"):
        run("cluster=disaggregated", "cluster.kv_transfer.bandwidth_gbps=0")


@pytest.mark.parametrize("pools, message", [
    ("[{name: a, role: prefil, num_replicas: 1}]", r"cluster.pools\[0\].role must be one of"),
    ("[{name: a, role: prefill, num_replicas: 1}]", "a prefill pool needs a decode pool"),
    ("[{name: a, role: mixed, num_replicas: 0}]", r"cluster.pools\[0\].num_replicas"),
    ("[{name: a, role: mixed, num_replicas: 1, gpus: 2}]", r"unknown key\(s\) \['gpus'\]"),
    ("[{name: a, role: mixed, num_replicas: 1}, {name: a, role: decode, num_replicas: 1}]",
     r"cluster.pools\[1\].name"),
])
def test_bad_pools_are_named(pools, message):
    with pytest.raises(ValueError, match=message):
        run(f"cluster.pools={pools}")


class WithoutHandoffs(ContinuousBatchingScheduler):
    """A scheduler written before disaggregation: no hand-offs."""

    take_handoffs = None


def test_a_pool_needs_a_scheduler_and_backend_that_can_hand_over():
    with pytest.raises(ValueError, match=r"^scheduler of a prefill pool: WithoutHandoffs lacks "
                                         r"take_handoffs \(PrefillPoolScheduler, "):
        run("cluster=disaggregated", "scheduler._target_=test_disaggregation.WithoutHandoffs")
    with pytest.raises(ValueError, match="prefill and decode pools run on backend=sim"):
        run("cluster=disaggregated", "backend=engine", "model=tiny-llama", "hardware=cpu",
            "workload.with_token_ids=true")


def test_colocated_requests_go_to_the_mixed_pool():
    result = run("workload.num_requests=120", *MIXED_LENGTHS, "workload.rate=4",
                 "cluster.disaggregate=long_prompts",
                 "cluster.pools=[{name: m, role: mixed, num_replicas: 1}, "
                 "{name: p, role: prefill, num_replicas: 1}, "
                 "{name: d, role: decode, num_replicas: 1}]")
    role_of = {replica.replica_id: replica.role for replica in result.replicas}
    for request in result.requests:
        if request.prompt_len >= 1024:
            assert role_of[request.prefill_replica_id] == "prefill"
            assert role_of[request.replica_id] == "decode"
        else:
            assert role_of[request.replica_id] == "mixed" and request.prefill_replica_id is None
    assert result.summary["completed"] == 120


def test_pools_take_their_own_hardware_memory_and_scheduler():
    result = _disaggregated_run("workload.rate=4", "+cluster.pools.0.hardware=h100-80gb",
                                "+cluster.pools.0.scheduler=chunked_prefill",
                                "+cluster.pools.1.kv_cache={num_blocks: 900}")
    per_pool = result.summary["per_pool"]
    assert per_pool["decode"]["num_kv_blocks"] == 900
    by_role = {replica.role: replica for replica in result.replicas}
    assert type(by_role["prefill"].scheduler).__name__ == "ChunkedPrefillScheduler"
    assert type(by_role["decode"].scheduler).__name__ == "ContinuousBatchingScheduler"
    assert by_role["prefill"].executor.cost_model.hardware.name != \
        by_role["decode"].executor.cost_model.hardware.name
    assert result.summary["completed"] == 120


def test_the_disaggregation_policy_decides_per_request():
    never = _disaggregated_run("workload.rate=4", "cluster.disaggregate=never").summary
    assert never["num_kv_transfers"] == 0 and never["per_pool"]["decode"]["num_steps"] == 0
    assert never["completed"] == 120
    long_only = _disaggregated_run("workload.rate=4", "cluster.disaggregate=long_prompts")
    for request in long_only.requests:
        assert (request.kv_transfer_end_time is not None) == (request.prompt_len >= 1024)
    # n > 1 runs colocated: a transfer moves one sequence.
    samples = _disaggregated_run("workload.rate=4", "++workload.n=2")
    assert samples.summary["completed"] == 120 and samples.summary["num_kv_transfers"] == 0


def test_a_request_the_decode_pool_can_never_hold_is_rejected_with_a_reason():
    result = _disaggregated_run("workload.rate=4", "+cluster.pools.1.kv_cache={num_blocks: 100}")
    decode_kv = next(r.scheduler.kv_cache for r in result.replicas if r.role == "decode")
    rejected = [r for r in result.requests if r.rejected_reason is not None]
    assert rejected
    for request in result.requests:
        fits = decode_kv.can_ever_fit(request.prompt_len + request.output_len)
        assert (request.rejected_reason is None) == fits
    assert "can never fit in the KV cache of 100 blocks" in rejected[0].rejected_reason
    assert result.summary["completed"] + len(rejected) == 120
    for replica in result.replicas:
        assert replica.scheduler.kv_cache.num_used_blocks() == 0


def test_outputs_name_the_pools_and_the_transfers(tmp_path):
    run_experiment(make_cfg("cluster=disaggregated", "workload.num_requests=30"), tmp_path)
    header = (tmp_path / "requests.csv").read_text().splitlines()[0].split(",")
    for column in ("prefill_replica_id", "kv_handoff_time", "kv_transfer_start_time",
                   "kv_transfer_end_time", "kv_transfer_bytes"):
        assert column in header
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["per_pool"]) == {"prefill", "decode"}
    assert summary["p99_kv_transfer_ms"] >= summary["mean_kv_transfer_ms"] > 0
    assert (tmp_path / "kv_blocks.png").is_file()
