"""One source of names, defaults and memory arithmetic: the step token budget and the device and
host KV pools both backends size with (a draft model's K/V counted), the policies' names in
conf/ alone, sim/ never importing the engine, and the shared argument validators."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from policies import validators
from sim.core.build import build_router
from runtime.policy_config import policy_config
from sim.core.experiment import run_experiment
from runtime.specs import GIB
from runtime.kv_sizing import kv_cache_num_blocks, kv_cache_num_host_blocks, step_token_budget

from factories import config_kv_blocks, hardware_spec, make_cfg, model_spec

REPO = Path(__file__).resolve().parents[1]


def test_step_token_budget():
    assert step_token_budget(None, 4096) == 4096
    assert step_token_budget(None, 1024) == 2048      # vLLM's floor without chunking
    assert step_token_budget(256, 4096) == 256
    with pytest.raises(ValueError, match=r"^scheduler\.max_num_batched_tokens must be a "
                                         r"positive integer, got 0$"):
        step_token_budget(0, 4096, "scheduler.max_num_batched_tokens")


def test_a_draft_models_weights_and_kv_come_off_the_pool():
    llama, draft = model_spec("llama-2-7b"), model_spec("llama-68m")
    a100 = hardware_spec("a100-80gb")
    alone = kv_cache_num_blocks(llama, a100, 16)
    with_draft = kv_cache_num_blocks(llama, a100, 16, draft=draft)
    target_bytes = llama.kv_bytes_per_block(16)
    block_bytes = target_bytes + draft.kv_bytes_per_block(16)
    assert with_draft < alone
    # The draft's weights and the blocks fit where the target's blocks alone did.
    assert with_draft * block_bytes + draft.weight_bytes <= (alone + 1) * target_bytes
    assert (with_draft + 1) * block_bytes + draft.weight_bytes > alone * target_bytes
    host = kv_cache_num_host_blocks(llama, 16, 4.0, draft=draft)
    assert host == int(4 * GIB // block_bytes) < kv_cache_num_host_blocks(llama, 16, 4.0)


def test_the_simulator_counts_a_draft_models_kv_and_ngram_has_none():
    llama, a100 = model_spec("llama-2-7b"), hardware_spec("a100-80gb")
    plain = make_cfg()
    ngram = make_cfg("speculation=fixed")
    drafted = make_cfg("speculation=fixed", "speculation.draft_model=llama-68m")
    k0 = make_cfg("speculation=fixed", "speculation.draft_model=llama-68m",
                  "speculation.num_speculative_tokens=0")   # never drafts: no draft model
    assert (config_kv_blocks(plain, llama, a100) == config_kv_blocks(ngram, llama, a100)
            == config_kv_blocks(k0, llama, a100) == kv_cache_num_blocks(llama, a100, 16))
    assert config_kv_blocks(drafted, llama, a100) == kv_cache_num_blocks(
        llama, a100, 16, draft=model_spec("llama-68m"))
    result = run_experiment(make_cfg("speculation=fixed", "speculation.draft_model=llama-68m",
                                     "preemption=swap", "workload.num_requests=20"))
    assert result.summary["num_kv_blocks"] == config_kv_blocks(drafted, llama, a100)


# vLLM's own KV memory on an H100 (79.18 GiB) at `vllm serve`'s defaults (8,192 tokens, 1,024
# sequences, utilisation 0.9): llm-d-benchmark's logs of vLLM 0.11 (docs/gpu-cost-model.md,
# "The KV pool"), the model's quantization, its tensor parallel size and the GiB logged.
@pytest.mark.parametrize("model, quantization, tp, logged_gib", [
    ("qwen3-32b", None, 1, 4.45),
    ("qwen3-32b", None, 2, 34.49),
    ("llama-3.1-8b", None, 1, 51.38),
    ("llama-3-70b", "fp8", 2, 32.0),      # Llama-3.3-70B-Instruct-FP8-dynamic: Llama-3's shape
])
def test_the_pool_is_the_kv_memory_vllm_logs_on_an_h100(model, quantization, tp, logged_gib):
    spec = dataclasses.replace(model_spec(model), quantization=quantization)
    blocks = kv_cache_num_blocks(spec, hardware_spec("h100-80gb"), 16, tensor_parallel_size=tp,
                                 max_num_batched_tokens=8192, max_num_seqs=1024)
    # 0.15 GiB: our weights differ from vLLM's loaded bytes by up to 0.08 GiB.
    assert blocks * 16 * spec.kv_bytes_per_token_per_gpu(tp) / GIB == pytest.approx(
        logged_gib, abs=0.15)


def test_the_simulator_sizes_the_pool_for_the_runs_max_num_seqs():
    """vLLM's profile run warms the sampler up over max_num_seqs sequences, so fewer sequences
    leave more of the memory to the pool."""
    qwen, h100 = model_spec("qwen3-32b"), hardware_spec("h100-80gb")
    base = ["model=qwen3-32b", "hardware=h100-80gb", "cluster.tensor_parallel_size=2",
            "scheduler=chunked_prefill"]
    few, many = (config_kv_blocks(make_cfg(*base, f"scheduler.max_num_seqs={n}"), qwen, h100)
                 for n in (64, 1024))
    assert few == kv_cache_num_blocks(qwen, h100, 16, tensor_parallel_size=2,
                                      max_num_batched_tokens=2048, max_num_seqs=64)
    assert many < few


def test_the_engine_backend_sizes_the_pool_with_the_engines_cap():
    """backend=engine on a CPU: the engine's cap (max_num_seqs full-length sequences and
    cpu_kv_cache_gb), taken from the backend's config, not from an import of the engine."""
    pytest.importorskip("torch")
    import torch
    if torch.cuda.is_available():
        pytest.skip("the cap applies on a CPU")
    tiny, cpu = model_spec("tiny-llama"), hardware_spec("cpu")
    base = ["backend=engine", "model=tiny-llama", "hardware=cpu"]
    four_seqs = make_cfg(*base, "scheduler.max_num_seqs=4")
    assert config_kv_blocks(four_seqs, tiny, cpu) == 4 * 2048 // 16
    assert config_kv_blocks(make_cfg(*base, "backend.cpu_kv_cache_gb=0.01"), tiny, cpu) == int(
        0.01 * GIB // tiny.kv_bytes_per_block(16))
    assert config_kv_blocks(make_cfg(*base, "backend.cpu_kv_cache_gb=0.01", "speculation=fixed",
                                     "speculation.draft_model=tiny-llama"), tiny, cpu) == int(
        0.01 * GIB // (2 * tiny.kv_bytes_per_block(16)))


def test_policy_names_are_conf_files():
    assert policy_config("chunked_prefill", "scheduler").max_num_batched_tokens == 2048
    assert policy_config("my.Policy", "scheduler") == {"_target_": "my.Policy"}
    assert policy_config({"_target_": "my.Policy", "k": 2}, "speculation").k == 2
    with pytest.raises(ValueError, match=r"^cluster\.router must be one of least_outstanding, "
                                         r"lora_affinity, prefix_affinity, round_robin \(conf/router\)"):
        build_router("fastest")
    with pytest.raises(ValueError, match="must name its class in _target_"):
        policy_config({"k": 2}, "speculation")
    assert type(build_router("least_outstanding")).__name__ == "LeastOutstandingRouter"


def test_no_name_to_class_map_of_policies_outside_conf():
    pattern = re.compile(r"^\s*(SCHEDULERS|ROUTERS|PREEMPTIONS|SPECULATIONS)\s*=", re.M)
    offenders = [str(path.relative_to(REPO))
                 for folder in ("engine", "sim", "policies")
                 for path in (REPO / folder).rglob("*.py") if pattern.search(path.read_text())]
    assert offenders == []


@pytest.mark.parametrize("check, value, message", [
    (validators.positive_int, 0, "x.y must be a positive integer, got 0"),
    (validators.positive_int, True, "x.y must be a positive integer, got True"),
    (validators.positive_int, 1.5, "x.y must be a positive integer, got 1.5"),
    (validators.non_negative_int, -1, "x.y must be a non-negative integer, got -1"),
    (validators.positive_number, 0.0, "x.y must be a positive number, got 0.0"),
    (validators.non_negative_number, "a", "x.y must be a number >= 0, got 'a'"),
    (validators.fraction, 1.0, r"x.y must be a number in \[0, 1\), got 1.0"),
    (validators.fraction, float("nan"), r"x.y must be a number in \[0, 1\), got nan"),
    (validators.boolean, 1, "x.y must be true or false, got 1"),
])
def test_validators_name_the_argument(check, value, message):
    with pytest.raises(ValueError, match="^" + message + "$"):
        check("x.y", value)


def test_validators_return_good_values():
    assert validators.positive_int("n", 3) == 3
    assert validators.non_negative_int("n", 0) == 0
    assert validators.positive_number("x", 0.5) == 0.5
    assert validators.fraction("x", 0) == 0
    assert validators.number_in("x", 1, 0, 1, low_open=True) == 1
    assert validators.boolean("b", False) is False
