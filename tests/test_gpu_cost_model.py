"""The GPU cost model (sim/cost/gpu/): measured table points reproduced, the transfer rule, attention
against hand arithmetic, all-reduces, O(1) steps and the repeated-steps shortcut. No wall-clock."""
import csv
import dataclasses
from pathlib import Path

import hydra.utils
import numpy as np
import pytest
from omegaconf import OmegaConf

from policies.types import Request, Sequence, StepPlan
from sim.cost.gpu.attention import fit_table
from sim.cost.gpu.collectives import allreduce_cost
from sim.cost.gpu.cost_model import GPUCostModel
from sim.cost.gpu.cuda_graphs import cuda_graph_capture_sizes
from sim.cost.gpu.linear import kernel_floor_ms, predict_layer_ms, predict_op_ms
from sim.cost.gpu.tables import DATA_DIR, LAYER_OPS, attention_tables, op_tables

from factories import decode_plan, hardware_spec, model_spec

CONF = Path(__file__).resolve().parent.parent / "conf"


def gpu_model(model: str, hardware, tp: int = 1, **kwargs) -> GPUCostModel:
    hw = hardware_spec(hardware) if isinstance(hardware, str) else hardware
    return GPUCostModel(model_spec(model), hw, tp, **kwargs)


def vidur_model(model: str, hardware, tp: int = 1, **kwargs) -> GPUCostModel:
    """The Vidur/Frontier operator tables' path (kernel_tables=vidur), whose arithmetic the
    table-point tests below check against the CSVs."""
    return gpu_model(model, hardware, tp, kernel_tables="vidur", **kwargs)


def csv_row(path: str, num_tokens: int, tp: int) -> dict:
    with open(DATA_DIR / path, newline="") as file:
        return next(r for r in csv.DictReader(file)
                    if int(r["num_tokens"]) == num_tokens and int(r["num_tensor_parallel_workers"]) == tp)


def prefill_plan(chunk: int, cached: int) -> StepPlan:
    return StepPlan(num_prefill_tokens=chunk, num_prefill_seqs=1,
                    prefill_attention_work=chunk * (cached + chunk),
                    prefill_context_tokens=cached + chunk, sum_squared_prefill_chunks=chunk ** 2)


def ms(row: dict, op: str) -> float:
    return float(row[f"time_stats.{op}.median"])


def test_exact_table_point_is_the_csv_sum_of_ops_times_layers():
    model = vidur_model("llama-3-8b", "a100-80gb")
    row = csv_row("vidur/a100/Meta-Llama-3-8B/mlp.csv", 256, 1)  # measured once, a capture size
    by_hand = 32 * sum(ms(row, op) for op in LAYER_OPS) + ms(row, "emb") + ms(row, "input_layernorm")
    assert model.forward_kernels_s(256) == pytest.approx(by_hand * 1e-3, rel=1e-12)
    assert model.linear_transfer_kind == "measured"
    assert model.expected_errors["linear"]["measured"] < 5


def test_llama_3_1_8b_reads_the_llama_3_8b_table():
    assert vidur_model("llama-3.1-8b", "a100-80gb").describe()["linear"].startswith(
        "measured: a100/Meta-Llama-3-8B tp1")


def test_monotone_in_tokens_and_context():
    model = gpu_model("llama-2-7b", "h100-80gb")
    times = [model.step_time(decode_plan(n, 500)) for n in (1, 64, 256, 512, 1024, 4096, 8192, 20000)]
    assert times == sorted(times) and len(set(times)) == len(times)
    contexts = [model.step_time(decode_plan(32, c)) for c in (100, 1000, 4000)]
    assert contexts[0] < contexts[1] < contexts[2]
    prefills = [model.step_time(prefill_plan(512, cached)) for cached in (0, 1024, 4096)]
    assert prefills[0] < prefills[1] < prefills[2]


def test_transfer_to_the_reference_itself_reproduces_it():
    table = next(t for t in op_tables() if t.name == "h100/Llama-2-70b-hf tp4")
    tokens = np.array(table.tokens, dtype=float)
    for op in LAYER_OPS:
        predicted = predict_op_ms(table, op, tokens, table.hardware, table.shape, 4, 2)
        assert predicted.tolist() == list(table.op_ms[op])


def test_transfer_scales_by_bandwidth_when_memory_bound():
    table = next(t for t in op_tables() if t.name == "a100/Llama-2-7b-hf tp1")
    faster = dataclasses.replace(table.hardware, name="faster-hbm",
                                 memory_bandwidth_gbps=1.5 * table.hardware.memory_bandwidth_gbps)
    one_token = np.array([1.0])
    measured = predict_layer_ms(table, one_token, table.hardware, table.shape, 1, 2)[0]
    predicted = predict_layer_ms(table, one_token, faster, table.shape, 1, 2)[0]
    # Each kernel keeps its latency floor and moves the rest by the bandwidth ratio.
    floor = kernel_floor_ms(table)
    floors = sum(min(floor, table.op_ms[op][0]) for op in LAYER_OPS)
    assert predicted == pytest.approx(floors + (measured - floors) / 1.5, rel=1e-9)
    assert predicted > measured / 1.5
    # Compute-bound (4,096 tokens): the FLOP rate is unchanged, so the GEMMs barely move.
    big = np.array([4096.0])
    assert (predict_op_ms(table, "mlp_up_proj", big, faster, table.shape, 1, 2)[0]
            == pytest.approx(predict_op_ms(table, "mlp_up_proj", big, table.hardware, table.shape, 1, 2)[0]))


def test_attention_against_hand_numbers_and_the_measurements():
    # Llama-2-70B TP2 on the A100: the attention table's own GPU, shape and backend.
    model = vidur_model("llama-2-70b", "a100-80gb", 2, step_overhead_s=0, per_sequence_overhead_s=0)
    fit = fit_table(next(t for t in attention_tables() if t.name == "a100/Llama-2-70b-hf tp2"))
    kv_bytes_per_token, flops_per_pair = 2 * 4 * 128 * 2, 4 * 32 * 128  # 4 KV, 32 q heads a GPU
    decode = decode_plan(64, 1024)
    decode_attention = (model.step_time(decode) - model.forward_kernels_s(64)
                        - model.lm_head_kernels_s(64))
    by_hand = 80 * (fit.decode_fixed_s + 64 * 1024 * kv_bytes_per_token * fit.decode_s_per_byte
                    + 64 * fit.decode_s_per_seq)
    assert decode_attention == pytest.approx(by_hand, rel=1e-9)
    prefill = prefill_plan(1024, 2048)
    prefill_attention = (model.step_time(prefill) - model.forward_kernels_s(1024)
                         - model.lm_head_kernels_s(1))
    by_hand = 80 * (fit.prefill_fixed_s + flops_per_pair * (
        1024 * 2048 * fit.prefill_s_per_context_flop + 1024 ** 2 / 2 * fit.prefill_s_per_causal_flop))
    assert prefill_attention == pytest.approx(by_hand, rel=1e-9)
    # Against the table's rows (ms per layer): decode b64 kv1024 0.122, prefill 1024 after 2048 0.421.
    assert decode_attention / 80 * 1e3 == pytest.approx(0.122, rel=0.2)
    assert prefill_attention / 80 * 1e3 == pytest.approx(0.421, rel=0.2)


def test_allreduce_only_with_tensor_parallelism():
    tp2 = vidur_model("llama-2-70b", "a100-80gb", 2)
    row = csv_row("vidur/a100/Llama-2-70b-hf/mlp.csv", 256, 2)
    kernels = (80 * sum(ms(row, op) for op in LAYER_OPS) + ms(row, "emb") + ms(row, "input_layernorm")) * 1e-3
    allreduce = 2 * 80 * allreduce_cost(tp2.hardware, 2).seconds(np.array([256.0 * 8192 * 2]))[0]
    assert allreduce > 0
    assert tp2.forward_kernels_s(256) == pytest.approx(kernels + allreduce, rel=1e-9)
    assert "measured: a100_dgx all_reduce on 2 GPUs" == tp2.describe()["allreduce"]
    assert vidur_model("llama-2-70b", "a100-80gb", 1).describe()["allreduce"].startswith("none")


def test_step_reads_only_aggregates():
    model = gpu_model("llama-3-8b", "a100-80gb")
    plan = StepPlan()
    seqs = []
    for i in range(40):
        seq = Sequence(i, Request(i, 0.0, 499, 16), num_output_tokens=1)
        seq.num_computed_tokens = 499
        seqs.append(seq)
    plan.add_decodes(seqs)
    assert plan.num_decode_seqs == 40 and plan.seqs
    assert model.step_time(plan) == model.step_time(decode_plan(40, 500))


@pytest.mark.parametrize("num_decodes", [3, 200, 700])  # padded graph, graph, eager
def test_repeated_step_times_equal_step_time_step_by_step(num_decodes):
    model = gpu_model("llama-2-7b", "a100-80gb", eager_launch_overhead_s_per_layer=2e-3)
    plan = decode_plan(num_decodes, 20)
    repeated = list(model.repeated_step_times(plan, 5))
    one_by_one = [model.step_time(decode_plan(num_decodes, 20 + step)) for step in range(5)]
    assert repeated == one_by_one


def test_cuda_graph_pads_and_eager_pays_launches():
    assert cuda_graph_capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    model = gpu_model("llama-2-7b", "a100-80gb", eager_launch_overhead_s_per_layer=2e-3)
    assert model.forward_kernels_s(17) == model.forward_kernels_s(24)
    assert model.forward_kernels_s(513) != model.forward_kernels_s(520)
    # Eager above 512 tokens: 32 layers x 2 ms of launches outpace these kernels (~40 ms);
    # 512 tokens replay a graph and pay kernels only.
    assert model.step_time(decode_plan(513, 10)) == pytest.approx(
        model.step_overhead_s + model.per_sequence_overhead_s * 513 + 64e-3)
    assert model.step_time(decode_plan(512, 10)) < 0.064   # below the 32 x 2 ms of launches


def test_describe_names_the_sources_of_a_transfer():
    h200 = vidur_model("llama-2-7b", "h200").describe()
    assert h200["linear"].startswith("predicted from h100/Llama-2-7b-hf tp1 (h100-80gb) by bandwidth")
    assert "to h200 by bandwidth and FLOP ratios" in h200["attention"]
    thirteen = vidur_model("llama-2-13b", "a100-80gb")
    assert thirteen.describe()["linear"].startswith("predicted from a100/")
    assert thirteen.linear_transfer_kind == "shape"
    assert thirteen.expected_errors["linear"]["shape"] < thirteen.expected_errors["linear"]["gpu"]
    # The A800 is the A100's chip: its 70B comes from the A100's 70B table, not its own 7B one.
    a800 = vidur_model("llama-2-70b", "a800-80gb")
    assert a800.describe()["linear"].startswith("predicted from a100/Llama-2-70b-hf tp1 (a100-80gb) same chip")
    assert a800.forward_kernels_s(64) == vidur_model("llama-2-70b", "a100-80gb").forward_kernels_s(64)


def test_bad_config_names_the_key():
    with pytest.raises(ValueError, match="GPUCostModel.step_overhead_s"):
        gpu_model("llama-2-7b", "a100-80gb", step_overhead_s=-1)
    with pytest.raises(ValueError, match="GPUCostModel.attention_backend"):
        gpu_model("llama-2-7b", "a100-80gb", attention_backend="TRITON")
    with pytest.raises(ValueError, match="GPUCostModel.cuda_graph_max_tokens"):
        gpu_model("llama-2-7b", "a100-80gb", cuda_graph_max_tokens=100_000)
    with pytest.raises(ValueError, match="hardware=cpu: no GPU operator table covers cpu"):
        gpu_model("tiny-llama", "cpu")


def test_config_file_builds_it():
    config = OmegaConf.load(CONF / "cost_model" / "gpu.yaml")

    def build(**overrides) -> GPUCostModel:
        return hydra.utils.instantiate(
            OmegaConf.merge(config, overrides),
            model=OmegaConf.load(CONF / "model" / "llama-2-7b.yaml"),
            hardware=OmegaConf.load(CONF / "hardware" / "h100-80gb.yaml"), tensor_parallel_size=2)
    model = build()
    assert isinstance(model, GPUCostModel) and model.block_size == 16
    # The shipped default: vLLM 0.19's own kernels and its fitted engine terms.
    assert model.describe()["linear"].startswith(
        "h100_sxm (measured), vLLM 0.19.0 (default engine_version)")
    assert model.step_overhead_s > 0 and model.per_sequence_overhead_s > 0
    assert build(kernel_tables="vidur").describe()["linear"].startswith(
        "measured: h100/Llama-2-7b-hf tp2")


def test_decode_attention_grid_along_a_run_is_the_lookup_at_each_step():
    """A run of repeated steps reads the grid along the batch's row: each step's seconds
    are bilinear between the measured (batch, mean context) points, in proportion past the
    grid's last context, the same floats a lookup per step gives."""
    from itertools import islice

    from sim.cost.gpu.vllm_kernels import DecodeAttentionGrid

    grid = DecodeAttentionGrid(heads=(8, 8, 128), batch=(1.0, 4.0, 16.0),
                               context=(128.0, 1024.0, 4096.0),
                               seconds=((1.0, 3.0, 9.0), (2.0, 7.0, 20.0), (5.0, 15.0, 50.0)))

    def by_hand(num_decodes, context_tokens):
        # batch 8 lies a third of the way from 4 to 16; the mean context as given
        mean = context_tokens / num_decodes
        low_row, high_row = grid.seconds[1], grid.seconds[2]
        if mean >= 4096.0:
            return (low_row[2] + (8.0 - 4.0) / 12.0 * (high_row[2] - low_row[2])) * mean / 4096.0
        upper = 1 if mean <= 1024.0 else 2
        weight = (mean - grid.context[upper - 1]) / (grid.context[upper] - grid.context[upper - 1])
        low = low_row[upper - 1] + weight * (low_row[upper] - low_row[upper - 1])
        high = high_row[upper - 1] + weight * (high_row[upper] - high_row[upper - 1])
        return low + (8.0 - 4.0) / 12.0 * (high - low)

    start = 8 * 1000   # mean context 1,000, then 1,001, ... past 1,024 and past 4,096
    contexts = [start + step * 8 for step in range(0, 3200, 97)]
    along = list(islice(grid.along_run(8, start), 0, 3200, 97))
    assert along == [by_hand(8, context) for context in contexts]
    assert along == [grid(8, context) for context in contexts]
    assert grid(1, 128) == 1.0 and grid(16, 16 * 4096) == 50.0   # measured points


def test_swaps_copies_and_drafting_cost_what_they_cost_the_roofline():
    """The GPU cost model shares the roofline's memory operations and drafting (composed, not
    inherited): at the same efficiencies they add the same seconds to a step."""
    from sim.cost.roofline import RooflineCostModel
    model, hardware = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    settings = dict(transfer_efficiency=0.6, memory_efficiency=0.7, draft_model="ngram",
                    ngram_overhead_s_per_seq=1e-4)
    gpu, roofline = GPUCostModel(model, hardware, **settings), RooflineCostModel(model, hardware,
                                                                                **settings)
    plain, busy = decode_plan(8, 500), decode_plan(8, 500)
    busy.blocks_to_swap_in, busy.blocks_to_copy = [(1, 2), (3, 4)], [(5, 6)]
    busy.spec_lens = {0: 2, 1: 2}
    busy.num_draft_tokens, busy.max_draft_len = 4, 2
    for cost_model in (gpu, roofline):
        assert cost_model.draft_time(busy) == pytest.approx(2 * 1e-4)
    plain.num_draft_tokens, plain.max_draft_len = 4, 2
    added = [cost_model.step_time(busy) - cost_model.step_time(plain)
             for cost_model in (gpu, roofline)]
    assert added[0] == pytest.approx(added[1], rel=1e-9) and added[0] > 2e-4
