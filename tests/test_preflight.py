"""The engine run's checks before it builds anything (engine/preflight.py): a device that is not
there, and a run that would take minutes a step, each stop with one line."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from omegaconf import OmegaConf

from engine.preflight import (MAX_STEP_S, check_engine_run, engine_run_cost, requested_device)
from runtime.policy_config import CONF_DIR
from sim.core.experiment import run_experiment
from runtime.specs import HardwareSpec, ModelSpec

from factories import hardware_spec, make_cfg, model_spec


def conf_entry(group: str, name: str) -> dict:
    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / group / f"{name}.yaml"))


def test_the_cost_is_the_roofline_of_the_models_flops_and_bytes():
    """A decode step of one sequence reads every weight once; a prefill step does 2 FLOPs per
    weight per token plus causal attention, at the rates' peaks."""
    model = ModelSpec(name="m", num_layers=2, hidden_size=64, num_attention_heads=4,
                      intermediate_size=128, vocab_size=100, max_model_len=256, dtype_bytes=4)
    rates = HardwareSpec(name="r", memory_gb=1, peak_tflops=1e-6, memory_bandwidth_gbps=1,
                         host_to_device_gbps=1, interconnect_gbps=1)
    linear = 2 * (64 * 64 * 4 + 3 * 64 * 128)   # q, k, v, o and the gated MLP, per layer
    tokens = 100
    prefill_flops = (2 * linear * tokens + 4 * 2 * 4 * 16 * tokens * tokens / 2 + 2 * 100 * 64)
    cost = engine_run_cost(model, rates, 8e9, tokens)
    assert cost.prefill_step_s == pytest.approx(prefill_flops / 1e6)
    weight_bytes = model.num_parameters * 4
    assert cost.weight_bytes == weight_bytes
    fast_compute = dataclasses.replace(rates, peak_tflops=1e6)
    assert engine_run_cost(model, fast_compute, 8e9, tokens).decode_step_s == pytest.approx(
        weight_bytes / 1e9)
    assert cost.fits and not engine_run_cost(model, rates, weight_bytes, tokens).fits


def test_a_7b_model_on_the_cpu_under_a_gpu_preset_stops_with_its_cost():
    """The trap: `twinserve backend=engine workload.with_token_ids=true` built a random
    Llama-2-7B on the CPU for ten minutes, silently."""
    with pytest.raises(ValueError) as error:
        check_engine_run(conf_entry("model", "llama-2-7b"), conf_entry("hardware", "a100-80gb"),
                         device="cpu")
    message = str(error.value)
    assert "\n" not in message
    assert "model=llama-2-7b (6.74 B parameters) under hardware=a100-80gb, a GPU's preset" in message
    assert "12.6 GiB of 2-byte weights" in message
    # 4,096 tokens x 13.0 GFLOP each plus attention at 0.19 TFLOP/s: five minutes.
    assert "5.04 min a 4,096-token prefill step" in message
    assert "set backend.allow_slow=true to run it anyway" in message


def test_a_slow_model_stops_under_the_cpu_preset_too_and_a_small_one_runs():
    cpu = conf_entry("hardware", "cpu")
    with pytest.raises(ValueError, match=r"5\.04 min a 4,096-token prefill step at cpu's"):
        check_engine_run(conf_entry("model", "llama-2-7b"), cpu, device="cpu")
    # float32 doubles the weights: still one line, the memory named.
    with pytest.raises(ValueError, match=r"25\.1 GiB of 4-byte weights"):
        check_engine_run(conf_entry("model", "llama-2-7b"), cpu, device="cpu", dtype="float32")
    assert check_engine_run(conf_entry("model", "tiny-llama"), cpu, device="cpu") is None
    assert check_engine_run(conf_entry("model", "llama-2-7b"), conf_entry("hardware", "a100-80gb"),
                            device="cpu", allow_slow=True) is None
    # A smaller step budget (chunked prefill) keeps the longest step under the limit.
    llama = model_spec("llama-2-7b")
    assert engine_run_cost(llama, hardware_spec("cpu"), 1e12, 128).longest_step_s < MAX_STEP_S
    assert check_engine_run(conf_entry("model", "llama-2-7b"), cpu, device="cpu",
                            max_num_batched_tokens=128) is None


def test_a_gpu_preset_on_the_cpu_stops_a_small_model_as_well():
    with pytest.raises(ValueError, match=r"under hardware=h100-80gb, a GPU's preset, on the CPU"):
        check_engine_run(conf_entry("model", "tiny-llama"), conf_entry("hardware", "h100-80gb"),
                         device="cpu")


def test_the_run_stops_before_building_anything():
    """Through twinserve's config: the check runs with the run's settings, first."""
    cfg = make_cfg("backend=engine", "backend.device=cpu", "workload.with_token_ids=true")
    with pytest.raises(ValueError, match=r"^backend=engine would run model=llama-2-7b .* "
                                         r"backend\.allow_slow=true to run it anyway$"):
        run_experiment(cfg)


def test_cuda_on_a_machine_without_it_names_backend_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^backend\.device=cuda: CUDA is not available on this "
                                         r"machine \(torch .*\); use backend\.device=cpu"):
        run_experiment(make_cfg("backend=engine", "model=tiny-llama", "hardware=cpu",
                                "backend.device=cuda", "workload.with_token_ids=true"))
    with pytest.raises(ValueError, match=r"^device=cuda:0: CUDA is not available"):
        requested_device("cuda:0", "device")
    with pytest.raises(ValueError, match=r"^backend\.device must be cpu, cuda, cuda:<index> or "
                                         r"null, got 'gpu'"):
        requested_device("gpu")
    assert requested_device(None) == torch.device("cpu")


def test_weights_that_do_not_fit_the_machine_stop_the_run(monkeypatch):
    """Fast enough a step (a small token budget) but more weights than the memory holds."""
    import engine.preflight

    monkeypatch.setattr(engine.preflight, "machine_memory_bytes", lambda device: 8 * 2**30)
    with pytest.raises(ValueError, match=r"12\.6 GiB of 2-byte weights in 8 GiB of RAM \(they do "
                                         r"not fit\)"):
        check_engine_run(conf_entry("model", "llama-2-7b"), conf_entry("hardware", "cpu"),
                         device="cpu", max_num_batched_tokens=128)


def test_fp8_is_a_simulator_setting_the_engine_refuses_in_one_line():
    cpu = conf_entry("hardware", "cpu")
    for key, value in (("quantization", "fp8"), ("kv_cache_dtype", "fp8")):
        model = conf_entry("model", "tiny-llama")
        model[key] = value
        with pytest.raises(ValueError, match=rf"^model\.{key}: the engine runs") as error:
            check_engine_run(model, cpu, device="cpu", allow_slow=True)
        assert "\n" not in str(error.value)
