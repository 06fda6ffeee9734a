"""Behaviour of the specs, the KV-capacity arithmetic and the roofline cost model. No wall-clock:
every check is about predicted durations and byte counts."""
from pathlib import Path

import hydra.utils
import pytest
from omegaconf import OmegaConf

from policies.protocols import Executor
from policies.types import StepPlan
from sim.cost.roofline import RooflineCostModel
from sim.core.executor import SimExecutor
from runtime.specs import HardwareSpec, ModelSpec
from runtime.kv_sizing import kv_cache_num_blocks

from factories import decode_plan, hardware_spec, model_spec

CONF = Path(__file__).resolve().parent.parent / "conf"
MODEL_FILES = sorted((CONF / "model").glob("*.yaml"))
HARDWARE_FILES = sorted((CONF / "hardware").glob("*.yaml"))


def prefill_plan(prompt_len: int, num_seqs: int = 1) -> StepPlan:
    """`num_seqs` whole prompts of `prompt_len` tokens, nothing cached."""
    plan = StepPlan()
    plan.num_prefill_tokens = num_seqs * prompt_len
    plan.num_prefill_seqs = num_seqs
    plan.prefill_attention_work = num_seqs * prompt_len * prompt_len
    plan.prefill_context_tokens = num_seqs * prompt_len
    plan.sum_squared_prefill_chunks = num_seqs * prompt_len * prompt_len
    return plan


def swap_plan(num_blocks: int) -> StepPlan:
    plan = StepPlan()
    plan.blocks_to_swap_out = [(i, i) for i in range(num_blocks)]
    return plan


# --- specs ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", MODEL_FILES, ids=lambda p: p.stem)
def test_every_model_config_loads(path):
    spec = ModelSpec.from_config(OmegaConf.load(path))
    assert spec.name == path.stem
    assert spec.num_parameters > 0 and spec.kv_bytes_per_token > 0


@pytest.mark.parametrize("path", HARDWARE_FILES, ids=lambda p: p.stem)
def test_every_hardware_config_loads(path):
    spec = HardwareSpec.from_config(OmegaConf.load(path))
    assert spec.name == path.stem
    assert spec.peak_flops > 0 and spec.memory_bandwidth > 0


def test_shipped_configs_cover_the_paper_models_and_gpus():
    assert {p.stem for p in MODEL_FILES} >= {"llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b",
                                              "opt-13b", "codellama-34b", "tiny-llama"}
    assert {p.stem for p in HARDWARE_FILES} >= {"a100-40gb", "a100-80gb", "h100-80gb", "h200", "cpu",
                                                 "rtx-4090", "rtx-pro-6000", "a800-80gb", "h800-80gb"}


def test_parameter_counts_match_transformers():
    # model.num_parameters() of the HF checkpoints.
    assert model_spec("llama-2-7b").num_parameters == 6_738_415_616
    assert model_spec("llama-3-8b").num_parameters == 8_030_261_248
    assert model_spec("llama-2-70b").num_parameters == 68_976_648_192
    assert model_spec("llama-3.1-8b").num_parameters == 8_030_261_248
    assert model_spec("llama-3-70b").num_parameters == 70_553_706_496
    # Qwen3's per-head q/k norms (2 x 128 weights a layer) are not modelled.
    assert model_spec("qwen3-32b").num_parameters == 32_762_123_264 - 64 * 2 * 128
    assert model_spec("opt-13b").num_parameters == pytest.approx(12.85e9, rel=0.01)
    # Mixtures of experts: every expert and the router counted (MixtralForCausalLM,
    # Qwen3MoeForCausalLM built from the configs on the meta device).
    assert model_spec("mixtral-8x7b").num_parameters == 46_702_792_704
    assert model_spec("qwen3-30b-a3b").num_parameters == 30_532_122_624 - 48 * 2 * 128


def test_a_mixture_runs_each_token_through_its_routed_experts_only():
    dense, moe = model_spec("llama-2-7b"), model_spec("mixtral-8x7b")
    assert dense.active_linear_parameters_per_layer == dense.linear_parameters_per_layer
    assert moe.linear_parameters_per_layer - moe.active_linear_parameters_per_layer \
        == (8 - 2) * moe.expert_parameters


@pytest.mark.parametrize("fields, key", [
    ({"num_experts": 8, "num_experts_per_tok": 9, "moe_intermediate_size": 64},
     "num_experts_per_tok"),
    ({"num_experts": 8, "num_experts_per_tok": 2}, "moe_intermediate_size"),
    ({"num_experts_per_tok": 2}, "num_experts"),
])
def test_bad_expert_fields_are_named(fields, key):
    with pytest.raises(ValueError, match=key):
        ModelSpec(name="m", num_layers=2, hidden_size=64, num_attention_heads=4,
                  intermediate_size=128, vocab_size=100, max_model_len=128, **fields)


def test_opt_13b_keeps_about_800_kb_of_kv_per_token():
    # vLLM paper (Kwon et al., SOSP'23), section 3: 800 KB per token for OPT-13B.
    assert model_spec("opt-13b").kv_bytes_per_token == pytest.approx(800 * 1024, rel=0.05)


def test_kv_bytes_per_block_and_derived_head_dim():
    spec = ModelSpec(name="m", num_layers=2, hidden_size=64, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=128, vocab_size=100, max_model_len=128)
    assert spec.head_dim == 16
    assert spec.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    assert spec.kv_bytes_per_block(16) == 16 * spec.kv_bytes_per_token


def test_unknown_field_is_named():
    config = dict(OmegaConf.to_container(OmegaConf.load(CONF / "model" / "llama-2-7b.yaml")))
    config["num_experts"] = 8
    with pytest.raises(ValueError, match="num_experts"):
        ModelSpec.from_config(config)
    with pytest.raises(ValueError, match="tflops_fp8"):
        HardwareSpec.from_config({**OmegaConf.to_container(OmegaConf.load(CONF / "hardware" / "h100-80gb.yaml")),
                                  "tflops_fp8": 1979})


def test_missing_field_is_named():
    with pytest.raises(ValueError, match="memory_bandwidth_gbps"):
        HardwareSpec.from_config({"name": "x", "memory_gb": 1, "peak_tflops": 1,
                                  "host_to_device_gbps": 1, "interconnect_gbps": 1})


def test_bad_values_name_field_and_allowed_values():
    base = dict(name="m", num_layers=2, hidden_size=64, num_attention_heads=4,
                intermediate_size=128, vocab_size=100, max_model_len=128)
    with pytest.raises(ValueError, match=r"mlp.*'gated', 'plain'"):
        ModelSpec(**base, mlp="swiglu")
    with pytest.raises(ValueError, match=r"dtype_bytes.*\(1, 2, 4\)"):
        ModelSpec(**base, dtype_bytes=3)
    with pytest.raises(ValueError, match="num_layers"):
        ModelSpec(**{**base, "num_layers": 0})
    with pytest.raises(ValueError, match="compute_efficiency"):
        RooflineCostModel(model_spec("tiny-llama"), hardware_spec("cpu"), compute_efficiency=1.5)


# --- KV capacity --------------------------------------------------------------------------------

def test_llama_2_7b_on_a100_80gb_holds_thousands_of_blocks():
    # vLLM logs ~7k 16-token GPU blocks for Llama-2-7B on an A100-80GB at utilisation 0.9.
    blocks = kv_cache_num_blocks(model_spec("llama-2-7b"), hardware_spec("a100-80gb"),
                                 block_size=16)
    assert 5_000 <= blocks <= 8_500


def test_capacity_grows_with_memory_and_utilisation():
    llama = model_spec("llama-2-13b")
    small = kv_cache_num_blocks(llama, hardware_spec("a100-40gb"), 16)
    large = kv_cache_num_blocks(llama, hardware_spec("a100-80gb"), 16)
    largest = kv_cache_num_blocks(llama, hardware_spec("h200"), 16)
    assert 0 < small < large < largest
    assert kv_cache_num_blocks(llama, hardware_spec("a100-80gb"), 16,
                               gpu_memory_utilization=0.5) < large
    # Twice the block size, half the blocks (give or take rounding).
    assert kv_cache_num_blocks(llama, hardware_spec("a100-80gb"), 32) == pytest.approx(large / 2,
                                                                                       abs=1)


def test_opt_13b_on_a100_40gb_leaves_room_for_about_ten_thousand_tokens():
    # vLLM paper, Fig. 1: OPT-13B on an A100-40GB, 26 GB of weights and ~12 GB for KV.
    tokens = 16 * kv_cache_num_blocks(model_spec("opt-13b"), hardware_spec("a100-40gb"), 16)
    assert 8_000 <= tokens <= 20_000


def test_70b_does_not_fit_one_80gb_gpu_but_fits_two():
    llama = model_spec("llama-2-70b")
    with pytest.raises(ValueError, match="does not fit.*tensor_parallel_size"):
        kv_cache_num_blocks(llama, hardware_spec("a100-80gb"), 16)
    assert kv_cache_num_blocks(llama, hardware_spec("a100-80gb"), 16,
                               tensor_parallel_size=2) > 500


def test_tensor_parallel_size_must_divide_heads():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        kv_cache_num_blocks(model_spec("llama-2-7b"), hardware_spec("a100-80gb"), 16,
                            tensor_parallel_size=3)


# --- step time ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_a100():
    return RooflineCostModel(model_spec("llama-2-7b"), hardware_spec("a100-80gb"))


def test_sanity_numbers_for_llama_2_7b_on_a100(llama_a100):
    assert 0.015 <= llama_a100.step_time(decode_plan(32, 1024)) <= 0.025
    assert 0.150 <= llama_a100.step_time(prefill_plan(2048)) <= 0.250


def test_prefill_is_compute_bound_and_about_linear(llama_a100):
    t1, t2, t4 = (llama_a100.step_time(prefill_plan(1024, n)) for n in (1, 2, 4))
    assert t2 / t1 == pytest.approx(2, rel=0.1)
    assert t4 / t2 == pytest.approx(2, rel=0.1)


def test_decode_is_memory_bound_in_batch_size(llama_a100):
    t1, t8 = llama_a100.step_time(decode_plan(1, 128)), llama_a100.step_time(decode_plan(8, 128))
    assert t1 < t8 < 1.2 * t1


def test_decode_grows_with_context(llama_a100):
    times = [llama_a100.step_time(decode_plan(32, ctx)) for ctx in (128, 512, 2048, 4096)]
    assert times == sorted(times) and times[-1] > 1.5 * times[0]


def test_chunked_prefill_with_cached_context_costs_more_attention(llama_a100):
    fresh = prefill_plan(512)
    cached = prefill_plan(512)  # the same chunk after 3k cached tokens
    cached.prefill_attention_work = 512 * (3072 + 512)
    cached.prefill_context_tokens = 3072 + 512
    assert llama_a100.step_time(cached) > llama_a100.step_time(fresh)


def test_tensor_parallel_is_faster_for_70b():
    llama, h100 = model_spec("llama-2-70b"), hardware_spec("h100-80gb")
    tp1, tp2 = (RooflineCostModel(llama, h100, tensor_parallel_size=tp) for tp in (1, 2))
    for plan in (decode_plan(32, 1024), prefill_plan(2048)):
        assert tp2.step_time(plan) < tp1.step_time(plan)


def test_swap_cost_is_proportional_to_blocks_and_empty_plan_is_free(llama_a100):
    assert llama_a100.step_time(StepPlan()) == 0
    overhead = llama_a100.step_time(swap_plan(1)) - (llama_a100.step_time(swap_plan(2)) - llama_a100.step_time(swap_plan(1)))
    swap_10 = llama_a100.step_time(swap_plan(10)) - overhead
    swap_40 = llama_a100.step_time(swap_plan(40)) - overhead
    assert swap_10 > 0
    assert swap_40 == pytest.approx(4 * swap_10)
    # One 16-token Llama-2-7B block is 8 MiB; over ~24 GB/s of PCIe that is ~0.35 ms.
    assert swap_10 / 10 == pytest.approx(8 * 2**20 / 24e9, rel=0.1)
    assert llama_a100.kv_bytes_per_block == 8 * 2**20


def test_copy_on_write_is_cheaper_than_swap(llama_a100):
    copy = StepPlan()
    copy.blocks_to_copy = [(0, 1)] * 10
    assert llama_a100.step_time(StepPlan()) < llama_a100.step_time(copy) < llama_a100.step_time(swap_plan(10))


def test_instantiate_from_hydra_config():
    root = OmegaConf.create({"kv_cache": {"block_size": 32},
                             "cost_model": OmegaConf.load(CONF / "cost_model" / "roofline.yaml")})
    llama, a100 = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    cost_model = hydra.utils.instantiate(root.cost_model, model=llama, hardware=a100, tensor_parallel_size=2)
    assert isinstance(cost_model, RooflineCostModel)
    assert cost_model.model == llama and cost_model.hardware == a100
    assert cost_model.tensor_parallel_size == 2 and cost_model.block_size == 32
    # Without a kv_cache group the block size falls back to 16.
    alone = hydra.utils.instantiate(OmegaConf.load(CONF / "cost_model" / "roofline.yaml"),
                                    model=llama, hardware=a100)
    assert alone.block_size == 16


def test_sim_executor_returns_the_cost_model_duration(llama_a100):
    executor = SimExecutor(llama_a100)
    assert isinstance(executor, Executor)
    plan = decode_plan(4, 100)
    assert executor.execute(plan).duration == llama_a100.step_time(plan)
