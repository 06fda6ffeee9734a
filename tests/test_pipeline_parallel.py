"""Pipeline parallelism (sim/core/pipeline.py): the stages' split, the per-GPU KV capacity, the
step's cost over micro-batches and its bubble, the stage sends, and whole runs' invariants."""
from __future__ import annotations

import csv

import numpy as np
import pytest

from factories import (REPO, assert_same_run, check_outcome, hardware_spec, make_cfg, model_spec,
                       run_both_ways)
from policies.types import StepPlan
from sim.core.assembly import build_preemption
from sim.core.build import build_cost_model, kv_cache_sizes, num_kv_blocks
from sim.core.cluster import build_pools
from sim.core.experiment import run_experiment
from sim.core.pipeline import (PipelineCostModel, pipeline_period_s, send_bytes_per_token,
                               stage_layers, stage_model)
from sim.core.roofline import RooflineCostModel
from sim.core.specs import GIB, activation_peak_bytes, step_token_budget


def _cost_model(pp: int, cost_model: str = "roofline"):
    cfg = make_cfg(f"cost_model={cost_model}", f"cluster.pipeline_parallel_size={pp}")
    return build_cost_model(cfg, model_spec("llama-2-7b"), hardware_spec("a100-80gb"))


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
        num_kv_blocks(cfg, model_spec("llama-2-7b"), hardware_spec("a100-80gb"))


def test_speculation_and_other_cost_models_are_refused():
    cfg = make_cfg("cluster.pipeline_parallel_size=2", "speculation=fixed")
    with pytest.raises(ValueError, match="cluster.pipeline_parallel_size=2 with speculative"):
        build_cost_model(cfg, model_spec("llama-2-7b"), hardware_spec("a100-80gb"))
    cfg = make_cfg("cluster.pipeline_parallel_size=2", "cost_model=profiled",
                   f"cost_model.profile={REPO / 'profiles/cpu/tiny-llama.json'}",
                   "model=tiny-llama", "hardware=cpu")
    with pytest.raises(ValueError, match="needs cost_model=roofline or gpu"):
        build_cost_model(cfg, model_spec("tiny-llama"), hardware_spec("cpu"))


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
    assert num_kv_blocks(cfg, model, hardware) == expected
    # More than twice the one-stage pool: half the KV per block and half the weights.
    assert expected > 2 * num_kv_blocks(make_cfg(), model, hardware)


def test_host_pools_hold_a_stages_share_of_each_block():
    """Swap space and the prefix cache's host tier are GiB per GPU: a stage's block is half
    of Llama-2-7B's at pp=2, so each holds twice the blocks."""
    model = model_spec("llama-2-7b")
    sizes = {}
    for pp in (1, 2):
        cfg = make_cfg(f"cluster.pipeline_parallel_size={pp}", "preemption=swap",
                       "kv_cache.offload_gb=3")
        sizes[pp] = kv_cache_sizes(cfg, model, 100, build_preemption(cfg.preemption), None)
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
        build_pools(cfg, model)
    cfg = make_cfg("cluster=disaggregated", "+cluster.pools.1.pipeline_parallel_size=2")
    prefill, decode = build_pools(cfg, model)
    too_many = make_cfg("cluster=disaggregated", "+cluster.pools.1.pipeline_parallel_size=40")
    with pytest.raises(ValueError, match=r"cluster.pools\[1\].pipeline_parallel_size=40 exceeds"):
        build_pools(too_many, model)
    hardware = hardware_spec("a100-80gb")
    assert prefill.num_kv_blocks == num_kv_blocks(make_cfg(), model, hardware)
    assert decode.num_kv_blocks == num_kv_blocks(make_cfg("cluster.pipeline_parallel_size=2"),
                                                 model, hardware)


# ---- the step's cost -----------------------------------------------------------------------------

def _event_simulated_period(stage_s: list[float], num_micro_batches: int, rounds: int = 60):
    """The reference: micro-batches cycling through stages event by event, each stage one at a
    time in arrival order, each micro-batch re-entering the first stage when it has left the
    last. The mean time between rounds once the pipeline has filled."""
    stage_free = [0.0] * len(stage_s)
    ready = [0.0] * num_micro_batches   # when each micro-batch's tokens are back
    round_ends = []
    for _ in range(rounds):
        for j in range(num_micro_batches):
            t = ready[j]
            for s, duration in enumerate(stage_s):
                t = max(t, stage_free[s]) + duration
                stage_free[s] = t
            ready[j] = t
        round_ends.append(max(ready))
    half = rounds // 2
    return (round_ends[-1] - round_ends[half]) / (rounds - 1 - half)


@pytest.mark.parametrize("stage_s", [[1.0, 1.0], [1.0, 3.0, 2.0], [0.5, 0.5, 0.5, 2.0],
                                     [2.0, 1.0, 1.0, 1.0]])
def test_the_period_is_an_event_simulations(stage_s):
    for m in range(1, len(stage_s) + 1):
        assert pipeline_period_s(sum(stage_s), max(stage_s), m) == pytest.approx(
            _event_simulated_period(stage_s, m), rel=1e-9)


def test_a_lone_sequence_gains_nothing_and_pays_the_sends():
    """The bubble: one sequence is one micro-batch; it crosses every stage in turn, so the step
    is the whole model's plus a send per stage boundary, whatever pp."""
    base = _cost_model(1)
    for pp in (2, 4):
        pipeline = _cost_model(pp)
        for plan in (_decodes(1), _prefills(1, 2048)):
            tokens = plan.num_prefill_tokens + plan.num_decode_seqs
            assert pipeline.step_time(plan) == pytest.approx(
                base.step_time(plan) + (pp - 1) * pipeline.send_s(tokens), rel=1e-12)
            assert pipeline.send_s(tokens) > 0


def test_micro_batches_overlap_the_stages_when_compute_bound():
    """Eight 1024-token prompts: compute-bound, so two stages each working on one half of the
    batch while the other works on the other halve the step (about: overheads and sends)."""
    base, pipeline = _cost_model(1), _cost_model(2)
    plan = _prefills(8, 1024)
    assert 0.45 < pipeline.step_time(plan) / base.step_time(plan) < 0.6
    # Memory-bound decodes: every micro-batch reads its stage's weights, so no gain.
    decodes = _decodes(8)
    assert pipeline.step_time(decodes) >= base.step_time(decodes)


def test_the_step_is_the_slower_of_latency_and_the_slowest_stage():
    pipeline = _cost_model(4)
    whole, stage = pipeline.whole, pipeline.stage
    assert stage.model.num_layers == 8
    for plan in (_decodes(64), _prefills(4, 512), _decodes(3)):
        m = min(4, plan.num_prefill_seqs + plan.num_decode_seqs)
        micro = StepPlan(
            num_prefill_seqs=-(-plan.num_prefill_seqs // m),
            num_prefill_tokens=-(-plan.num_prefill_tokens // m),
            prefill_attention_work=-(-plan.prefill_attention_work // m),
            prefill_context_tokens=-(-plan.prefill_context_tokens // m),
            sum_squared_prefill_chunks=-(-plan.sum_squared_prefill_chunks // m),
            num_decode_seqs=-(-plan.num_decode_seqs // m),
            decode_context_tokens=-(-plan.decode_context_tokens // m))
        send = pipeline.send_s(micro.num_prefill_tokens + micro.num_decode_seqs)
        assert pipeline.step_time(plan) == max(whole.step_time(micro) + 3 * send,
                                               m * (stage.step_time(micro) + send))


def test_memory_operations_move_a_stages_share_of_each_block():
    pipeline = _cost_model(2)
    swaps = [(i, i) for i in range(10)]
    plan = _decodes(4)
    with_swaps = _decodes(4)
    with_swaps.blocks_to_swap_in = swaps
    whole = pipeline.whole
    whole_swaps_s = whole.step_time(StepPlan(blocks_to_swap_in=swaps)) - whole.step_overhead_s
    added = pipeline.step_time(with_swaps) - pipeline.step_time(plan)
    assert added == pytest.approx(whole_swaps_s / 2, rel=1e-9)
    # A step of swaps alone costs the stage's overhead and its share.
    assert pipeline.step_time(StepPlan(blocks_to_swap_in=swaps)) == pytest.approx(
        whole.step_overhead_s + whole_swaps_s / 2, rel=1e-9)
    assert pipeline.step_time(StepPlan()) == 0.0


def test_lora_work_is_shared_and_adapter_loads_move_a_stages_share():
    """Adapter matmuls split with the tokens, every micro-batch reads the step's adapters, and
    an adapter load moves the stage's layers of it (half of Llama-2-7B's at pp=2)."""
    lora = {"ranks": (16,), "target_modules": ("q_proj", "v_proj")}
    cfg = make_cfg("cost_model=roofline", "cluster.pipeline_parallel_size=2")
    pipeline = build_cost_model(cfg, model_spec("llama-2-7b"), hardware_spec("a100-80gb"),
                                lora=lora)
    plan = _decodes(8)
    with_lora = _decodes(8)
    with_lora.num_loras, with_lora.lora_rank_sum, with_lora.lora_token_rank_sum = 2, 32, 8 * 16
    assert pipeline.step_time(with_lora) > pipeline.step_time(plan)
    with_load = _decodes(8)
    with_load.num_loras, with_load.lora_rank_sum, with_load.lora_token_rank_sum = 2, 32, 8 * 16
    with_load.lora_to_load, with_load.lora_load_rank_sum = ((1, 0),), 16
    whole = pipeline.whole
    whole_load_s = (whole.step_time(with_load) - whole.step_time(with_lora))
    assert whole_load_s > 0
    assert pipeline.step_time(with_load) - pipeline.step_time(with_lora) == pytest.approx(
        whole_load_s / 2, rel=1e-9)


def test_energy_counts_every_gpu_and_each_stages_work():
    """A replica of pp stages is tp x pp boards, each doing its stage's work on every
    micro-batch; at a light load, mostly idle, twice the boards draw nearly twice the
    energy."""
    pipeline = _cost_model(2)
    plan = _prefills(4, 512)
    stage_flops, stage_bytes = pipeline.stage.step_work(StepPlan(
        num_prefill_seqs=2, num_prefill_tokens=1024, prefill_attention_work=2 * 512 * 512,
        prefill_context_tokens=1024, sum_squared_prefill_chunks=2 * 512 * 512))
    assert pipeline.step_work(plan) == pytest.approx((2 * stage_flops, 2 * stage_bytes))
    light = ("workload.num_requests=5", "workload.rate=0.05")
    one, two = _run(1, *light).summary, _run(2, *light).summary
    assert 1.5 < two["energy_j"] / one["energy_j"] < 2.0


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
    assert roofline.send_source.startswith("roofline")
    hardware = hardware_spec("a100-80gb")
    rate = hardware.interconnect_gbps * 1e9 * roofline.whole.transfer_efficiency
    assert roofline.send_s(100) == pytest.approx(
        roofline.whole.allreduce_latency_s + 100 * per_token / rate, rel=1e-12)
    # Beyond the precomputed counts, linear (the roofline's slope is exact).
    assert roofline.send_s(20000) == pytest.approx(
        roofline.whole.allreduce_latency_s + 20000 * per_token / rate, rel=1e-9)
    # With tensor parallelism each rank sends its share.
    assert send_bytes_per_token(model, 2) == per_token / 2


# ---- whole runs ----------------------------------------------------------------------------------

def _run(pp: int, *overrides: str):
    cfg = make_cfg("cost_model=roofline", f"cluster.pipeline_parallel_size={pp}", *overrides)
    return run_experiment(cfg, plots=False)


@pytest.mark.parametrize("pp", [2, 3])
def test_runs_finish_every_request_once_and_free_every_block(pp):
    """Under memory pressure (preemption by swap and recompute) and chunked prefill."""
    for preemption in ("recompute", "swap"):
        result = _run(pp, "workload.num_requests=120", "workload.rate=40",
                      "kv_cache.num_blocks=60", f"preemption={preemption}",
                      "scheduler=chunked_prefill")
        finished = [r.request_id for r in result.requests if r.finish_time is not None]
        for replica in result.replicas:
            check_outcome(replica.scheduler, result.requests, finished)
        assert result.summary["num_preemptions"] > 0


def test_repeated_decode_steps_run_as_step_by_step(monkeypatch):
    """Runs of repeated decode steps cost each step as step_time would (the pipeline's
    repeated_step_times), so a run with them equals one without."""
    overrides = ["cost_model=gpu", "cluster.pipeline_parallel_size=2", "workload.num_requests=150",
                 "workload.rate=20"]
    coalesced, step_by_step, repeated_runs = run_both_ways(overrides, monkeypatch)
    assert_same_run(coalesced, step_by_step)
    assert max(repeated_runs) > 1


def test_light_load_same_throughput_longer_steps_heavy_load_overlaps():
    """The bubble end to end. Light load (one request at a time): pp=2 serves the same requests
    per second as pp=1 with slower tokens (the sends). Heavy compute-bound load at the same KV
    pool: pp=2's micro-batches overlap its two stages, more than 1.5x the tokens per second."""
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
