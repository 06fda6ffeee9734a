"""Pipeline parallelism (sim/cost/pipeline.py, sim/core/pipelined_replica.py): the stages' split,
the per-GPU KV capacity, each stage's share of a step and the sends, and the replica's virtual
engines with batches in flight through the stages: the bubble, the overlap and whole runs'
invariants."""
from __future__ import annotations

import csv

import numpy as np
import pytest

from hypothesis import given, settings
from hypothesis import strategies as st

from factories import (REPO, check_outcome, config_cost_model, config_kv_blocks, hardware_spec,
                       make_cfg, model_spec)
from policies.types import Request, StepLoRA, StepPlan
from sim.core import pipelined_replica
from runtime.assembly import build_preemption
from sim.core.build import kv_cache_sizes
from sim.core.settings import replica_settings, run_settings
from sim.core.cluster import build_pools
from sim.core.experiment import run_experiment
from sim.cost.pipeline import (PipelineCostModel, send_bytes_per_token, stage_layers,
                               stage_model)
from sim.cost.roofline import RooflineCostModel
from runtime.specs import GIB
from runtime.kv_sizing import activation_peak_bytes, step_token_budget


def _cost_model(pp: int, cost_model: str = "roofline"):
    cfg = make_cfg(f"cost_model={cost_model}", f"cluster.pipeline_parallel_size={pp}")
    return config_cost_model(cfg, model_spec("llama-2-7b"), hardware_spec("a100-80gb"))


def _decodes(num_seqs: int, context: int = 512) -> StepPlan:
    return StepPlan(num_decode_seqs=num_seqs, decode_context_tokens=num_seqs * context)


def _prefills(num_seqs: int, chunk: int) -> StepPlan:
    return StepPlan(num_prefill_seqs=num_seqs, num_prefill_tokens=num_seqs * chunk,
                    prefill_attention_work=num_seqs * chunk * chunk,
                    prefill_context_tokens=num_seqs * chunk,
                    sum_squared_prefill_chunks=num_seqs * chunk * chunk)


# ---- stages and validation -----------------------------------------------------------------------

def test_stage_split_is_vllms():
    # vLLM get_pp_indices: 32 layers over 3 stages -> 11, 11, 10 (the last, with the LM head,
    # takes no extra layer); even splits stay even.
    assert stage_layers(32, 3) == [11, 11, 10]
    assert stage_layers(80, 4) == [20] * 4
    assert stage_layers(5, 5) == [1] * 5
    assert sum(stage_layers(61, 8)) == 61 and max(stage_layers(61, 8)) == 8
    llama = model_spec("llama-2-7b")
    assert stage_model(llama, 3).num_layers == 11
    assert stage_model(llama, 3).hidden_size == llama.hidden_size
    assert stage_model(llama, 1) is llama


@pytest.mark.parametrize("override, message", [
    ("cluster.pipeline_parallel_size=0", "cluster.pipeline_parallel_size"),
    ("cluster.pipeline_parallel_size=33", "cluster.pipeline_parallel_size=33 exceeds"),
    ("cluster.pipeline_parallel_size=1.5", "cluster.pipeline_parallel_size"),
])
def test_bad_sizes_name_the_key(override, message):
    cfg = make_cfg(override)
    with pytest.raises(ValueError, match=message):
        config_kv_blocks(cfg, model_spec("llama-2-7b"), hardware_spec("a100-80gb"))


def test_speculation_and_other_cost_models_are_refused():
    cfg = make_cfg("cluster.pipeline_parallel_size=2", "speculation=fixed")
    with pytest.raises(ValueError, match="cluster.pipeline_parallel_size=2 with speculative"):
        config_cost_model(cfg, model_spec("llama-2-7b"), hardware_spec("a100-80gb"))
    cfg = make_cfg("cluster.pipeline_parallel_size=2", "cost_model=profiled",
                   f"cost_model.profile={REPO / 'profiles/cpu/tiny-llama.json'}",
                   "model=tiny-llama", "hardware=cpu")
    with pytest.raises(ValueError, match="needs cost_model=roofline or gpu"):
        config_cost_model(cfg, model_spec("tiny-llama"), hardware_spec("cpu"))


def test_one_stage_is_the_base_cost_model():
    assert type(_cost_model(1)) is RooflineCostModel
    assert isinstance(_cost_model(2), PipelineCostModel)


# ---- KV capacity ---------------------------------------------------------------------------------

def test_kv_blocks_per_gpu_hold_a_stages_layers():
    """(memory x utilisation - reserved - a stage's weights - activations) / a stage's KV per
    block, by hand: 16 of Llama-2-7B's 32 layers, the embedding and the LM head."""
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    cfg = make_cfg("cluster.pipeline_parallel_size=2")
    h, block = model.hidden_size, cfg.kv_cache.block_size
    layer = model.linear_parameters_per_layer + model.norm_parameters_per_layer
    weights = (2 * model.vocab_size * h + 16 * layer + h) * model.dtype_bytes
    activations = activation_peak_bytes(model, step_token_budget(None, model.max_model_len), 256)
    budget = hardware.memory_gb * GIB * cfg.gpu_memory_utilization \
        - hardware.reserved_memory_gb * GIB
    kv_per_block = block * 2 * 16 * model.num_key_value_heads * model.head_dim * model.dtype_bytes
    expected = int((budget - weights - activations) // kv_per_block)
    assert config_kv_blocks(cfg, model, hardware) == expected
    # More than twice the one-stage pool: half the KV per block and half the weights.
    assert expected > 2 * config_kv_blocks(make_cfg(), model, hardware)


def test_host_pools_hold_a_stages_share_of_each_block():
    """Swap space and the prefix cache's host tier are GiB per GPU: a stage's block is half
    of Llama-2-7B's at pp=2, so each holds twice the blocks."""
    model = model_spec("llama-2-7b")
    sizes = {}
    for pp in (1, 2):
        cfg = make_cfg(f"cluster.pipeline_parallel_size={pp}", "preemption=swap",
                       "kv_cache.offload_gb=3")
        sizes[pp] = kv_cache_sizes(replica_settings(cfg, model), 100,
                                  build_preemption(cfg.preemption))
    block_bytes = model.kv_bytes_per_block(16)
    assert sizes[1]["num_host_blocks"] == 4 * GIB // block_bytes
    assert sizes[2]["num_host_blocks"] == 4 * GIB // (block_bytes // 2)
    assert sizes[2]["num_offload_blocks"] == 3 * GIB // (block_bytes // 2)
    assert sizes[1]["num_offload_blocks"] == 3 * GIB // block_bytes


def test_a_pool_sets_its_own_pipeline():
    model = model_spec("llama-2-7b")
    cfg = make_cfg("+cluster.pools=[{name: a, role: mixed, num_replicas: 1}, "
                   "{name: b, role: mixed, num_replicas: 1, pipeline_parallel_size: 2}]")
    with pytest.raises(ValueError, match="one pool each"):   # two mixed pools are refused
        build_pools(cfg, model, run_settings(cfg))
    cfg = make_cfg("cluster=disaggregated", "+cluster.pools.1.pipeline_parallel_size=2")
    prefill, decode = build_pools(cfg, model, run_settings(cfg))
    too_many = make_cfg("cluster=disaggregated", "+cluster.pools.1.pipeline_parallel_size=40")
    with pytest.raises(ValueError, match=r"cluster.pools\[1\].pipeline_parallel_size=40 exceeds"):
        build_pools(too_many, model, run_settings(too_many))
    hardware = hardware_spec("a100-80gb")
    assert prefill.num_kv_blocks == config_kv_blocks(make_cfg(), model, hardware)
    assert decode.num_kv_blocks == config_kv_blocks(make_cfg("cluster.pipeline_parallel_size=2"),
                                                    model, hardware)


# ---- each stage's share of a step ----------------------------------------------------------------

def test_a_step_through_the_stages_is_the_whole_model_plus_the_sends():
    """The roofline is linear in layers, so the stages' times add up to the whole model's step
    (one overhead, one LM head) plus pp - 1 sends."""
    whole = _cost_model(1)
    for pp in (2, 3, 4):
        pipeline = _cost_model(pp)
        for plan in (_decodes(1), _decodes(64), _prefills(1, 2048), _prefills(8, 512)):
            tokens = plan.num_prefill_tokens + plan.num_decode_seqs
            assert pipeline.send_s(tokens) > 0
            assert sum(pipeline.stage_times(plan)) == pytest.approx(
                whole.step_time(plan) + (pp - 1) * pipeline.send_s(tokens), rel=1e-12)
    assert _cost_model(2).stage_times(StepPlan()) == [0.0, 0.0]


def test_the_first_stage_pays_the_overhead_the_last_the_lm_head_the_others_their_send():
    """Two stages of 16 layers each: the first's time less the last's is the engine overhead
    plus the send less the LM head, each by hand."""
    pipeline = _cost_model(2)
    first = pipeline.stages[0]
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    flop_rate = hardware.peak_flops * first.compute_efficiency
    byte_rate = hardware.memory_bandwidth * first.memory_efficiency
    for plan in (_decodes(4), _decodes(512), _prefills(2, 1024)):
        seqs = plan.num_prefill_seqs + plan.num_decode_seqs
        overhead = first.step_overhead_s + first.per_sequence_overhead_s * seqs
        lm_head = max(seqs * 2 * model.lm_head_parameters / flop_rate,
                      model.lm_head_parameters * model.dtype_bytes / byte_rate)
        send = pipeline.send_s(plan.num_prefill_tokens + plan.num_decode_seqs)
        stage_s = pipeline.stage_times(plan)
        assert stage_s[0] - stage_s[1] == pytest.approx(overhead + send - lm_head, rel=1e-9)


def test_memory_operations_move_a_stages_share_of_each_block():
    """Each stage swaps its layers' K/V of a block: 11, 11 and 10 of 32 at pp=3."""
    whole, pipeline = _cost_model(1), _cost_model(3)
    swaps = [(i, i) for i in range(10)]
    with_swaps = _decodes(4)
    with_swaps.blocks_to_swap_in = swaps
    whole_swaps_s = whole.step_time(StepPlan(blocks_to_swap_in=swaps)) - whole.step_overhead_s
    added = [a - b for a, b in zip(pipeline.stage_times(with_swaps),
                                   pipeline.stage_times(_decodes(4)))]
    assert added == pytest.approx([whole_swaps_s * layers / 32 for layers in (11, 11, 10)],
                                  rel=1e-9)


def test_lora_adapter_loads_move_a_stages_share():
    """An adapter load moves the stage's layers of it (half of Llama-2-7B's at pp=2)."""
    lora = {"ranks": (16,), "target_modules": ("q_proj", "v_proj")}
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    pipeline = config_cost_model(make_cfg("cost_model=roofline",
                                          "cluster.pipeline_parallel_size=2"),
                                 model, hardware, lora=lora)
    whole = config_cost_model(make_cfg("cost_model=roofline"), model, hardware, lora=lora)
    with_lora = _decodes(8)
    with_lora.lora = StepLoRA(num_adapters=2, rank_sum=32, token_rank_sum=8 * 16)
    with_load = _decodes(8)
    with_load.lora = StepLoRA(((1, 0),), num_adapters=2, rank_sum=32, token_rank_sum=8 * 16,
                              load_rank_sum=16)
    whole_load_s = whole.step_time(with_load) - whole.step_time(with_lora)
    assert whole_load_s > 0
    added = [a - b for a, b in zip(pipeline.stage_times(with_load),
                                   pipeline.stage_times(with_lora))]
    assert added == pytest.approx([whole_load_s / 2] * 2, rel=1e-9)


def test_sends_are_measured_on_gpus_and_roofline_arithmetic_otherwise():
    """GPU cost model: the NCCL send/recv table (one node) at hidden + residual bytes; roofline:
    its all-reduce latency plus the bytes over the link at transfer_efficiency."""
    model = model_spec("llama-2-7b")
    per_token = send_bytes_per_token(model, 1)
    assert per_token == 2 * 4096 * 2
    with open(REPO / "data/gpu/vidur/network/a100_dgx/send_recv.csv", newline="") as file:
        points = sorted((int(row["size"]), float(row["time_stats.send_recv.median"]))
                        for row in csv.DictReader(file) if row["devices_per_node"] == "2")
    sizes, ms = zip(*points)
    gpu = _cost_model(2, "gpu")
    assert gpu.send_source == "measured: a100_dgx send_recv on 2 GPUs"
    for tokens in (1, 100, 2000):
        assert gpu.send_s(tokens) == pytest.approx(
            np.interp(tokens * per_token, sizes, ms) * 1e-3, rel=1e-9)
    roofline = _cost_model(2)
    whole = _cost_model(1)
    assert roofline.send_source.startswith("roofline")
    hardware = hardware_spec("a100-80gb")
    rate = hardware.interconnect_gbps * 1e9 * whole.transfer_efficiency
    assert roofline.send_s(100) == pytest.approx(
        whole.allreduce_latency_s + 100 * per_token / rate, rel=1e-12)
    # Beyond the precomputed counts, linear (the roofline's slope is exact).
    assert roofline.send_s(20000) == pytest.approx(
        whole.allreduce_latency_s + 20000 * per_token / rate, rel=1e-9)
    # With tensor parallelism each rank sends its share.
    assert send_bytes_per_token(model, 2) == per_token / 2



# ---- batches in flight -------------------------------------------------------------------------

class _TimedStages(pipelined_replica.Stages):
    """A pipelined replica's stages that keep their timeline (a run that plots keeps one)."""

    def __init__(self, *args, timeline=None):
        super().__init__(*args, timeline=[] if timeline is None else timeline)


def stage_timeline(replica) -> list:
    """The pipelined replica's stages' timeline, from its first engine's timing."""
    return replica.lanes[0].driver.timing.stages.timeline


def _run(pp: int, *overrides: str, monkeypatch=None, cost_model: str = "roofline"):
    if monkeypatch is not None:
        monkeypatch.setattr(pipelined_replica, "Stages", _TimedStages)
    cfg = make_cfg(f"cost_model={cost_model}", f"cluster.pipeline_parallel_size={pp}",
                   "cluster.frontend_latency_s=0", *overrides)
    return run_experiment(cfg, plots=False)


def _fixed(prompt_len: int, output_len: int) -> tuple[str, str]:
    return (f"++workload.prompt_len={{dist: fixed, value: {prompt_len}}}",
            f"++workload.output_len={{dist: fixed, value: {output_len}}}")


def _steps(timeline: list, pp: int) -> list[list[tuple]]:
    """The timeline's steps: per engine, its stage entries in order, pp at a time."""
    by_engine: dict[int, list] = {}
    for entry in timeline:
        by_engine.setdefault(entry[1], []).append(entry)
    steps = []
    for entries in by_engine.values():
        assert len(entries) % pp == 0
        steps += [entries[i:i + pp] for i in range(0, len(entries), pp)]
    return steps


def test_a_lone_sequence_gains_nothing_and_pays_the_sends(monkeypatch):
    """The bubble: one request's steps cross the stages one after another, each token the
    whole model's step plus a send per stage boundary, the next step entering the first stage
    as the last one's tokens come out."""
    prompt_len, output_len = 300, 6
    for pp in (2, 4):
        result = _run(pp, "workload.num_requests=1", *_fixed(prompt_len, output_len),
                      monkeypatch=monkeypatch)
        request, = result.requests
        whole, pipeline = _cost_model(1), result.replicas[0].executor.cost_model
        send = pipeline.send_s(1)
        assert request.first_token_time - request.arrival_time == pytest.approx(
            whole.step_time(_prefills(1, prompt_len)) + (pp - 1) * pipeline.send_s(prompt_len),
            rel=1e-12)
        decodes_s = sum(whole.step_time(StepPlan(num_decode_seqs=1,
                                                 decode_context_tokens=prompt_len + k))
                        + (pp - 1) * send for k in range(1, output_len))
        assert request.finish_time - request.first_token_time == pytest.approx(decodes_s,
                                                                               rel=1e-12)
        steps = _steps(stage_timeline(result.replicas[0]), pp)
        assert len(steps) == output_len
        for step in steps:   # (no stage waits for another engine)
            assert all(a[3] == b[2] for a, b in zip(step, step[1:]))


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_busy_engines_keep_the_slowest_stage_busy(pp, monkeypatch):
    """n equal compute-bound steps (one 1,024-token prompt each, all arriving at once, shared
    by pp engines): once the first step is through, the slowest stage works without pause, so
    the last token comes sum(stages) + (n - 1) x the slowest stage after the arrivals: one step
    per slowest stage's time, where pp = 1 takes the whole model's step for each."""
    n = 8 * pp
    result = _run(pp, f"workload.num_requests={n}", "workload.rate=inf", *_fixed(1024, 1),
                  "scheduler=chunked_prefill", "scheduler.max_num_batched_tokens=1024",
                  monkeypatch=monkeypatch)
    stage_s = result.replicas[0].executor.cost_model.stage_times(_prefills(1, 1024))
    makespan = max(r.finish_time for r in result.requests)
    assert makespan == pytest.approx(sum(stage_s) + (n - 1) * max(stage_s), rel=1e-9)
    # One replica at pp = 1 runs the same steps one at a time, sum(stages) less the sends each.
    one = _run(1, f"workload.num_requests={n}", "workload.rate=inf", *_fixed(1024, 1),
               "scheduler=chunked_prefill", "scheduler.max_num_batched_tokens=1024")
    assert max(r.finish_time for r in one.requests) == pytest.approx(
        n * _cost_model(1).step_time(_prefills(1, 1024)), rel=1e-9)


def _check_timeline(timeline: list, pp: int, metrics) -> None:
    """Each stage one step at a time; each engine's step through its stages in order and its
    next step after it; never more than pp steps in flight; each step's row from its entry into
    the first stage to its exit from the last."""
    for stage in range(pp):
        spans = sorted((start, end) for s, _, start, end in timeline if s == stage)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), f"stage {stage} overlaps"
    steps = _steps(timeline, pp)
    for step in steps:
        assert [entry[0] for entry in step] == list(range(pp))
        assert all(a[3] <= b[2] for a, b in zip(step, step[1:]))
    by_engine: dict[int, list] = {}
    for step in steps:
        by_engine.setdefault(step[0][1], []).append((step[0][2], step[-1][3]))
    for spans in by_engine.values():
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    events = sorted([(start, 1) for start, _ in sum(by_engine.values(), [])]
                    + [(end, -1) for _, end in sum(by_engine.values(), [])])
    in_flight = peak = 0
    for _, change in events:
        in_flight += change
        peak = max(peak, in_flight)
    assert 1 < peak <= pp
    rows = zip(metrics.step_column("start_time").tolist(), metrics.step_column("duration").tolist())
    assert sorted(rows) == sorted((step[0][2], step[-1][3] - step[0][2]) for step in steps)


@settings(max_examples=12, deadline=None)
@given(pp=st.sampled_from([2, 3]), seed=st.integers(0, 2**16),
       scheduler=st.sampled_from(["continuous", "chunked_prefill", "sjf predictor=oracle",
                                  "priority", "vtc"]),
       preemption=st.sampled_from(["recompute", "swap"]))
def test_runs_finish_every_request_once_and_free_every_block(pp, seed, scheduler, preemption):
    """Under memory pressure (each engine a third or half of 90 blocks): every request done
    once, every engine's blocks free, no engine's blocks past its share, the stages' timeline
    sound."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        result = _run(pp, "workload.num_requests=60", "workload.rate=30", f"seed={seed}",
                      "workload.prompt_len.max=300", "workload.output_len.max=200",
                      "kv_cache.num_blocks=90", f"preemption={preemption}",
                      *f"scheduler={scheduler}".split(), monkeypatch=monkeypatch)
    finished = [r.request_id for r in result.requests if r.finish_time is not None]
    replica, = result.replicas
    assert len(replica.schedulers) == pp
    for scheduler_of_engine in replica.schedulers:
        assert scheduler_of_engine.kv_cache.num_blocks == 90 // pp
        check_outcome(scheduler_of_engine, result.requests, finished)
    used = result.metrics.step_column("kv_blocks_used")
    assert used.max() <= pp * (90 // pp)
    _check_timeline(stage_timeline(replica), pp, result.metrics)


def test_requests_go_to_the_engine_with_the_fewest_unfinished(monkeypatch):
    """A long request on engine 0, a short one on engine 1; one arriving after the short one
    finished joins engine 1, the idle one (round robin would put it on engine 0)."""
    monkeypatch.setattr(pipelined_replica, "Stages", _TimedStages)
    requests = [Request(request_id=0, arrival_time=0.0, prompt_len=64, output_len=400),
                Request(request_id=1, arrival_time=0.0, prompt_len=64, output_len=2),
                Request(request_id=2, arrival_time=1.0, prompt_len=64, output_len=2)]
    result = run_experiment(make_cfg("cost_model=roofline", "cluster.pipeline_parallel_size=2",
                                     "cluster.frontend_latency_s=0"),
                            plots=False, requests=requests)
    assert result.requests[0].finish_time > 2.0 and result.requests[1].finish_time < 1.0
    late_engines = {engine for _, engine, start, _ in stage_timeline(result.replicas[0])
                    if 1.0 <= start < result.requests[2].finish_time}
    assert late_engines == {0, 1}


def test_each_engine_has_its_own_adapters_and_a_router_sees_the_next_engines():
    """With LoRA adapters every engine's scheduler has a LoRA manager of its own, its batches
    within max_loras; the replica shows a router the manager of the engine a request joins."""
    result = _run(2, "lora=multi", "scheduler=lora_affinity", "workload.num_requests=60",
                  "workload.rate=20")
    replica, = result.replicas
    managers = [scheduler.lora for scheduler in replica.schedulers]
    assert len({id(manager) for manager in managers}) == 2
    # One more request joins engine 0 (both idle: the first); the next would join engine 1.
    replica.submit(Request(request_id=99, arrival_time=0.0, prompt_len=16, output_len=2))
    assert replica.num_outstanding == replica.schedulers[0].num_outstanding == 1
    assert replica.lora is managers[1] and replica.kv_cache is replica.schedulers[1].kv_cache
    assert 0 < result.summary["lora_max_adapters_in_a_step"] <= managers[0].max_loras
    assert result.summary["lora_loads"] == sum(m.summary()["lora_loads"] for m in managers)


def test_energy_charges_each_stages_boards_for_its_busy_time(monkeypatch):
    """A stage's boards draw busy power while it works on a step and idle power otherwise:
    each stage's busy seconds are its timeline's; at a light load, mostly idle, twice the
    boards draw nearly twice the energy."""
    light = ("workload.num_requests=5", "workload.rate=0.05")
    result = _run(2, *light, monkeypatch=monkeypatch)
    replica, = result.replicas
    meter = replica.recorder.energy
    assert meter.num_boards == 2 * make_cfg().cluster.tensor_parallel_size
    for stage, stage_meter in enumerate(meter.stages):
        busy = sum(end - start for s, _, start, end in stage_timeline(replica) if s == stage)
        assert stage_meter.busy_s == pytest.approx(busy, rel=1e-9)
    one = _run(1, *light).summary
    assert 1.5 < result.summary["energy_j"] / one["energy_j"] < 2.0


def test_a_prefill_or_decode_pool_with_stages_is_refused():
    cfg = make_cfg("cost_model=roofline", "cluster=disaggregated",
                   "+cluster.pools.1.pipeline_parallel_size=2", "workload.num_requests=3")
    with pytest.raises(ValueError, match="cluster.pipeline_parallel_size=2 in the decode pool"):
        run_experiment(cfg, plots=False)


def test_stages_beside_an_expert_group_spanning_replicas_are_refused():
    cfg = make_cfg("cost_model=roofline", "model=mixtral-8x7b", "cluster.num_replicas=2",
                   "cluster.expert_parallel_size=2", "cluster.pipeline_parallel_size=2",
                   "workload.num_requests=3")
    with pytest.raises(ValueError, match="cluster.pipeline_parallel_size=2 with an expert group"):
        run_experiment(cfg, plots=False)


def test_light_load_same_throughput_longer_steps_heavy_load_overlaps():
    """The bubble end to end. Light load (one request at a time): pp=2 serves the same requests
    per second as pp=1 with slower tokens (the sends). Heavy compute-bound load at the same KV
    pool: pp=2's engines overlap its two stages, more than 1.5x the tokens per second."""
    light = ("workload.num_requests=20", "workload.rate=0.2")
    one, two = _run(1, *light).summary, _run(2, *light).summary
    assert two["request_throughput"] == pytest.approx(one["request_throughput"], rel=0.01)
    assert two["mean_tpot_ms"] > one["mean_tpot_ms"]
    heavy = ("workload.num_requests=200", "workload.rate=1000", "kv_cache.num_blocks=4000",
             "workload.prompt_len.mean=1800", "workload.prompt_len.min=1500",
             "workload.output_len.mean=3", "workload.output_len.min=2",
             "workload.output_len.max=4")
    one, two = _run(1, *heavy).summary, _run(2, *heavy).summary
    assert two["output_throughput"] > 1.5 * one["output_throughput"]
