"""scheduler=vtc (Virtual Token Counter fairness between tenants) and scheduler=edf (earliest TTFT
deadline first, with admission control) reproduce their known effects in the simulator, count
rejected requests by reason, say what is wrong with bad settings in one line, and run on the
engine with FCFS's greedy outputs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from factories import (MAX_MODEL_LEN, POLICY_STRATEGIES, assert_same_run, build_scheduler,
                       check_outcome, drive, make_cfg, requests_from_specs, run_both_ways)
from policies.batching import (ContinuousBatchingScheduler, EarliestDeadlineFirstScheduler,
                               VirtualTokenCounterScheduler)
from policies.batching.edf import REJECTED_REASON
from policies.memory import PagedBlockManager
from policies.preemption import RecomputePreemption
from policies.routing import RoundRobinRouter
from policies.types import Request, StepResult
from sim.core.experiment import run_experiment
from runtime.metrics import MetricsCollector, jain_fairness, rejection_summary
from sim.core.replica import Replica, SimEnvironment, arrivals, drive_alone

# A server of 8 sequences with fixed lengths (each request 128 + 2 x 128 = 384 weighted
# tokens of service), offered about 4x what it serves: every tenant stays backlogged.
OVERLOADED = ["workload.num_requests=600", "workload.rate=20", "scheduler.max_num_seqs=8",
              "++workload.prompt_len={dist: fixed, value: 128}",
              "++workload.output_len={dist: fixed, value: 128}"]
REQUEST_SERVICE = 128 + 2 * 128
HEAVY_AND_LIGHT = "++workload.classes=[{share: 0.8, tenant: heavy}, {share: 0.2, tenant: light}]"
EVEN_SPLIT = "++workload.classes=[{share: 0.5, tenant: a}, {share: 0.5, tenant: b}]"


def run(*overrides):
    return run_experiment(make_cfg(*overrides), plots=False)


def service_by(result, until: float) -> dict[str, int]:
    """Each tenant's weighted tokens (prompt + 2 x output) in the requests done by `until`."""
    service: dict[str, int] = {}
    for request in result.requests:
        service.setdefault(request.tenant, 0)
        if request.finish_time is not None and request.finish_time <= until:
            service[request.tenant] += request.prompt_len + 2 * request.num_output_tokens
    return service


def checkpoints(result, num: int = 6) -> np.ndarray:
    """Times while the arrivals go on (every tenant backlogged), up to the last arrival."""
    last_arrival = max(request.arrival_time for request in result.requests)
    return np.linspace(last_arrival / num, last_arrival, num)


# ---- vtc ------------------------------------------------------------------------------------

def test_vtc_keeps_a_heavy_tenant_from_taking_the_server():
    """FCFS serves the tenants as they ask (80:20); VTC gives the backlogged light tenant as much
    as the heavy one, their difference bounded by a batch of requests at every moment."""
    fcfs = run("scheduler=continuous", HEAVY_AND_LIGHT, *OVERLOADED)
    vtc = run("scheduler=vtc", HEAVY_AND_LIGHT, *OVERLOADED)
    assert fcfs.summary["completed"] == vtc.summary["completed"] == 600
    bound = 2 * 8 * REQUEST_SERVICE
    fcfs_gaps, vtc_gaps = [], []
    for until in checkpoints(vtc):
        served = service_by(vtc, until)
        vtc_gaps.append(abs(served["heavy"] - served["light"]))
        served_fcfs = service_by(fcfs, until)
        fcfs_gaps.append(served_fcfs["heavy"] - served_fcfs["light"])
        assert jain_fairness(list(served.values())) >= min(1.0, max(
            0.97, jain_fairness(list(served_fcfs.values())) + 0.15))   # (1 is even service)
    assert max(vtc_gaps) <= bound
    assert fcfs_gaps[-1] > 4 * bound   # where FCFS lets the heavy tenant run away
    # Over the whole window the two serve about as much: VTC reorders, it does not idle.
    until = checkpoints(vtc)[-1]
    assert sum(service_by(vtc, until).values()) >= 0.9 * sum(service_by(fcfs, until).values())


def test_vtc_tenant_weights_shift_the_service():
    even = run("scheduler=vtc", EVEN_SPLIT, *OVERLOADED)
    weighted = run("scheduler=vtc", EVEN_SPLIT, "++scheduler.tenant_weights={a: 2, b: 1}",
                   *OVERLOADED)
    until = checkpoints(even)[-1]
    even_ratio = service_by(even, until)["a"] / service_by(even, until)["b"]
    weighted_ratio = service_by(weighted, until)["a"] / service_by(weighted, until)["b"]
    assert 0.85 < even_ratio < 1.15
    assert 1.7 < weighted_ratio < 2.3


def test_vtc_admits_the_least_served_tenant_and_banks_no_idle_time():
    scheduler = build_scheduler("vtc", "paged", "recompute", 16, 64, 0, 1, 64)
    now = 0.0

    def run_until_idle(now):
        admitted = []
        while scheduler.has_unfinished():
            plan = scheduler.schedule(now)
            admitted += [seq.request.request_id for seq in plan.seqs
                         if seq.num_output_tokens == 0]
            now += 0.01
            scheduler.update(plan, StepResult(0.01), now)
        return admitted, now

    # Tenant a alone for a while: its counter grows (prompt tokens 1, output tokens 2 each).
    scheduler.add_request(Request(0, 0.0, 20, 10, tenant="a"), now)
    _, now = run_until_idle(now)
    assert scheduler.counters == {"a": 20 + 2 * 10}
    # b, never seen, starts level with a, the least served active tenant: not at 0 with a's
    # 40 tokens banked as credit. a came back from idle level with itself (the last to leave).
    for request_id, tenant in ((1, "a"), (2, "a"), (3, "b")):
        scheduler.add_request(Request(request_id, now, 20, 10, tenant=tenant), now)
    assert scheduler.counters == {"a": 40, "b": 40}
    # One at a time (max_num_seqs=1): a's first (the tie goes to the earlier request), then b,
    # now served least, before a's second: FCFS would run 1, 2, 3.
    admitted, now = run_until_idle(now)
    assert admitted == [1, 3, 2]
    assert scheduler.counters == {"a": 40 + 2 * 40, "b": 40 + 40}


def test_vtc_counts_repeated_steps_as_single_ones(monkeypatch):
    """The counters after a run of repeated steps are those of the steps one by one,
    and so is the whole run (every row, latency and finish time)."""
    overrides = ["scheduler=vtc", HEAVY_AND_LIGHT, *OVERLOADED[2:], "workload.rate=4",
                 "workload.num_requests=300", "++scheduler.tenant_weights={heavy: 3}"]
    assert_repeated_steps_exact(overrides, monkeypatch)


def assert_repeated_steps_exact(overrides, monkeypatch):
    repeated, step_by_step, repeated_runs = run_both_ways(overrides, monkeypatch)
    assert max(repeated_runs) > 1   # not vacuous: decode steps did run as one event
    assert_same_run(repeated, step_by_step)


@pytest.mark.parametrize("weights,message", [
    ("{a: 0}", "scheduler.tenant_weights.a must be a positive number, got 0"),
    ("{a: -1.5}", "scheduler.tenant_weights.a must be a positive number, got -1.5"),
    ("{b: heavy}", "scheduler.tenant_weights.b must be a positive number, got 'heavy'"),
    ("3", "scheduler.tenant_weights must be a mapping"),
    ("{a: 2, c: 1}", "scheduler.tenant_weights.c: no request of the run has tenant 'c'; the "
                     "run's tenants: a, b"),
])
def test_vtc_bad_tenant_weights_say_which(weights, message):
    with pytest.raises(ValueError) as error:
        run("scheduler=vtc", EVEN_SPLIT, "workload.num_requests=20",
            f"++scheduler.tenant_weights={weights}")
    assert message in str(error.value) and "\n" not in str(error.value)


# ---- edf ------------------------------------------------------------------------------------

def test_edf_admits_the_earliest_deadline_first_and_no_deadline_last():
    scheduler = build_scheduler("edf", "paged", "recompute", 16, 64, 0, 1, 64)
    scheduler.slo_ttft_ms = 500.0   # the run's, for requests without their own
    requests = [Request(0, 0.0, 20, 4, slo_ttft_ms=None),       # due at 0.5
                Request(1, 0.1, 20, 4, slo_ttft_ms=5000.0),     # due at 5.1
                Request(2, 0.2, 20, 4, slo_ttft_ms=100.0),      # due at 0.3
                Request(3, 0.3, 20, 4, slo_ttft_ms=100.0)]      # due at 0.4
    for request in requests:
        scheduler.add_request(request, 0.3)
    assert [scheduler.deadline(r) for r in requests] == pytest.approx([0.5, 5.1, 0.3, 0.4])
    scheduler.slo_ttft_ms = None   # now request 0 has no deadline: it goes last
    order = []
    now = 0.3
    while scheduler.has_unfinished():
        plan = scheduler.schedule(now)
        order += [seq.request.request_id for seq in plan.seqs if seq.num_output_tokens == 0]
        now += 0.01
        scheduler.update(plan, StepResult(0.01), now)
    assert order == [2, 3, 1, 0]
    assert all(request.rejected_reason is None for request in requests)   # reject_hopeless off


def test_edf_serves_the_tight_class_first():
    """Two classes, one with a tight TTFT SLO: EDF gives it its first token sooner than FCFS,
    and meets more of its deadlines."""
    classes = ("++workload.classes=[{share: 0.3, tenant: tight, slo_ttft_ms: 1000}, "
               "{share: 0.7, tenant: loose, slo_ttft_ms: 60000}]")
    overrides = [classes, "workload.num_requests=400", "workload.rate=20"]
    fcfs, edf = run("scheduler=continuous", *overrides), run("scheduler=edf", *overrides)
    assert (edf.summary["per_tenant"]["tight"]["mean_ttft_ms"]
            < 0.5 * fcfs.summary["per_tenant"]["tight"]["mean_ttft_ms"])
    assert (edf.summary["per_tenant"]["tight"]["slo_attainment"]
            > fcfs.summary["per_tenant"]["tight"]["slo_attainment"] + 0.2)


def test_edf_rejecting_hopeless_requests_raises_attainment_under_overload():
    overload = ["workload.num_requests=600", "workload.rate=30", "slo.ttft_ms=2000"]
    fcfs = run("scheduler=continuous", *overload).summary
    edf = run("scheduler=edf", "scheduler.reject_hopeless=true", *overload).summary
    assert fcfs["rejected"] == 0 and "rejected_by_reason" not in fcfs
    assert edf["slo_attainment"] > fcfs["slo_attainment"] + 0.2
    assert edf["goodput"] > 1.5 * fcfs["goodput"]
    # Every request is done: completed or rejected, and the rejections say why.
    assert edf["completed"] + edf["rejected"] == 600 and edf["rejected"] > 0
    assert edf["rejected_by_reason"] == {REJECTED_REASON: edf["rejected"]}
    assert REJECTED_REASON.startswith("slo")
    # Without admission control EDF of one SLO is FCFS: the same run.
    same = run("scheduler=edf", *overload).summary
    assert same["slo_attainment"] == fcfs["slo_attainment"]


def test_edf_rejections_leave_the_queues_and_count_as_done():
    scheduler = build_scheduler("edf", "paged", "recompute", 16, 64, 0, 1, 64)
    scheduler.slo_ttft_ms, scheduler.reject_hopeless = 30.0, True
    requests = [Request(i, 0.0, 20, 5) for i in range(4)]
    done = drive(scheduler, requests)   # 10 ms steps: only the first gets in in time
    assert sorted(done) == [0, 1, 2, 3]   # returned by update, finished or rejected
    assert [r.rejected_reason for r in requests] == [None] + [REJECTED_REASON] * 3
    assert all(r.finish_time is None and r.first_scheduled_time is None for r in requests[1:])
    assert scheduler.num_outstanding == 0 and not scheduler.has_unfinished()
    assert scheduler.kv_cache.num_used_blocks() == 0


def test_edf_with_admission_control_keeps_repeated_steps_exact(monkeypatch):
    assert_repeated_steps_exact(["scheduler=edf", "scheduler.reject_hopeless=true",
                             "workload.num_requests=300", "workload.rate=30", "slo.ttft_ms=2000",
                             "preemption=swap", "kv_cache.num_blocks=1500"], monkeypatch)


@pytest.mark.parametrize("override,message", [
    ("scheduler.slo_ttft_ms=0", "scheduler.slo_ttft_ms must be a positive number, got 0"),
    ("scheduler.slo_ttft_ms=soon", "scheduler.slo_ttft_ms must be a positive number, got 'soon'"),
    ("scheduler.reject_hopeless=2", "scheduler.reject_hopeless must be true or false, got 2"),
])
def test_edf_bad_settings_say_which(override, message):
    with pytest.raises(ValueError) as error:
        run("scheduler=edf", "workload.num_requests=5", override)
    assert str(error.value) == message


def test_rejected_by_reason_counts_each_kind():
    requests = [Request(i, 0.0, 10, 10) for i in range(5)]
    requests[0].rejected_reason = REJECTED_REASON
    requests[1].rejected_reason = "prompt_len + output_len = 5000 exceeds max_model_len=4096"
    requests[2].rejected_reason = "prompt_len + output_len = 6000 exceeds max_model_len=4096"
    summary = rejection_summary(requests)
    assert summary["rejected_by_reason"] == {
        "prompt_len + output_len = # exceeds max_model_len=#": 2, REJECTED_REASON: 1}
    assert summary["rejected_reason_count"] == 2   # the existing keys as they were
    assert summary["rejected_reason"] == requests[1].rejected_reason
    assert rejection_summary(requests[3:]) == {}


# ---- the invariants, with tenants, weights, deadlines and rejections --------------------------

@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**{**POLICY_STRATEGIES, "scheduler_name": st.sampled_from(["vtc", "edf"])},
       tenant_of=st.lists(st.sampled_from("abc"), min_size=10, max_size=10),
       slos_ms=st.lists(st.sampled_from([None, 5.0, 20.0, 100.0]), min_size=10, max_size=10),
       weight=st.sampled_from([0.5, 1, 3]), reject_hopeless=st.booleans())
def test_fairness_and_deadlines_keep_every_invariant(
        scheduler_name, kv_name, preemption_name, block_size, pool_slack, num_host_blocks,
        max_num_seqs, chunk_budget, request_specs, tenant_of, slos_ms, weight, reject_hopeless):
    """The property test of every scheduler (tests/test_scheduler_properties.py) with several
    tenants and SLOs; a rejected request is returned by update once, as a finished one is."""
    num_blocks = -(-MAX_MODEL_LEN // block_size) + pool_slack // block_size
    scheduler = build_scheduler(scheduler_name, kv_name, preemption_name, block_size,
                                num_blocks, num_host_blocks, max_num_seqs, chunk_budget)
    if scheduler_name == "vtc":
        scheduler.tenant_weights = {"a": weight}
    else:
        scheduler.slo_ttft_ms, scheduler.reject_hopeless = 50.0, reject_hopeless
    requests = requests_from_specs(request_specs)
    for request, tenant, slo_ms in zip(requests, tenant_of, slos_ms):
        request.tenant, request.slo_ttft_ms = tenant, slo_ms
    done = drive(scheduler, requests)
    rejected_at_arrival = {r.request_id for r in requests if r.rejected_reason is not None
                           and r.rejected_reason != REJECTED_REASON}
    assert sorted(done) == sorted(r.request_id for r in requests
                                  if r.request_id not in rejected_at_arrival)
    check_outcome(scheduler, requests, [request_id for request_id in done
                                        if requests[request_id].rejected_reason is None])
    assert scheduler.num_outstanding == 0
    if scheduler_name == "vtc":   # every token served is counted (lifts only add to it)
        for tenant, counter in scheduler.counters.items():
            served = sum(r.prompt_len + 2 * r.num_output_tokens for r in requests
                         if r.tenant == tenant and r.rejected_reason is None)
            assert counter >= served / scheduler.tenant_weights.get(tenant, 1) - 1e-6


# ---- on the engine --------------------------------------------------------------------------

PROMPT_LENS, MAX_TOKENS = (12, 9, 15, 7, 11), (10, 3, 7, 12, 5)


def engine_prompts():
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def fcfs_tokens():
    from engine import LLM, SamplingParams

    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    fcfs = LLM("tiny-llama", num_gpu_blocks=12, block_size=4, seed=0, scheduler="continuous")
    return [out.outputs[0].token_ids for out in fcfs.generate(engine_prompts(), greedy,
                                                              use_tqdm=False)]


@pytest.mark.parametrize("scheduler", ["vtc", "edf"])
def test_the_schedulers_run_on_the_engine_with_fcfs_outputs(scheduler, fcfs_tokens):
    from engine import LLM, SamplingParams

    greedy = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    llm = LLM("tiny-llama", num_gpu_blocks=12, block_size=4, seed=0, scheduler=scheduler)
    outputs = llm.generate(engine_prompts(), greedy, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == fcfs_tokens
    assert all(out.error is None for out in outputs)
    assert llm.last_stats.num_preemptions > 0   # a small pool: preemptions too


@pytest.mark.parametrize("scheduler", ["vtc", "edf"])
def test_reordered_by_tenant_or_deadline_the_engine_gives_fcfs_tokens(scheduler):
    """Under the simulator's clock with the engine's executor, requests of two tenants and two
    SLOs (the order really differs from FCFS's) get FCFS's greedy tokens."""
    from engine import build_engine_executor

    def replay(scheduler_class):
        kv_cache = PagedBlockManager(num_blocks=12, block_size=4)
        policy = scheduler_class(kv_cache, RecomputePreemption(), max_num_seqs=2,
                                 max_num_batched_tokens=64, max_model_len=64)
        executor = build_engine_executor("tiny-llama", kv_cache)
        requests = [Request(i, 0.0, len(p), m, prompt_token_ids=p,
                            tenant="a" if i < 3 else "b", slo_ttft_ms=10_000.0 - 1000 * i)
                    for i, (p, m) in enumerate(zip(engine_prompts(), MAX_TOKENS))]
        env = SimEnvironment()
        replica = Replica(env, 0, [policy], executor, MetricsCollector())
        drive_alone(replica)
        env.process(arrivals(env, requests, RoundRobinRouter(), [replica]))
        env.run()
        assert all(request.finish_time is not None for request in requests)
        order = sorted(requests, key=lambda r: (r.first_scheduled_time, r.request_id))
        return [r.sequences[0].output_token_ids for r in requests], [r.request_id for r in order]

    expected, fcfs_order = replay(ContinuousBatchingScheduler)
    cls = {"vtc": VirtualTokenCounterScheduler, "edf": EarliestDeadlineFirstScheduler}[scheduler]
    tokens, order = replay(cls)
    assert tokens == expected
    assert order != fcfs_order


def test_edf_rejects_hopeless_requests_on_the_engine_with_an_error():
    from engine import LLM, SamplingParams

    edf = {"_target_": "policies.batching.EarliestDeadlineFirstScheduler",
           "slo_ttft_ms": 0.001, "reject_hopeless": True}
    llm = LLM("tiny-llama", num_gpu_blocks=12, block_size=4, seed=0, scheduler=edf,
              max_num_seqs=2)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outputs = llm.generate(engine_prompts(), greedy, use_tqdm=False)
    # The first step admits two; by its end every other deadline (1 us) has passed.
    assert [out.error for out in outputs] == [None, None] + [REJECTED_REASON] * 3
    assert [len(out.outputs) for out in outputs] == [1, 1, 0, 0, 0]
    assert not llm.scheduler.has_unfinished()
