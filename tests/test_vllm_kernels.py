"""The GPU cost model's default kernels, vLLM's own per version (sim/cost/gpu/vllm_tables.py,
vllm_kernels.py): GEMM table points and their interpolation, which measured version a run gets,
the fallback where none was measured, the all-reduce's graph/eager/NCCL regimes against the
tables read here, fp8 weights and KV cache, the engine terms per version, and a step that only
preempts. No wall-clock."""
from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow.parquet as pq
import pytest

import sim.core.say_once as say_once_module
from policies.types import Request, Sequence, StepPlan
from sim.cost.roofline import RooflineCostModel
from runtime.kv_sizing import kv_cache_num_blocks
import sim.cost.gpu.engine_terms as engine_terms_module
from sim.cost.gpu.cost_model import GPUCostModel
from sim.cost.gpu.engine_terms import engine_terms
from sim.cost.gpu.vllm_tables import (TABLES_DIR, GemmGrid, _repair_isolated_slow_points, gemm_grid,
                                 nearest_version, resolve_version)

from factories import decode_plan, hardware_spec, model_spec

H100_GEMMS = TABLES_DIR / "h100_sxm" / "gemm" / "vllm" / "0.19.0" / "gemm_perf.parquet"


def read_table(path) -> dict[str, np.ndarray]:
    table = pq.read_table(path)
    return {name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}


def decode_step(num_seqs: int, context_len: int) -> StepPlan:
    """A decode step of real sequences (plan.seqs set), each `context_len` tokens long."""
    plan = StepPlan()
    seqs = []
    for i in range(num_seqs):
        seq = Sequence(i, Request(i, 0.0, context_len - 1, 16), num_output_tokens=1)
        seq.num_computed_tokens = context_len - 1
        seqs.append(seq)
    plan.add_decodes(seqs)
    return plan


@pytest.fixture(scope="module")
def llama():
    return model_spec("llama-2-7b")


@pytest.fixture(scope="module")
def h100():
    return hardware_spec("h100-80gb")


@pytest.fixture(scope="module")
def h100_default(llama, h100):
    return GPUCostModel(llama, h100)


@pytest.fixture(scope="module")
def h100_tp2(llama, h100):
    return GPUCostModel(llama, h100, 2)


@pytest.fixture(scope="module")
def gemm_rows():
    return read_table(H100_GEMMS)


# ---- GEMMs ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_a_measured_gemm_shape_is_the_tables_latency(gemm_rows, dtype):
    rows = np.flatnonzero(gemm_rows["gemm_dtype"] == dtype)
    grid = gemm_grid("h100_sxm", "0.19.0", dtype)
    for i in np.random.default_rng(7).choice(rows, 8, replace=False):
        m, n, k = (int(gemm_rows[c][i]) for c in ("m", "n", "k"))
        assert grid.latency_ms(np.array([m]), n, k)[0] == pytest.approx(
            gemm_rows["latency"][i], rel=1e-12), (m, n, k)


def test_between_two_measured_widths_the_gemm_is_between_their_latencies(gemm_rows):
    bf16 = gemm_rows["gemm_dtype"] == "bfloat16"
    measured = {(int(m), int(n), int(k)): float(ms) for m, n, k, ms in zip(
        gemm_rows["m"][bf16], gemm_rows["n"][bf16], gemm_rows["k"][bf16],
        gemm_rows["latency"][bf16])}
    widths = np.unique(gemm_rows["n"][bf16])
    grid = gemm_grid("h100_sxm", "0.19.0", "bfloat16")
    rng = np.random.default_rng(11)
    checked = 0
    for key in rng.permutation(sorted(measured)):
        m, n, k = (int(v) for v in key)
        j = int(np.searchsorted(widths, n))
        if j + 1 >= len(widths) or (m, int(widths[j + 1]), k) not in measured:
            continue
        low, high = measured[(m, n, k)], measured[(m, int(widths[j + 1]), k)]
        between = grid.latency_ms(np.array([m]), (n + int(widths[j + 1])) // 2, k)[0]
        assert min(low, high) <= between <= max(low, high), (m, n, k)
        checked += 1
        if checked == 10:
            break
    assert checked == 10


def test_bilinear_interpolation_is_exact_for_time_proportional_to_n_times_k():
    m, n, k = np.array([1.0, 2.0, 8.0]), np.array([64.0, 128.0, 512.0]), np.array([32.0, 256.0])
    a = 3e-7
    grid = GemmGrid(m, n, k, a * m[:, None, None] * n[None, :, None] * k[None, None, :])
    tokens = np.array([1.0, 3.0, 8.0, 16.0])   # on the grid, between, at its end, past it
    for width, depth in ((64, 32), (100, 96), (300, 200), (1024, 512)):   # last: past both ends
        np.testing.assert_allclose(grid.latency_ms(tokens, width, depth),
                                   a * tokens * width * depth, rtol=1e-12)



def test_a_lone_point_far_slower_than_its_width_neighbours_takes_their_rate():
    m, n, k = np.array([1.0, 8.0]), np.array([64.0, 128.0, 256.0, 512.0]), np.array([32.0, 64.0, 128.0])
    ms = 3e-7 * m[:, None, None] * n[None, :, None] * k[None, None, :]
    slow = ms.copy()
    slow[1, 1, 1] *= 2.0          # an interior point at half its neighbours' rate: a glitch
    slow[0, 2, 1] *= 1.2          # within GLITCH_RATIO of its neighbours: kept as measured
    slow[1, 3, 1] *= 2.0          # on the grid's edge in n (no neighbour past it): kept
    repaired = _repair_isolated_slow_points(m, n, k, slow)
    assert repaired[1, 1, 1] == pytest.approx(ms[1, 1, 1], rel=1e-12)
    assert repaired[0, 2, 1] == slow[0, 2, 1]
    assert repaired[1, 3, 1] == slow[1, 3, 1]


def test_the_h100_0_14_glitch_does_not_reach_qwen3_32b_tp8_gate_up():
    """0.14.0 measured m 4,096 x n 6,144 x k 5,120 at 377 TFLOP/s beside 795-880 at its four
    (n, k) neighbours; Qwen3-32B's gate+up at TP8 (n 6,400) lies between n 6,144 and 7,168."""
    grid = gemm_grid("h100_sxm", "0.14.0", "bfloat16")
    rate = {n: 2 * 4096 * n * 5120 / grid.latency_ms(np.array([4096.0]), n, 5120)[0] / 1e9
            for n in (5120, 6144, 6400, 7168)}
    assert min(rate[5120], rate[7168]) / 1.3 < rate[6144] and rate[6400] > 700, rate

# ---- which version, which tables -----------------------------------------------------------------

@pytest.mark.parametrize("hardware, asked, used, nearest", [
    ("h100-80gb", "0.12", "0.14.0", True),
    ("h100-80gb", None, "0.19.0", False),
    ("h100-80gb", "0.24", "0.24.0", False),
    ("a100-80gb", "0.19", "0.14.0", True),
])
def test_the_nearest_measured_version_is_used_and_said(hardware, asked, used, nearest):
    _, version, why = resolve_version(hardware, asked)
    assert version == used
    assert ("nearest measured" in why) == nearest
    assert ("default engine_version" in why) == (asked is None)


def test_equally_near_versions_take_the_newer():
    assert nearest_version("0.9", ["0.8.0", "0.10.0"]) == "0.10.0"
    assert nearest_version("0.9.1", ["0.8.0", "0.9.0", "0.10.0"]) == "0.9.0"


def test_describe_names_the_system_and_version(llama, h100, h100_default):
    sources = h100_default.describe()
    for term in ("linear", "lm_head", "attention"):
        assert "h100_sxm" in sources[term] and "vLLM 0.19.0" in sources[term], term
    older = GPUCostModel(llama, h100, engine_version="0.12").describe()
    assert "vLLM 0.14.0" in older["linear"] and "nearest measured to 0.12" in older["linear"]
    assert "vLLM 0.14.0" in older["attention"]


def test_bad_settings_name_their_key(llama, h100):
    with pytest.raises(ValueError, match="cost_model.engine_version"):
        GPUCostModel(llama, h100, engine_version="latest")
    with pytest.raises(ValueError, match="GPUCostModel.kernel_tables.*'bogus'"):
        GPUCostModel(llama, h100, kernel_tables="bogus")


def test_hardware_without_tables_falls_back_to_vidur_saying_so_once(capsys, monkeypatch):
    monkeypatch.setattr(say_once_module, "_SAID", set())
    llama31, rtx = model_spec("llama-3.1-8b"), hardware_spec("rtx-4090")
    fallen = [GPUCostModel(llama31, rtx) for _ in range(2)]
    vidur = GPUCostModel(llama31, rtx, kernel_tables="vidur")
    assert fallen[0].kernels is None
    assert fallen[0].forward_kernels_s(64) == vidur.forward_kernels_s(64)
    assert "no vLLM kernel tables for hardware=rtx-4090" in fallen[1].kernel_source
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "hardware=rtx-4090" in lines[0]
    assert "cost_model.kernel_tables=vidur" in lines[0]


def test_a_kernel_the_tables_lack_falls_back_too(capsys, monkeypatch):
    """The A100's tables measure no fp8 KV cache: the run takes the Vidur tables, saying so,
    instead of failing."""
    monkeypatch.setattr(say_once_module, "_SAID", set())
    fp8_kv = dataclasses.replace(model_spec("llama-2-7b"), kv_cache_dtype="fp8")
    model = GPUCostModel(fp8_kv, hardware_spec("a100-80gb"))
    assert model.kernels is None and model.kernels_used == "Vidur/Frontier tables"
    assert "no context attention with a fp8 KV cache" in capsys.readouterr().err


# ---- the all-reduce ------------------------------------------------------------------------------

def allreduce_table(backend: str) -> tuple[np.ndarray, np.ndarray]:
    rows = read_table(TABLES_DIR / "h100_sxm" / "comm" / "vllm" / "0.19.0"
                      / "custom_allreduce_perf.parquet")
    keep = (rows["num_gpus"] == 2) & (rows["backend"] == backend)
    order = np.argsort(rows["message_size"][keep])
    return rows["message_size"][keep][order].astype(float), rows["latency"][keep][order]


def test_allreduce_graph_up_to_the_capture_size_eager_beyond_nccl_past_the_custom_limit(
        llama, h100_default, h100_tp2):
    assert h100_default.kernels.allreduce_ms(np.array([64.0, 600.0])).tolist() == [0.0, 0.0]
    assert h100_default.describe()["allreduce"].startswith("none")
    hidden = llama.hidden_size
    graph, eager = allreduce_table("vllm_graph"), allreduce_table("vllm_eager")
    assert 64 * hidden in graph[0]   # a measured size: the table's latency itself
    allreduce = h100_tp2.kernels.allreduce_ms
    assert allreduce(np.array([64.0]))[0] == pytest.approx(
        graph[1][graph[0] == 64 * hidden][0], rel=1e-12)
    # The last token count a CUDA graph covers (512, cuda_graph_max_tokens) and the first past it.
    for tokens, table in ((512, graph), (513, eager), (600, eager)):
        assert allreduce(np.array([float(tokens)]))[0] == pytest.approx(
            np.interp(tokens * hidden, *table), rel=1e-12), tokens
    # Two GPUs: the custom all-reduce takes up to 64 MiB; 16,384 tokens x 4,096 bf16 = 128 MiB
    # goes to NCCL, 8,192 tokens (64 MiB) stays custom (eager).
    nccl = read_table(sorted((TABLES_DIR / "h100_sxm" / "comm" / "nccl").glob(
        "*/nccl_perf.parquet"), key=lambda p: [int(v) for v in p.parent.name.split(".")])[-1])
    rows = ((nccl["op_name"] == "all_reduce") & (nccl["num_gpus"] == 2)
            & (nccl["nccl_dtype"] == "half") & (nccl["message_size"] == 16384 * hidden))
    assert rows.any()
    assert allreduce(np.array([16384.0]))[0] == pytest.approx(nccl["latency"][rows].mean(),
                                                              rel=1e-12)
    assert allreduce(np.array([8192.0]))[0] == pytest.approx(
        np.interp(8192 * hidden, *eager), rel=1e-12)
    assert "vLLM 0.19.0 custom all-reduce" in h100_tp2.describe()["allreduce"]


# ---- decode attention ----------------------------------------------------------------------------

def mixed_step(num_decodes: int, context_per_decode: int, chunk: int = 256) -> StepPlan:
    """A prompt chunk beside `num_decodes` decodes of `context_per_decode` tokens each."""
    return StepPlan(num_prefill_tokens=chunk, num_prefill_seqs=1,
                    prefill_attention_work=chunk * chunk, sum_squared_prefill_chunks=chunk * chunk,
                    prefill_context_tokens=chunk, num_decode_seqs=num_decodes,
                    decode_context_tokens=num_decodes * context_per_decode)


def context_cost_s(cost_model: GPUCostModel, plan_of) -> float:
    """Seconds 1,024 more tokens of each of 128 decodes' context add to the step `plan_of` makes."""
    return cost_model.step_time(plan_of(128, 2048)) - cost_model.step_time(plan_of(128, 1024))


@pytest.fixture(scope="module")
def qwen3_32b():
    return model_spec("qwen3-32b")


def test_decodes_beside_prompts_take_a_64_row_tile_per_query_head_under_flash_attention_2(
        qwen3_32b):
    """vLLM V1's FLASH_ATTN backend runs a step's prompts and decodes in one FlashAttention 2
    call, which packs a KV head's query heads only when every query is one token: beside a
    prompt chunk a decode costs a 64-row query tile per query head over its context, at the
    prefill rate, several times what the decode-only kernel reads (8 query heads a KV head)."""
    rtx = GPUCostModel(qwen3_32b, hardware_spec("rtx-pro-6000"), 2)
    prefill = rtx.kernels.prefill_attention()
    mixed = context_cost_s(rtx, mixed_step)
    assert mixed == pytest.approx(qwen3_32b.num_layers * 64 * 128 * 1024
                                  * prefill.prefill_s_per_context_pair, rel=1e-9)
    assert mixed > 2 * context_cost_s(rtx, decode_plan)
    assert "64-row query tile" in rtx.describe()["attention"]


@pytest.mark.parametrize("hardware, settings", [
    ("h100-80gb", {}),                                        # FlashAttention 3 packs them
    ("rtx-pro-6000", {"engine_version": "0.5.5"}),            # V0 ran decodes apart
    ("rtx-pro-6000", {"attention_backend": "FLASHINFER"}),    # a decode wrapper of their own
])
def test_decodes_beside_prompts_cost_what_they_cost_alone_elsewhere(qwen3_32b, hardware,
                                                                    settings):
    cost_model = GPUCostModel(qwen3_32b, hardware_spec(hardware), 2, **settings)
    assert context_cost_s(cost_model, mixed_step) == pytest.approx(
        context_cost_s(cost_model, decode_plan), rel=1e-9)

@pytest.mark.parametrize("batch", [8, 16, 64])
def test_few_heads_decode_at_least_as_fast_as_more_heads_over_a_split_context(h100, batch):
    """Qwen3-32B at TP8 holds 8 query heads and 1 KV head: split-KV runs it like 8m/m heads over
    a context m times shorter (the same bytes), so the grid takes the fastest measured split."""
    from sim.cost.gpu.vllm_kernels import VllmKernels
    qwen = model_spec("qwen3-32b")
    kernels = VllmKernels(qwen, h100, "h100_sxm", "0.14.0", 8, 512)
    rows = read_table(TABLES_DIR / "h100_sxm" / "attention" / "vllm" / "0.14.0"
                      / "generation_attention_perf.parquet")

    def measured_ms(query, kv, context):
        at = ((rows["num_heads"] == query) & (rows["num_key_value_heads"] == kv)
              & (rows["head_dim"] == 128) & (rows["kv_cache_dtype"] == "bfloat16")
              & (rows["batch_size"] == batch) & (rows["step"] + rows["isl"] == context))
        return float(rows["latency"][at][0])

    own = measured_ms(8, 1, 4096)
    fastest = min(measured_ms(8 * m, m, 4096 // m) for m in (1, 2, 4, 8))
    assert fastest < own
    grid = kernels.decode_attention_grid(qwen.num_layers)
    assert grid(batch, batch * 4096.0) == pytest.approx(fastest * 1e-3 * qwen.num_layers, rel=1e-9)


# ---- fp8 -----------------------------------------------------------------------------------------

def test_an_fp8_kv_cache_halves_the_bytes_and_doubles_the_pool(llama, h100):
    fp8 = dataclasses.replace(llama, kv_cache_dtype="fp8")
    assert fp8.kv_bytes_per_token * 2 == llama.kv_bytes_per_token
    assert fp8.kv_bytes_per_token_per_gpu(2) * 2 == llama.kv_bytes_per_token_per_gpu(2)
    assert kv_cache_num_blocks(fp8, h100, 16) == pytest.approx(
        2 * kv_cache_num_blocks(llama, h100, 16), abs=2)


def test_fp8_weights_halve_the_linear_layers_only(llama):
    fp8 = dataclasses.replace(llama, quantization="fp8")
    linear = llama.num_layers * llama.linear_parameters_per_layer
    # Embeddings, norms and the LM head keep their two bytes a parameter.
    assert fp8.weight_bytes == llama.weight_bytes - linear
    assert 0.5 < fp8.weight_bytes / llama.weight_bytes < 0.55


def test_fp8_weights_make_a_memory_bound_decode_faster(llama, h100, h100_default):
    fp8 = GPUCostModel(dataclasses.replace(llama, quantization="fp8"), h100)
    assert "(fp8)" in fp8.describe()["linear"]
    plan = decode_step(1, 512)
    assert 0 < fp8.step_time(plan) < 0.8 * h100_default.step_time(plan)


def test_an_fp8_kv_cache_reads_the_fp8_attention_rows(llama, h100, h100_default):
    fp8 = GPUCostModel(dataclasses.replace(llama, kv_cache_dtype="fp8"), h100)
    assert "fp8 KV cache" in fp8.describe()["attention"]
    assert "bfloat16 KV cache" in h100_default.describe()["attention"]
    # A long-context decode batch reads its cache: the fp8 cache's rows are faster.
    plan = decode_step(64, 4096)
    assert fp8.step_time(plan) < 0.9 * h100_default.step_time(plan)


# ---- engine terms and steps that only preempt ----------------------------------------------------

def test_engine_terms_are_the_nearest_versions_unless_given(llama, h100, h100_default,
                                                            monkeypatch):
    shipped = engine_terms_module._engine_terms_by_version()
    assert h100_default.step_overhead_s == shipped["0.19"]["step_overhead_s"] > 0
    assert h100_default.per_sequence_overhead_s == shipped["0.19"]["per_sequence_overhead_s"] > 0
    assert "engine_terms.json" in h100_default.describe()["engine"]
    given = GPUCostModel(llama, h100, step_overhead_s=1e-3, per_sequence_overhead_s=0.0)
    assert given.step_overhead_s == 1e-3 and given.per_sequence_overhead_s == 0.0
    versions = {"0.14": {"step_overhead_s": 1e-4, "per_sequence_overhead_s": 1e-6},
                "0.19": {"step_overhead_s": 2e-4, "per_sequence_overhead_s": 2e-6}}
    monkeypatch.setattr(engine_terms_module, "_engine_terms_by_version", lambda: versions)
    assert engine_terms("0.12")[0] == versions["0.14"]
    assert engine_terms(None)[0] == versions["0.19"]
    older = GPUCostModel(llama, h100, engine_version="0.12")
    assert older.step_overhead_s == 1e-4 and "vLLM 0.14 engine terms" in older.describe()["engine"]


def test_a_step_that_only_preempts_costs_the_overhead(llama, h100, h100_default):
    plan = StepPlan(preempted_recompute=[Request(0, 0.0, 100, 10)])
    assert not plan.seqs and not plan.is_empty
    assert h100_default.step_time(plan) == pytest.approx(h100_default.step_overhead_s)
    assert h100_default.step_time(plan) > 0
    roofline = RooflineCostModel(llama, h100)
    assert roofline.step_time(plan) == pytest.approx(roofline.step_overhead_s)
    assert roofline.step_time(plan) > 0
    assert h100_default.step_time(StepPlan()) == 0.0


def test_a_plan_of_aggregates_only_costs_its_tokens(h100_default):
    """draft_time, bench/ and the tests build plans from the aggregates alone (no seqs): the
    step still runs its tokens."""
    assert h100_default.step_time(decode_plan(8, 512)) == h100_default.step_time(
        decode_step(8, 512))


def test_a_step_time_is_a_python_float(h100_default):
    """The simulator's clock and the request times written from it stay plain floats."""
    for plan in (decode_step(8, 512), StepPlan(preempted_recompute=[Request(0, 0.0, 100, 10)])):
        assert type(h100_default.step_time(plan)) is float


# ---- expert parallelism --------------------------------------------------------------------------

def nccl_latency_ms(system: str, op: str, gpus: int, elements: int) -> float:
    nccl = read_table(sorted((TABLES_DIR / system / "comm" / "nccl").glob("*/nccl_perf.parquet"),
                             key=lambda p: [int(v) for v in p.parent.name.split(".")])[-1])
    rows = ((nccl["op_name"] == op) & (nccl["num_gpus"] == gpus) & (nccl["nccl_dtype"] == "half")
            & (nccl["message_size"] == elements))
    assert rows.any(), (op, elements)
    return float(nccl["latency"][rows].mean())


def test_data_parallel_experts_gather_and_scatter_every_ranks_tokens_on_the_boards_nccl():
    """vLLM's default all2all backend with data parallel + expert parallel: an all-gather of both
    ranks' hidden states and a reduce-scatter back; one replica's experts (ep <= tp) need none."""
    qwen, pro = model_spec("qwen3-30b-a3b"), hardware_spec("rtx-pro-6000")
    data_parallel = GPUCostModel(qwen, pro, 1, expert_parallel_size=2).kernels
    gathered = 64 * 2 * qwen.hidden_size   # 64 tokens a rank, two ranks
    assert data_parallel.expert_dispatch_ms(np.array([64.0]))[0] == pytest.approx(
        nccl_latency_ms("rtx_pro_6000_server", "all_gather", 2, gathered)
        + nccl_latency_ms("rtx_pro_6000_server", "reduce_scatter", 2, gathered), rel=1e-12)
    one_replica = GPUCostModel(qwen, pro, 2, expert_parallel_size=2).kernels
    assert one_replica.expert_dispatch_ms(np.array([64.0, 2048.0])).tolist() == [0.0, 0.0]
