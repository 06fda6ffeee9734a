"""Multi-LoRA serving in the simulator and the policies: the `lora` config group, adapter ids in
workloads and traces, the LRU LoRA manager, max_loras in every scheduler's batches, the
affinity scheduler and router, the LoRA cost in both cost models, and the +experiment=lora claim."""
from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from policies.lora.manager import LRULoRAManager
from policies.lora.spec import LoRASpec, lora_config
from policies.routing import LoRAAffinityRouter
from policies.types import Request, Sequence, SequenceStatus, StepLoRA, StepPlan, StepResult
from runtime.assembly import build_lora_manager
from sim.core.experiment import run_experiment
from sim.cost.lora import lora_adapter_bytes
from runtime.policy_config import CONF_DIR
from sim.cost.roofline import RooflineCostModel
from sim.core.workload import build_session_source, build_workload
from sim.cost.gpu.cost_model import GPUCostModel

from factories import (MAX_MODEL_LEN, POLICY_STRATEGIES, assert_same_run, build_scheduler,
                       check_outcome, drive, hardware_spec, make_cfg, model_spec,
                       requests_from_specs, run_both_ways, synthetic_workload)

MULTI = {"num_adapters": 8, "ranks": 16, "target_modules": ["q_proj", "v_proj"],
         "max_loras": 2, "popularity": "uniform"}


# ---- the config group ----------------------------------------------------------------------------

def test_lora_off_is_none_and_the_keys_are_read():
    assert lora_config({"num_adapters": 0}) is None and lora_config(None) is None
    config = lora_config({**MULTI, "ranks": [8, 16, 8, 16, 8, 16, 8, 64], "alpha": 32,
                          "max_cpu_loras": 4})
    assert config.spec.ranks == (8, 16, 8, 16, 8, 16, 8, 64)
    assert config.spec.scaling(7) == 0.5 and config.max_cpu_loras == 4
    assert config.max_loras == 2 and config.spec.target_modules == ("q_proj", "v_proj")


@pytest.mark.parametrize("change, key", [
    ({"ranks": [8, 16]}, "lora.ranks"),
    ({"ranks": 0}, "lora.ranks[0]"),
    ({"target_modules": ["qkv"]}, "lora.target_modules"),
    ({"popularity": "pareto"}, "lora.popularity"),
    ({"max_loras": 0}, "lora.max_loras"),
    ({"max_cpu_loras": 1}, "lora.max_cpu_loras"),
    ({"max_lora": 2}, "unknown key"),
])
def test_a_bad_lora_key_is_named(change, key):
    with pytest.raises(ValueError, match=key.replace("[", r"\[").replace("]", r"\]")):
        lora_config({**MULTI, **change})


def test_lora_policy_is_lru_or_a_class_of_the_protocol():
    built = build_lora_manager(lora_config({**MULTI,
                                            "policy": "policies.lora.manager.LRULoRAManager"}))
    assert isinstance(built, LRULoRAManager) and built.max_loras == 2
    with pytest.raises(ValueError, match="lora.policy must be lru"):
        build_lora_manager(lora_config({**MULTI, "policy": "fifo"}))
    with pytest.raises(ValueError, match=r"lora.policy: .* lacks .*track"):
        build_lora_manager(lora_config({**MULTI, "policy": "collections.Counter"}))


# ---- workloads -----------------------------------------------------------------------------------

def test_workloads_draw_adapters_by_popularity_and_leave_the_rest_as_it_was():
    workload = synthetic_workload(num_requests=4000)
    plain = build_workload(workload, seed=3)
    zipf = lora_config({**MULTI, "popularity": "zipf", "zipf_exponent": 1.2})
    drawn = build_workload(workload, seed=3, lora=zipf)
    assert all(request.lora_id is None for request in plain)
    assert ([(r.arrival_time, r.prompt_len, r.output_len) for r in plain]
            == [(r.arrival_time, r.prompt_len, r.output_len) for r in drawn])
    counts = [sum(r.lora_id == adapter for r in drawn) for adapter in range(8)]
    expected = zipf.popularity_weights()
    assert all(abs(count / 4000 - share) < 0.03 for count, share in zip(counts, expected))
    assert counts[0] > 2 * counts[3]
    assert [r.lora_id for r in build_workload(workload, seed=3, lora=zipf)] == \
        [r.lora_id for r in drawn]


def test_a_session_keeps_one_adapter():
    workload = OmegaConf.load(CONF_DIR / "workload" / "sessions.yaml")
    workload.num_sessions = 40
    source = build_session_source(workload, seed=0, vocab_size=1000, lora=lora_config(MULTI))
    for turns in source.sessions:
        assert len({turn.lora_id for turn in turns}) == 1 and turns[0].lora_id is not None
    assert len({turns[0].lora_id for turns in source.sessions}) > 1


def test_a_trace_lora_id_column_is_read_only_with_lora_on(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_time,prompt_len,output_len,lora_id\n0,10,5,3\n1,10,5,\n2,10,5,7\n")
    workload = {"kind": "trace", "trace_path": str(trace)}
    assert [r.lora_id for r in build_workload(workload, seed=0)] == [None] * 3
    ids = [r.lora_id for r in build_workload(workload, seed=0, lora=lora_config(MULTI))]
    assert ids[0] == 3 and ids[2] == 7 and ids[1] in range(8)
    with pytest.raises(ValueError, match="lora_id=7"):
        build_workload(workload, seed=0, lora=lora_config({**MULTI, "num_adapters": 4}))
    trace.write_text("arrival_time,prompt_len,output_len,lora_id\n0,10,5,x\n")
    with pytest.raises(ValueError, match="lora_id must be an adapter index"):
        build_workload(workload, seed=0)


def test_requests_csv_has_the_adapter(tmp_path):
    cfg = make_cfg("workload.num_requests=20", "lora=multi", "cost_model=roofline")
    run_experiment(cfg, out_dir=tmp_path, plots=False)
    with open(tmp_path / "requests.csv") as file:
        rows = list(csv.DictReader(file))
    assert all(row["lora_id"] != "" and 0 <= int(row["lora_id"]) < 8 for row in rows)


# ---- the LoRA manager ----------------------------------------------------------------------------

def _running(*lora_ids):
    requests = []
    for index, lora_id in enumerate(lora_ids):
        request = Request(index, 0.0, 10, 5, lora_id=lora_id)
        seq = Sequence(index, request)
        seq.status = SequenceStatus.RUNNING
        request.sequences = [seq]
        requests.append(request)
    return requests


def _plan(requests, tokens=None):
    plan = StepPlan()
    for request, num in zip(requests, tokens or [1] * len(requests)):
        plan.seqs.append(request.sequences[0])
        plan.num_new_tokens.append(num)
    return plan


def test_the_manager_loads_evicts_the_least_recent_unused_and_sums_the_plan():
    manager = LRULoRAManager(ranks=[4, 8, 16, 32], max_loras=2, max_cpu_loras=2)
    first = _running(0, 1, None)
    plan = _plan(first, [10, 3, 7])
    manager.finish_step(plan, first)
    step = plan.lora
    assert dict(step.to_load) == {0: step.slots[0], 1: step.slots[1]}
    assert (step.num_adapters, step.rank_sum, step.token_rank_sum,
            step.load_rank_sum) == (2, 12, 10 * 4 + 3 * 8, 12)
    again = _plan(first[:2])
    manager.finish_step(again, first)
    assert again.lora.to_load == () and again.lora.load_rank_sum == 0   # loaded already
    # Adapter 1 used last, 0 runs on: 2 may only take 1's slot... 0 is in use, so 1 goes.
    second = _running(0, 2)
    slot_of_1 = manager.slots[1]
    plan = _plan(second)
    manager.finish_step(plan, second)
    assert plan.lora.to_load == ((2, slot_of_1),) and set(manager.slots) == {0, 2}
    # Now 0 is the least recently used and nothing runs: adapter 3 evicts it; the host pool
    # (2 adapters) has dropped adapter 0 by then, so loading 0 back misses the host.
    third = _running(3)
    manager.finish_step(_plan(third), third)
    assert set(manager.slots) == {2, 3}
    fourth = _running(0)
    manager.finish_step(_plan(fourth), fourth)
    assert manager.num_loads == 5 and manager.num_host_misses == 5
    assert manager.summary()["lora_loads"] == 5


def test_the_manager_never_evicts_an_adapter_a_running_request_uses():
    manager = LRULoRAManager(ranks=[4, 8, 16], max_loras=2)
    first = _running(0, 1)
    manager.finish_step(_plan(first), first)
    manager.finish_step(_plan(first[:1]), first)   # 1 is now the least recently used
    waiting_on_1, new = _running(1, 2)
    plan = _plan([new])                              # 1 runs on but has no tokens this step
    manager.finish_step(plan, [waiting_on_1, new])
    assert set(manager.slots) == {1, 2} and plan.lora.to_load == ((2, 0),)


def test_the_manager_evicts_the_least_recently_used():
    manager = LRULoRAManager(ranks=[4, 8, 16], max_loras=2)
    first = _running(0, 1)
    manager.finish_step(_plan(first), first)       # 0 loaded before 1
    manager.finish_step(_plan(first[:1]), first)   # then 0 used again: 1 is the older
    new = _running(2)
    manager.finish_step(_plan(new), new)
    assert set(manager.slots) == {0, 2}


def test_a_speculating_decode_counts_its_drafts_in_the_adapter_matmuls():
    manager = LRULoRAManager(ranks=[4, 8], max_loras=2)
    running = _running(0, 1)
    plan = _plan(running)
    plan.spec_lens = {running[1].sequences[0].seq_id: 3}
    manager.finish_step(plan, running)
    assert plan.lora.token_rank_sum == 1 * 4 + (1 + 3) * 8


def test_the_manager_refuses_a_batch_past_max_loras():
    manager = LRULoRAManager(ranks=[4] * 4, max_loras=2)
    manager.track(_running(0, 1))
    assert manager.fits(None) and manager.fits(1) and not manager.fits(2)
    running = _running(0, 1, 2)
    with pytest.raises(RuntimeError, match="max_loras=2"):
        manager.finish_step(_plan(running), running)


# ---- every shipped scheduler, with LoRA on -------------------------------------------------------

def _lora_checking_executor(manager):
    def execute(plan):
        adapters = {seq.request.lora_id for seq in plan.seqs} - {None}
        assert len(adapters) <= manager.max_loras, f"{len(adapters)} adapters in one batch"
        step = plan.lora
        assert step.num_adapters == len(adapters)
        assert all(adapter in step.slots for adapter in adapters)
        assert sorted(step.slots.values()) == sorted(set(step.slots.values()))
        assert step.token_rank_sum == sum(
            (num + plan.spec_lens.get(seq.seq_id, 0)) * manager.ranks[seq.request.lora_id]
            for seq, num in zip(plan.seqs, plan.num_new_tokens)
            if seq.request.lora_id is not None)
        return StepResult(0.01)
    return execute


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**POLICY_STRATEGIES, max_loras=st.integers(1, 3),
       lora_ids=st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=10, max_size=10))
def test_no_scheduler_batches_more_than_max_loras(scheduler_name, kv_name, preemption_name,
                                                  block_size, pool_slack, num_host_blocks,
                                                  max_num_seqs, chunk_budget, request_specs,
                                                  max_loras, lora_ids):
    num_blocks = math.ceil(MAX_MODEL_LEN / block_size) + pool_slack // block_size
    manager = LRULoRAManager(ranks=[4, 8, 16, 4, 8, 16], max_loras=max_loras)
    scheduler = build_scheduler(scheduler_name, kv_name, preemption_name, block_size,
                                num_blocks, num_host_blocks, max_num_seqs, chunk_budget,
                                lora=manager)
    requests = requests_from_specs(request_specs)
    for request, lora_id in zip(requests, lora_ids):
        request.lora_id = lora_id
    finished_ids = drive(scheduler, requests, execute=_lora_checking_executor(manager))
    check_outcome(scheduler, requests, finished_ids)


# ---- affinity: scheduler and router --------------------------------------------------------------

def test_affinity_admits_the_batch_adapter_first_and_the_aged_head_before_all():
    def scheduler_with(max_wait_s):
        manager = LRULoRAManager(ranks=[8] * 4, max_loras=1)
        scheduler = build_scheduler("lora_affinity", "paged", "recompute", 16, 64, 0, 8, 64,
                                    lora=manager)
        scheduler.max_wait_s = max_wait_s
        return scheduler
    scheduler = scheduler_with(60.0)
    scheduler.add_request(Request(0, 0.0, 10, 50, lora_id=0), 0.0)
    scheduler.schedule(0.0)                    # adapter 0 runs
    scheduler.add_request(Request(1, 0.1, 10, 5, lora_id=1), 0.1)
    scheduler.add_request(Request(2, 0.2, 10, 5, lora_id=0), 0.2)
    plan = scheduler.schedule(0.3)
    assert [seq.request.request_id for seq in plan.seqs] == [2]
    aged = scheduler_with(0.05)
    aged.add_request(Request(0, 0.0, 10, 50, lora_id=0), 0.0)
    aged.schedule(0.0)
    aged.add_request(Request(1, 0.1, 10, 5, lora_id=1), 0.1)
    aged.add_request(Request(2, 0.2, 10, 5, lora_id=0), 0.2)
    plan = aged.schedule(0.3)                  # request 1 waited past max_wait_s: nobody passes
    assert 2 not in [seq.request.request_id for seq in plan.seqs]


def test_affinity_ranks_the_batch_adapters_then_the_loaded_then_any_that_fits():
    manager = LRULoRAManager(ranks=[8] * 4, max_loras=2)
    scheduler = build_scheduler("lora_affinity", "paged", "recompute", 16, 64, 0, 8, 64,
                                lora=manager)
    scheduler.add_request(Request(0, 0.0, 10, 50, lora_id=0), 0.0)
    scheduler.add_request(Request(1, 0.0, 10, 1, lora_id=1), 0.0)   # done after its prefill
    scheduler.update(scheduler.schedule(0.0), StepResult(0.01), 0.01)
    assert set(manager.slots) == {0, 1}
    for request_id, lora_id in ((2, 3), (3, 1), (4, 0)):
        scheduler.add_request(Request(request_id, 0.01, 10, 5, lora_id=lora_id), 0.01)
    plan = scheduler.schedule(0.02)
    # 0 runs (request 4 first), 1 is loaded (request 3); then the batch holds max_loras.
    assert [seq.request.request_id for seq in plan.seqs] == [4, 3]


def test_affinity_ends_a_run_of_repeated_steps_when_the_head_ages():
    manager = LRULoRAManager(ranks=[8] * 2, max_loras=2)
    scheduler = build_scheduler("lora_affinity", "paged", "recompute", 16, 10, 0, 8, 128,
                                lora=manager)
    scheduler.max_wait_s = 5.0
    scheduler.add_request(Request(0, 0.0, 100, 20, lora_id=0), 0.0)
    scheduler.update(scheduler.schedule(0.0), StepResult(0.01), 0.01)
    scheduler.add_request(Request(1, 0.1, 10, 5, lora_id=1), 0.1)     # the head: it would fit
    scheduler.add_request(Request(2, 0.1, 100, 5, lora_id=0), 0.1)    # in the batch: too big
    plan = scheduler.schedule(0.2)
    assert [seq.request.request_id for seq in plan.seqs] == [0]       # request 2 did not fit
    past_arrivals, until = scheduler.repeated_steps_bounds(plan)
    assert not past_arrivals
    assert until == pytest.approx(0.1 + 5.0)   # then request 1 goes first


def test_priority_preempts_the_holders_of_an_adapter_slot_for_an_important_request():
    manager = LRULoRAManager(ranks=[8] * 2, max_loras=1)
    scheduler = build_scheduler("priority", "paged", "recompute", 16, 64, 0, 8, 64,
                                lora=manager)
    for index in range(2):
        scheduler.add_request(Request(index, 0.0, 10, 20, priority=1, lora_id=0), 0.0)
    plan = scheduler.schedule(0.0)
    scheduler.update(plan, StepResult(0.01), 0.01)
    scheduler.add_request(Request(2, 0.01, 10, 5, priority=0, lora_id=1), 0.01)
    plan = scheduler.schedule(0.01)
    # Both holders of the one slot leave in this step and the important request runs at once.
    assert [seq.request.request_id for seq in plan.seqs] == [2]
    assert sorted(r.request_id for r in plan.preempted_recompute) == [0, 1]


class _View:
    def __init__(self, replica_id, num_outstanding, lora):
        self.replica_id, self.num_outstanding, self.lora = replica_id, num_outstanding, lora
        self.kv_cache = None


def test_the_router_sends_a_request_where_its_adapter_is_else_to_the_least_loaded():
    holding, loaded, other = (LRULoRAManager(ranks=[8] * 4, max_loras=2) for _ in range(3))
    holding.track(_running(2))
    loaded.slots[2] = 0
    replicas = [_View(0, 1, other), _View(1, 3, loaded), _View(2, 4, holding)]
    router = LoRAAffinityRouter()
    assert router.route(Request(0, 0.0, 10, 5, lora_id=2), replicas) == 2
    assert router.route(Request(0, 0.0, 10, 5, lora_id=3), replicas) == 0
    assert router.route(Request(0, 0.0, 10, 5), replicas) == 0
    replicas[2].num_outstanding = 40           # overloaded: past the bound
    assert router.route(Request(0, 0.0, 10, 5, lora_id=2), replicas) == 1


# ---- cost ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("cost_model_class", [RooflineCostModel, GPUCostModel])
def test_the_lora_cost_is_the_grouped_matmuls_and_the_loads(cost_model_class):
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    spec = LoRASpec(ranks=(8, 16), target_modules=("q_proj", "v_proj"))
    plain = cost_model_class(model, hardware)
    with_lora = cost_model_class(model, hardware, lora=spec)
    plan = StepPlan(num_decode_seqs=64, decode_context_tokens=64 * 500)
    base_s = plain.step_time(plan)
    assert with_lora.step_time(plan) == base_s   # no adapter in the plan
    # Per layer and unit of rank: q (4096 + 4096) + v (4096 + 4096) parameters.
    parameters_per_rank = 32 * 4 * 4096
    assert lora_adapter_bytes(spec, model, 1) == 16 * parameters_per_rank * 2
    flop_rate, byte_rate = (
        (hardware.peak_flops * plain.compute_efficiency,
         hardware.memory_bandwidth * plain.memory_efficiency)
        if cost_model_class is RooflineCostModel else
        (hardware.peak_flops * hardware.compute_efficiency, hardware.memory_bandwidth))
    host_rate = hardware.host_to_device_bandwidth * plain.transfer_efficiency
    for token_ranks, loads in ((64 * 12, 0), (5000 * 16, 16)):
        plan.lora = StepLoRA(num_adapters=2, rank_sum=24, token_rank_sum=token_ranks,
                             load_rank_sum=loads)
        expected = (max(2 * token_ranks * parameters_per_rank / flop_rate,
                        24 * parameters_per_rank * 2 / byte_rate)
                    + loads * parameters_per_rank * 2 / host_rate)
        assert with_lora.step_time(plan) - base_s == pytest.approx(expected)
    # Repeated decode steps cost the same as one at a time.
    plan.lora.load_rank_sum = 0
    assert next(with_lora.repeated_step_times(plan, 2)) == pytest.approx(with_lora.step_time(plan))


def test_a_moe_model_refuses_adapters_on_its_experts():
    with pytest.raises(ValueError, match="lora.target_modules"):
        RooflineCostModel(model_spec("mixtral-8x7b"), hardware_spec("h100-80gb"),
                          lora=LoRASpec(ranks=(8,), target_modules=("up_proj",)))


def test_a_cost_model_that_cannot_cost_adapters_is_named():
    profile = Path(__file__).resolve().parents[1] / "profiles" / "cpu" / "tiny-llama.json"
    cfg = make_cfg("lora=multi", "model=tiny-llama", "hardware=cpu", "cost_model=profiled",
                   f"cost_model.profile={profile}")
    with pytest.raises(ValueError, match=r"^lora: cost_model=profiled does not cost LoRA "
                                         r"adapters"):
        run_experiment(cfg, plots=False)


# ---- runs ----------------------------------------------------------------------------------------

def test_a_lora_run_counts_loads_and_keeps_max_loras():
    cfg = make_cfg("workload.num_requests=200", "workload.rate=4", "lora=multi",
                   "lora.num_adapters=16", "lora.max_loras=2", "cost_model=roofline")
    summary = run_experiment(cfg, plots=False).summary
    assert summary["lora_loads"] >= 16 and summary["lora_max_adapters_in_a_step"] == 2
    off = run_experiment(make_cfg("workload.num_requests=200", "workload.rate=4",
                                  "cost_model=roofline"), plots=False).summary
    assert "lora_loads" not in off and off["mean_e2el_ms"] < summary["mean_e2el_ms"]


def test_the_affinity_router_reads_each_replicas_adapters_in_a_run():
    def run(router):
        cfg = make_cfg("workload.num_requests=300", "workload.rate=12", "lora=multi",
                       "lora.num_adapters=32", "cluster.num_replicas=4",
                       f"cluster.router={router}", "cost_model=roofline")
        return run_experiment(cfg, plots=False).summary
    affinity, least_loaded = run("lora_affinity"), run("least_outstanding")
    assert affinity["lora_loads"] < 0.9 * least_loaded["lora_loads"]
    assert affinity["mean_ttft_ms"] < least_loaded["mean_ttft_ms"]


def test_a_decode_pool_admits_transfers_within_max_loras():
    cfg = make_cfg("cluster=disaggregated", "workload.num_requests=200", "workload.rate=8",
                   "lora=multi", "lora.num_adapters=16", "lora.max_loras=2",
                   "cost_model=roofline")
    summary = run_experiment(cfg, plots=False).summary
    assert summary["completed"] == 200 and summary["lora_max_adapters_in_a_step"] == 2


@pytest.mark.parametrize("overrides", [
    ["scheduler=continuous"],
    ["scheduler=lora_affinity"],
    # Requests age past max_wait_s inside runs of repeated steps.
    ["scheduler=lora_affinity", "scheduler.max_wait_s=2", "workload.rate=6"],
    # A decode replica loads the adapter of a request whose KV arrived, in a decode step.
    ["scheduler=continuous", "cluster=disaggregated"],
])
def test_repeated_steps_change_nothing_with_lora(overrides, monkeypatch):
    repeated, step_by_step, repeated_runs = run_both_ways(
        ("workload.num_requests=150", "workload.rate=3", "lora=multi", "lora.num_adapters=12",
         "lora.max_loras=3", "cost_model=roofline", *overrides), monkeypatch)
    assert repeated_runs and max(repeated_runs) > 1
    assert_same_run(repeated, step_by_step)


def test_affinity_beats_fcfs_on_mean_ttft_when_adapters_thrash():
    """docs/experiments.md section 15 (+experiment=lora) at 4 req/s: mean TTFT 36.7 s under
    FCFS, 8.1 s with adapter affinity; 516 adapter loads against 216."""
    def summary(scheduler):
        cfg = make_cfg("+experiment=lora", f"scheduler={scheduler}", "workload.rate=4",
                       "hydra.mode=RUN")
        return run_experiment(cfg, plots=False).summary
    fcfs, affinity = summary("continuous"), summary("lora_affinity")
    assert (round(fcfs["mean_ttft_ms"] / 1000, 1), round(affinity["mean_ttft_ms"] / 1000, 1)) \
        == (36.7, 8.1)
    assert (fcfs["lora_loads"], affinity["lora_loads"]) == (516, 216)
